"""Chunked prefill in the scheduler, with in-process fakes: no head-of-line blocking, same tokens."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest
from fake_backends import FakeDrafter, FakeVerifier, reference
from test_scheduler import GREEDY, collect, generate, scheduler

from gateway.round.messages import plan_prefill
from gateway.round.scheduler import Finished, GenerationParams, _Sequence
from specd.engine.params import LogprobsRequest

LONG = [(5 * i + 1) % 49 + 1 for i in range(97)]
PROMPTS = [[3, 4, 5], LONG, [9], LONG[:40], [11, 12], LONG[10:80]]


def test_plan_prefill_is_first_come_first_served_within_the_budget() -> None:
    assert plan_prefill([("a", 10), ("b", 5), ("c", 7)], 12) == {"a": 10, "b": 2}
    assert plan_prefill([("a", 0), ("b", 5)], 3) == {"b": 3}
    assert plan_prefill([("a", 4)], 0) == {}
    assert plan_prefill([], 8) == {}


@pytest.mark.parametrize("pipeline", ["sequential", "cohort", "ahead", "auto"])
@pytest.mark.parametrize("budget", [1, 7, 64])
def test_chunked_prefill_is_token_identical_and_within_budget(pipeline: str, budget: int) -> None:
    drafter = FakeDrafter()
    verifier = FakeVerifier(drafter=drafter)
    results = generate(scheduler(verifier, drafter, pipeline, prefill_chunk_tokens=budget), PROMPTS)
    for prompt, (ids, last) in zip(PROMPTS, results, strict=True):
        assert isinstance(last, Finished), last
        assert ids == reference(prompt, 24)
    assert verifier.committed == {} and drafter.committed == {}
    assert verifier.stale_blocks == 0
    # Both services prefilled in chunks, never more than the budget in one request.
    for service in (verifier, drafter):
        assert len(service.chunks) > len(PROMPTS)
        for specs in service.opens:
            assert sum(s.prefill_tokens for s in specs) <= budget
    for request in verifier.requests:
        assert sum(t.prefill_tokens for t in request.tasks) <= budget
    for request in drafter.requests:
        assert sum(t.prefill_tokens for t in request.tasks) <= budget
    assert sum(len(t.draft_token_ids) for r in verifier.requests for t in r.tasks) > 0


def test_a_long_prompt_does_not_stall_a_running_stream() -> None:
    """While a long prompt prefills, a chunk a round, the running sequence is verified in every round."""
    verifier = FakeVerifier()
    sched = scheduler(verifier, None, k=0, prefill_chunk_tokens=8)

    async def main() -> Any:
        sched.start()
        try:
            short = sched.submit([3, 4, 5], GenerationParams(40, GREEDY))
            while not verifier.requests:
                await asyncio.sleep(0)
            long = sched.submit(LONG, GenerationParams(4, GREEDY))
            return await asyncio.gather(collect(sched, short), collect(sched, long)), short.id, long.id
        finally:
            await sched.stop()

    (short_out, long_out), short_id, long_id = asyncio.run(main())
    assert short_out[0] == reference([3, 4, 5], 40) and long_out[0] == reference(LONG, 4)
    prefilling = [r for r in verifier.requests if any(t.prefill_tokens for t in r.tasks)]
    assert len(prefilling) >= (len(LONG) - 1) // 8 - 1  # a chunk a round, the first at the open
    for request in prefilling:
        ids = {t.sequence_id: t for t in request.tasks}
        assert ids[long_id].prefill_tokens <= 8
        assert short_id in ids and not ids[short_id].prefill_tokens  # verified meanwhile


def test_prompt_logprob_requests_are_opened_whole() -> None:
    verifier = FakeVerifier()
    results = generate(
        scheduler(verifier, None, k=0, prefill_chunk_tokens=4), [LONG], max_tokens=3, logprobs=LogprobsRequest(0, True)
    )
    assert results[0][0] == reference(LONG, 3)
    assert not verifier.opens[0][0].HasField("prefill_tokens")
    assert verifier.chunks == [(verifier.opens[0][0].sequence_id, len(LONG) - 1)]


def test_off_by_default_opens_whole() -> None:
    verifier = FakeVerifier()
    generate(scheduler(verifier, None, k=0), [LONG], max_tokens=2)
    assert not verifier.opens[0][0].HasField("prefill_tokens")
    assert all(not t.prefill_tokens for r in verifier.requests for t in r.tasks)


def test_plan_leaves_prefilling_sequences_out_of_the_verify() -> None:
    drafter = FakeDrafter()
    sched = scheduler(FakeVerifier(drafter=drafter), drafter, prefill_chunk_tokens=10)
    seqs = [sched.submit(p, GenerationParams(8, GREEDY)) for p in ([1, 2, 3], LONG, LONG[:30])]
    sched.waiting.clear()
    ready, filling, queued = seqs
    filling.prefill_pending, queued.prefill_pending = 6, 29
    plan = sched._decide(list(seqs), 1)
    assert [s.id for s in plan.verify] == [ready.id]
    assert [(s.id, n) for s, n in plan.prefill] == [(filling.id, 6), (queued.id, 4)]
    assert isinstance(ready, _Sequence)


def test_rounds_that_prefill_do_not_teach_the_policy_verify_costs() -> None:
    verifier = FakeVerifier()
    sched = scheduler(verifier, None, k=0, prefill_chunk_tokens=8)
    learned: list[Any] = []
    real = sched.policy.observe_round
    sched.policy.observe_round = lambda *a, **kw: learned.append(a) or real(*a, **kw)  # type: ignore[method-assign]
    generate(sched, [[3, 4, 5], LONG], max_tokens=30)
    with_prefill = [r for r in verifier.requests if any(t.prefill_tokens for t in r.tasks)]
    assert with_prefill and len(learned) == len(verifier.requests) - len(with_prefill)


@pytest.mark.parametrize("chunk", [8, 16])
def test_a_long_prompt_on_a_slow_drafter_catches_up_and_drafts(chunk: int) -> None:
    """The drafter prefills a long prompt over several rounds, beside the verifies, while the
    sequence goes on committing tokens; it still catches up, and then drafts."""
    drafter = FakeDrafter()
    verifier = FakeVerifier(drafter=drafter)
    sched = scheduler(verifier, drafter, prefill_chunk_tokens=chunk)
    sched.drafter_prefill.fits = lambda busy_ns=0.0: 8  # type: ignore[method-assign]  # what fits behind a verify
    [(ids, _)] = generate(sched, [LONG], max_tokens=64)
    assert ids == reference(LONG, 64)
    assert len(drafter.chunks) >= len(LONG) // 8
    drafted = [len(t.draft_token_ids) for r in verifier.requests for t in r.tasks]
    first = next((i for i, n in enumerate(drafted) if n), None)
    # The verifier's own chunks first (if chunked), then the drafter's, 8 a chunk.
    # The drafter's chunks run beside the rounds, one exchange at a time: with these instant
    # fakes each lands within two rounds, which commit two tokens meanwhile.
    verifier_rounds = len(LONG) // chunk + 1
    assert first is not None and first <= verifier_rounds + 2 * (len(LONG) // 6) + 2
    assert sum(drafted) >= 20


def test_without_verifier_chunks_the_drafter_still_prefills_only_what_fits_behind_a_verify() -> None:
    """Whole prompts on the verifier (the default), chunks on the drafter: a sequence joining the
    drafter never makes the round wait for its whole prompt's prefill there."""
    drafter = FakeDrafter()
    verifier = FakeVerifier(drafter=drafter)
    sched = scheduler(verifier, drafter)
    sched.drafter_prefill.fits = lambda busy_ns=0.0: 60  # type: ignore[method-assign]
    prompts = [LONG[:40], LONG[40:80], LONG[:10], LONG[10:20], LONG[20:30], LONG]
    results = generate(sched, prompts)
    assert [ids for ids, _ in results] == [reference(p, 24) for p in prompts]
    # The verifier prefills whole prompts at their opens.
    assert all(not spec.HasField("prefill_tokens") for specs in verifier.opens for spec in specs)
    opened = [spec for specs in drafter.opens for spec in specs]
    assert len(opened) == len(prompts)  # each once
    assert all(spec.HasField("prefill_tokens") for spec in opened)
    for specs in drafter.opens:
        assert sum(spec.prefill_tokens for spec in specs) <= 60
    for request in drafter.requests:
        assert sum(t.prefill_tokens for t in request.tasks) <= 60
    per_sequence = Counter(sid for sid, _ in drafter.chunks)
    assert max(per_sequence.values()) > 1, "the 97-token prompt takes more than one exchange there"
    assert sum(len(t.draft_token_ids) for r in verifier.requests for t in r.tasks) > 0


def test_rounds_that_prefill_on_the_drafter_only_calibrate_the_policy() -> None:
    """Whole prompts on the verifier, chunks on the drafter: every round is observed, and those
    with a drafter chunk beside the verify calibrate the policy without teaching it costs."""
    drafter = FakeDrafter()
    verifier = FakeVerifier(drafter=drafter)
    sched = scheduler(verifier, drafter)
    sched.drafter_prefill.fits = lambda busy_ns=0.0: 8  # type: ignore[method-assign]
    flags: list[bool] = []
    real = sched.policy.observe_round
    sched.policy.observe_round = lambda *a, **kw: flags.append(kw.get("learn_costs", True)) or real(*a, **kw)  # type: ignore[method-assign]
    [(ids, _)] = generate(sched, [LONG], max_tokens=40)
    assert ids == reference(LONG, 40)
    chunked = [r for r in drafter.requests if any(t.prefill_tokens for t in r.tasks)]
    assert len(chunked) > 1
    assert len(flags) == len(verifier.requests)
    assert flags.count(False) == len(chunked)


@pytest.mark.parametrize("drafts_pay", [True, False])
def test_the_drafter_prefills_only_sequences_the_policy_wants_drafts_from(drafts_pay: bool) -> None:
    drafter = FakeDrafter()
    sched = scheduler(FakeVerifier(drafter=drafter), drafter, prefill_chunk_tokens=16)
    seqs = [sched.submit(p, GenerationParams(20, GREEDY)) for p in (LONG, LONG[:50], [1, 2, 3])]
    sched.waiting.clear()
    filling, joining, _ = seqs
    for s in seqs:
        s.output, s.tokens = [7], [*s.prompt, 7]
        s.drafter.want()
    filling.drafter.opened(len(filling.tokens) - 1)  # opened a round ago, most of it left to prefill
    filling.drafter_prefill_pending = 80
    choose = sched.policy.choose
    sched.policy.choose = lambda cands, *a: [c.cap if drafts_pay else 0 for c in cands]  # type: ignore[method-assign]
    plan = sched._decide(list(seqs), 1)
    sched.policy.choose = choose  # type: ignore[method-assign]
    prefilled = [item.seq.id for item in plan.fill]
    joined = [s.id for s in plan.join]
    assert not plan.pre_draft and not any(plan.ks.values())  # none of them drafts this round
    if drafts_pay:
        assert prefilled == [filling.id] and set(joined) == {joining.id, seqs[2].id}
    else:
        assert prefilled == [] and joined == []
    # While a prefill an earlier round started is in flight, the round starts none.
    sched.policy.choose = lambda cands, *a: [c.cap for c in cands]  # type: ignore[method-assign]
    loop = asyncio.new_event_loop()
    sched.exchange.fill_task = loop.create_future()  # type: ignore[assignment]  # never done
    loop.close()
    busy = sched._decide(list(seqs), 2)
    sched.policy.choose = choose  # type: ignore[method-assign]
    assert busy.fill == [] and busy.join == [] and busy.joined_for_auto == []


def test_drafts_beside_the_verify_leave_the_drafter_s_prefill_what_is_left_of_the_verify() -> None:
    """A chunk sized to a whole verify, prefilled in the same exchange as a draft-ahead block,
    would keep the round waiting for the drafter after the verify for as long as the drafts take."""
    drafter = FakeDrafter()
    sched = scheduler(FakeVerifier(drafter=drafter), drafter, "ahead")
    budget = sched.drafter_prefill
    budget.observe_verify(200e6)
    budget.observe_prefill(32, (50 + 32) * 1e6)
    budget.observe_prefill(64, (50 + 64) * 1e6)  # 50 ms an exchange and 1 ms a token: 150 fit beside nothing
    costs = sched.policy.costs
    costs.verify.observe(1, 200e6)
    costs.step.observe(1, 30e6)
    costs.step_beside.observe(1, 30e6)
    seqs = [sched.submit(p, GenerationParams(20, GREEDY)) for p in (LONG, [1, 2, 3])]
    sched.waiting.clear()
    filling, drafting = seqs
    for s in seqs:
        s.output, s.tokens = [7], [*s.prompt, 7]
        s.drafter.want()
        s.drafter.opened(len(s.tokens) - 1)
    filling.drafter_prefill_pending = 80
    choose = sched.policy.choose
    sched.policy.choose = lambda cands, *a: [c.cap for c in cands]  # type: ignore[method-assign]
    plan = sched._decide(list(seqs), 1)
    sched.policy.choose = choose  # type: ignore[method-assign]
    ahead = {item.seq.id: item for item in plan.ahead}
    assert ahead[drafting.id].num_draft_tokens == 5  # the guess, then 4 drafts: 150 ms of the verify's 200
    assert plan.drafter_prefill == budget.tokens(150e6) < budget.tokens()
    assert [(item.seq.id, item.prefill) for item in plan.fill] == [(filling.id, plan.drafter_prefill)]
