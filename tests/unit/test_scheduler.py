"""The scheduler's rounds with in-process fake backends: every pipeline, failures, isolation."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest
from fake_backends import EOS, BrokenDrafter, FakeDrafter, FakeVerifier, reference
from synthetic_costs import costs

from gateway.backends import BackendError
from gateway.failures import GenerationError
from gateway.round import apply as round_apply
from gateway.round.decide import drafting_beside, fits_in_verify
from gateway.round.messages import DraftItem
from gateway.round.scheduler import Delta, Failed, Finished, GenerationParams, Scheduler
from specd.engine.params import Penalties, SamplingParams
from specd.rpc.serving import penalties_from_pb

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = [[3, 4, 5], [9], [1, 2, 3, 4, 5, 6, 7], [11, 12], [20, 21, 22], [5, 5]]


class CharTokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(65 + i % 26) for i in ids)


def scheduler(verifier: Any, drafter: Any, pipeline: str = "sequential", k: int = 4, **kw: Any) -> Scheduler:
    return Scheduler(
        CharTokenizer(), verifier, drafter, k, 16, [EOS], speculative_mode="fixed", pipeline=pipeline, **kw
    )


async def collect(sched: Scheduler, seq: Any) -> tuple[list[int], Any]:
    ids: list[int] = []
    last: Any = None
    async for event in sched.events(seq):
        if isinstance(event, Delta):
            ids.extend(event.token_ids)
        last = event
    return ids, last


def generate(sched: Scheduler, prompts: list[list[int]], max_tokens: int = 24, **params: Any) -> list[Any]:
    async def main() -> list[Any]:
        sched.start()
        try:
            seqs = [sched.submit(p, GenerationParams(max_tokens, GREEDY, **params)) for p in prompts]
            return await asyncio.gather(*(collect(sched, s) for s in seqs))
        finally:
            await sched.stop()

    return asyncio.run(main())


@pytest.mark.parametrize("pipeline", ["sequential", "cohort", "ahead", "auto"])
@pytest.mark.parametrize("n", [1, 6])
def test_every_pipeline_is_token_identical_to_target_only(pipeline: str, n: int) -> None:
    drafter = FakeDrafter()
    verifier = FakeVerifier(drafter=drafter)
    results = generate(scheduler(verifier, drafter, pipeline), PROMPTS[:n])
    for prompt, (ids, last) in zip(PROMPTS, results, strict=False):
        assert isinstance(last, Finished) and last.reason == "length"
        assert ids == reference(prompt, 24)
    assert verifier.committed == {} and drafter.committed == {}  # every sequence closed on both
    # Each close brought the drafter the tokens it had not been sent: it holds every response whole.
    whole = sorted(tokens for tokens, count in drafter.tails.values() if count == len(tokens))
    assert len(drafter.tails) == n
    assert whole == sorted([*p, *ids] for p, (ids, _) in zip(PROMPTS, results, strict=False))
    # Output would be exact whatever the drafts; what the pipeline must get right is
    # verifying only blocks drafted after exactly the committed tokens.
    assert verifier.stale_blocks == 0
    assert sum(len(t.draft_token_ids) for r in verifier.requests for t in r.tasks) > 0
    # Each draft went with its own q row: no block refused.
    assert verifier.bad_q_blocks == 0
    assert all(len(t.draft_distributions) == len(t.draft_token_ids) for r in verifier.requests for t in r.tasks)


def test_an_ahead_block_sent_with_the_q_of_the_position_before_is_refused_and_counted(monkeypatch) -> None:
    """The fake verifier checks each q row names its draft, as the real one does; the gateway counts
    each refused block (a mutant of gateway.round.apply.ahead_block: q shifted by one position)."""
    original = round_apply.ahead_block

    def shifted(item: DraftItem, proposal: Any) -> Any:
        block = original(item, proposal)
        if block is None or not block.tail:
            return block
        return dataclasses.replace(block, distributions=list(proposal.distributions)[: len(block.tokens)])

    monkeypatch.setattr(round_apply, "ahead_block", shifted)
    drafter = FakeDrafter(wrong=lambda n: False)
    verifier = FakeVerifier(drafter=drafter)
    sched = scheduler(verifier, drafter, "ahead")
    results = generate(sched, PROMPTS)
    for prompt, (ids, _) in zip(PROMPTS, results, strict=True):
        assert ids == reference(prompt, 24)  # exact: a refused block costs a round, not a token
    assert verifier.bad_q_blocks > 0
    assert sched.metrics.refused_draft_blocks._value.get() == verifier.bad_q_blocks


@pytest.mark.parametrize("pipeline", ["sequential", "cohort", "ahead"])
def test_a_feature_drafter_gets_every_verified_hidden_state_once_in_place(pipeline: str) -> None:
    """The verifier's hidden states reach a drafter that reads them: each row at its position, every
    verified position's before each draft, also after the drafter lost its sequences mid-stream."""
    drafter = FakeDrafter(feature_size=1)
    verifier = FakeVerifier(delay_s=0.002, drafter=drafter)
    sched = scheduler(verifier, drafter, pipeline)

    async def main() -> list[Any]:
        sched.start()
        try:
            seqs = [sched.submit(p, GenerationParams(40, GREEDY)) for p in PROMPTS[:4]]
            await asyncio.sleep(0.02)
            # The drafter restarts: it forgets every sequence, and the gateway re-opens them there.
            drafter.committed.clear()
            drafter.cached.clear()
            drafter.hidden.clear()
            return await asyncio.gather(*(collect(sched, s) for s in seqs))
        finally:
            await sched.stop()

    results = asyncio.run(main())
    assert [ids for ids, _ in results] == [reference(p, 40) for p in PROMPTS[:4]]
    assert sum(len(o) for o in drafter.opens) > 4  # re-opened after the restart
    assert all(t.return_hidden_states for r in verifier.requests for t in r.tasks if not t.prefill_tokens)
    sent = [t for r in drafter.requests for t in r.tasks if t.hidden_states]
    assert sent and drafter.misplaced_rows == 0 and drafter.drafted_without_rows == 0
    # Rows already sent are not sent again while the sequence stays open there.
    rows = sum(len(t.hidden_states) // 2 for t in sent)
    positions = sum(len(p) + 40 for p in PROMPTS[:4])
    assert rows < positions * 2


def test_draft_ahead_overlaps_and_uses_its_blocks() -> None:
    verifier, drafter = FakeVerifier(delay_s=0.01), FakeDrafter(wrong=lambda n: False, delay_s=0.005)
    verifier.other, drafter.other = drafter, verifier
    sched = scheduler(verifier, drafter, "ahead")
    [(ids, _)] = generate(sched, [PROMPTS[0]], max_tokens=40)
    assert ids == reference(PROMPTS[0], 40)
    assert verifier.max_busy_with_other or drafter.max_busy_with_other  # both services worked at once
    # A drafter that is always right makes every ahead block valid: after the first
    # drafted round, no draft exchange sits before a verify any more.
    assumed = [t for r in drafter.requests for t in r.tasks if t.assumed_token_ids]
    assert len(assumed) >= 3
    assert sched.metrics.wasted_draft_tokens._value.get() <= 5  # only the last block, past max_tokens


def test_without_drafter_overlap_the_services_never_work_at_once() -> None:
    """Shared cores: the drafter's prefill of joining sequences waits for the verify, and the output is the same."""
    verifier, drafter = FakeVerifier(delay_s=0.03), FakeDrafter()
    drafter.open_delay_s = 0.06
    verifier.other, drafter.other = drafter, verifier
    sched = scheduler(verifier, drafter, "sequential")
    sched.drafter_overlap = False
    results = generate(sched, PROMPTS[:3], max_tokens=30)
    assert [ids for ids, _ in results] == [reference(p, 30) for p in PROMPTS[:3]]
    assert drafter.opens and verifier.max_busy_with_other == 0 and drafter.max_busy_with_other == 0
    assert sum(len(t.draft_token_ids) for r in verifier.requests for t in r.tasks) > 0


def test_a_sequence_joins_the_drafter_beside_the_verify() -> None:
    """The drafter's prefill of a new sequence is off the critical path, even in the sequential pipeline."""
    verifier, drafter = FakeVerifier(delay_s=0.03), FakeDrafter()
    drafter.open_delay_s = 0.06
    verifier.other, drafter.other = drafter, verifier
    results = generate(scheduler(verifier, drafter, "sequential"), PROMPTS[:3], max_tokens=30)
    assert [ids for ids, _ in results] == [reference(p, 30) for p in PROMPTS[:3]]
    assert verifier.max_busy_with_other  # a verify ran while the drafter was opening
    assert drafter.opens and sum(len(t.draft_token_ids) for r in verifier.requests for t in r.tasks) > 0


@pytest.mark.parametrize("pipeline", ["sequential", "ahead"])
@pytest.mark.parametrize("overlap", [True, False])
def test_where_the_services_overlap_a_sequence_drafts_from_its_second_round(overlap: bool, pipeline: str) -> None:
    """Once both opens are timed and the drafter's prefill fits in the verifier's open, a sequence
    opens on the drafter beside its open on the verifier (without overlap: right after it). Its
    first round stays target-only (its first token waits for no drafts) and it drafts from its
    second: no target-only rounds while the drafter prefills."""
    verifier, drafter = FakeVerifier(delay_s=0.01), FakeDrafter(wrong=lambda n: False)
    verifier.open_delay_s = drafter.open_delay_s = 0.05
    verifier.other, drafter.other = drafter, verifier
    sched = scheduler(verifier, drafter, pipeline)
    sched.drafter_overlap = overlap
    # Timed: the drafter prefills 10 tokens in 1 ms, the verifier's open of 10 takes 50 ms.
    sched.drafter_prefill.observe_prefill(10, 1e6)
    sched.drafter_prefill.observe_open(10, 50e6)
    results = generate(sched, PROMPTS[:2], max_tokens=20)
    assert [ids for ids, _ in results] == [reference(p, 20) for p in PROMPTS[:2]]
    opened = {s.sequence_id for o in verifier.opens for s in o}
    first, second = verifier.requests[:2]
    assert {t.sequence_id for t in first.tasks} == {t.sequence_id for t in second.tasks} == opened
    assert not any(t.draft_token_ids for t in first.tasks)
    assert all(t.draft_token_ids for t in second.tasks)
    if overlap:
        assert verifier.max_busy_with_other or drafter.max_busy_with_other  # the two opens ran at once
    else:
        assert verifier.max_busy_with_other == 0 and drafter.max_busy_with_other == 0
    assert drafter.committed == {} and verifier.committed == {}  # every sequence closed on both


def test_auto_requests_join_at_their_open_only_into_a_batch_the_policy_would_draft_for() -> None:
    drafter = FakeDrafter()
    sched = Scheduler(CharTokenizer(), FakeVerifier(drafter=drafter), drafter, 4, 64, [EOS], speculative_mode="auto")
    sched.drafter_prefill.observe_prefill(10, 1e6)
    sched.drafter_prefill.observe_open(10, 50e6)
    one = [sched.submit(PROMPTS[0], GenerationParams(8, GREEDY))]
    many = [sched.submit(PROMPTS[i % len(PROMPTS)], GenerationParams(8, GREEDY)) for i in range(32)]
    # Untimed, the rounds draft the full k to time the services: the drafts need the drafter.
    assert sched._early_joins(one, 10)[0] == one
    # Every verified token costs: drafting pays for one sequence, not for 32.
    sched.policy.costs = costs(verify_fixed_ms=20, verify_per_token_ms=6, step_ms=8, step_per_seq_ms=1)
    assert sched._early_joins(one, 10)[0] == one
    assert sched._early_joins(many, 10)[0] == []
    fixed = [sched.submit(PROMPTS[3], GenerationParams(8, GREEDY, speculation=4)) for _ in range(32)]
    assert sched._early_joins(fixed, 10)[0] == fixed  # a request that names its k drafts whatever auto does
    late = Scheduler(
        CharTokenizer(), FakeVerifier(drafter=drafter), drafter, 4, 64, [EOS], policy_off=frozenset({"early-joins"})
    )
    assert late._early_joins(fixed[:1], 10) == ([], {})  # they join after their first round instead


def test_a_first_rounds_ahead_block_fits_in_its_verify() -> None:
    """Draft-ahead beside a sequence's first (target-only) round drafts no longer than the verify
    takes, so its first token waits for no drafts: a guess and one draft in a 65 ms verify at
    25 ms a step."""
    sched = scheduler(FakeVerifier(), FakeDrafter(), "ahead")
    assert fits_in_verify(sched.policy, sched.k_limit, 1) == 0  # nothing timed yet
    costs = sched.policy.costs
    costs.verify.observe(1, 65e6)
    costs.step.observe(1, 40e6)
    costs.step_beside.observe(1, 25e6)  # the drafter's step beside a verify is what counts
    costs.draft_fixed.observe(1e6)
    assert fits_in_verify(sched.policy, sched.k_limit, 1) == 1
    costs.step_beside.observe(1, 5e6)
    costs.step_beside.observe(1, 5e6)
    assert fits_in_verify(sched.policy, sched.k_limit, 1) >= 4


def test_a_failed_verifier_open_closes_what_the_drafter_opened_beside_it() -> None:
    class FailingOpen(FakeVerifier):
        async def open(self, specs: list[Any]) -> list[Any]:
            await asyncio.sleep(0.05)
            raise BackendError("verifier died")

    drafter = FakeDrafter()
    verifier = FailingOpen(drafter=drafter)
    sched = scheduler(verifier, drafter, "sequential")
    sched.drafter_prefill.observe_prefill(10, 1e6)
    sched.drafter_prefill.observe_open(10, 50e6)
    results = generate(sched, PROMPTS[:2], max_tokens=12)
    assert all(isinstance(last, Failed) for _, last in results)
    assert drafter.opens  # they were opened on the drafter beside the verifier's open
    assert drafter.committed == {}  # and closed there once it failed


def test_a_target_only_request_never_opens_on_the_drafter() -> None:
    drafter = FakeDrafter()
    verifier = FakeVerifier(drafter=drafter)
    results = generate(scheduler(verifier, drafter), PROMPTS[:3], max_tokens=12, speculation=0)
    assert [ids for ids, _ in results] == [reference(p, 12) for p in PROMPTS[:3]]
    assert drafter.opens == [] and drafter.requests == []


def joins_in_two_waves(sched: Scheduler, drafter: FakeDrafter) -> tuple[int, int]:
    """Two prompts, then the other four, through `sched` under auto; checks every output and returns
    how many sequences of each wave were opened on the drafter."""

    async def main() -> tuple[list[Any], int, int]:
        sched.start()
        try:
            first = [sched.submit(p, GenerationParams(24, GREEDY)) for p in PROMPTS[:2]]
            early = await asyncio.gather(*(collect(sched, s) for s in first))
            opened = sum(len(o) for o in drafter.opens)
            later = [sched.submit(p, GenerationParams(24, GREEDY)) for p in PROMPTS[2:]]
            late = await asyncio.gather(*(collect(sched, s) for s in later))
            return early + late, opened, sum(len(o) for o in drafter.opens) - opened
        finally:
            await sched.stop()

    results, first, later = asyncio.run(main())
    assert [ids for ids, _ in results] == [reference(p, 24) for p in PROMPTS]
    return first, later


def test_sequences_join_the_drafter_only_while_the_policy_wants_drafts() -> None:
    """Under auto, once drafting is measured not to pay, new sequences are not opened on the drafter."""
    # A drafter far slower than the verifier, and often wrong: drafting never pays.
    drafter = FakeDrafter(wrong=lambda n: n % 2 == 0, delay_s=0.05)
    verifier = FakeVerifier(drafter=drafter, delay_s=0.001)
    sched = Scheduler(CharTokenizer(), verifier, drafter, 4, 16, [EOS], speculative_mode="auto")
    first, later = joins_in_two_waves(sched, drafter)
    assert sched.policy.costs.ready and first > 0  # the first ones joined, to time the drafter
    assert later == 0  # none of the later ones joined


@pytest.mark.parametrize("open_delay_s", [0.0, 2.0])
def test_a_sequence_joins_the_drafter_only_if_its_drafts_repay_the_join(open_delay_s: float) -> None:
    """Drafting pays (a right, cheap drafter), so under auto every sequence is wanted on the drafter;
    once a join is measured to cost more than a sequence's drafts can save, later ones stay off it.
    The costs are far apart (a join saves about 0.45 s; a dear one costs over 1.4 s, a cheap one nearly 0),
    so that a busy machine's delays cannot swap them. A join costs a round only where the services
    share cores (no overlap): elsewhere it runs beside the rounds, which do not wait for it."""
    drafter = FakeDrafter(wrong=lambda n: False, delay_s=0.001)
    verifier = FakeVerifier(drafter=drafter, delay_s=0.1)
    drafter.open_delay_s = open_delay_s
    sched = Scheduler(CharTokenizer(), verifier, drafter, 4, 16, [EOS], speculative_mode="auto")
    sched.drafter_overlap = False
    first, later = joins_in_two_waves(sched, drafter)
    assert first > 0 and sched.policy.join_ns_per_token.value is not None
    assert (later == 0) if open_delay_s else (later == len(PROMPTS) - 2)
    # The joined sequences drafted in every round they spent on the drafter (a right drafter).
    assert sched.policy.join_follow_through.get() == pytest.approx(1.0)


# n % 7: some blocks are rejected part-way; n % 5 == 2 (with a 7-token prompt and k=4):
# every block is accepted whole and every guess at the verifier's own token is wrong,
# so each ahead block must be thrown away although the committed length matches.
@pytest.mark.parametrize("wrong", [lambda n: n % 7 == 0, lambda n: n % 5 == 2])
def test_draft_ahead_counts_wasted_drafts_when_the_guess_misses(wrong: Any) -> None:
    drafter = FakeDrafter(wrong=wrong)
    verifier = FakeVerifier(drafter=drafter)
    sched = scheduler(verifier, drafter, "ahead")
    [(ids, _)] = generate(sched, [PROMPTS[2]], max_tokens=60)
    assert ids == reference(PROMPTS[2], 60)
    assert sched.metrics.wasted_draft_tokens._value.get() > 0
    assert verifier.stale_blocks == 0


def test_cohorts_alternate_and_overlap() -> None:
    verifier, drafter = FakeVerifier(delay_s=0.01), FakeDrafter(delay_s=0.01)
    verifier.other, drafter.other = drafter, verifier
    sched = scheduler(verifier, drafter, "cohort")
    results = generate(sched, PROMPTS[:4], max_tokens=20)
    assert [ids for ids, _ in results] == [reference(p, 20) for p in PROMPTS[:4]]
    assert verifier.max_busy_with_other or drafter.max_busy_with_other
    # Once both cohorts speculate, a verify carries one cohort only.
    sizes = [len(r.tasks) for r in verifier.requests[4:]]
    assert sizes and max(sizes) <= 3


@pytest.mark.parametrize("pipeline", ["sequential", "cohort", "ahead", "auto"])
def test_a_dead_drafter_costs_speed_never_tokens(pipeline: str) -> None:
    verifier = FakeVerifier()
    results = generate(scheduler(verifier, BrokenDrafter(), pipeline), PROMPTS[:3])
    assert [ids for ids, _ in results] == [reference(p, 24) for p in PROMPTS[:3]]


def test_a_drafter_that_fails_mid_stream_is_survived() -> None:
    verifier, drafter = FakeVerifier(), FakeDrafter()
    sched = scheduler(verifier, drafter, "ahead")

    async def main() -> list[Any]:
        sched.start()
        try:
            seqs = [sched.submit(p, GenerationParams(40, GREEDY)) for p in PROMPTS[:3]]
            await asyncio.sleep(0.05)
            drafter.fail_next = BackendError("stalled")
            return await asyncio.gather(*(collect(sched, s) for s in seqs))
        finally:
            await sched.stop()

    results = asyncio.run(main())
    assert [ids for ids, _ in results] == [reference(p, 40) for p in PROMPTS[:3]]


def test_an_exception_for_one_sequence_fails_that_one_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    sched = scheduler(FakeVerifier(), FakeDrafter())
    original = round_apply.commit
    victim: list[str] = []

    def commit(seq: Any, tokens: list[int], *args: Any) -> None:
        if seq.id in victim and len(seq.output) > 3:
            raise RuntimeError("injected")
        original(seq, tokens, *args)

    monkeypatch.setattr(round_apply, "commit", commit)

    async def main() -> list[Any]:
        sched.start()
        try:
            seqs = [sched.submit(p, GenerationParams(24, GREEDY)) for p in PROMPTS[:4]]
            victim.append(seqs[1].id)
            return await asyncio.gather(*(collect(sched, s) for s in seqs))
        finally:
            await sched.stop()

    results = asyncio.run(main())
    for i, (ids, last) in enumerate(results):
        if i == 1:
            assert isinstance(last, Failed) and last.error.status == 500
            assert "error id" in last.error.message
        else:
            assert isinstance(last, Finished) and ids == reference(PROMPTS[i], 24)


def test_admission_errors_are_classified() -> None:
    verifier = FakeVerifier()

    async def fail_open(specs: list[Any]) -> list[Any]:
        raise KeyError("a bug, not an outage")

    verifier.open = fail_open  # type: ignore[method-assign]
    [(_, last)] = generate(scheduler(verifier, FakeDrafter()), [PROMPTS[0]])
    assert isinstance(last, Failed) and last.error.status == 500 and "error id" in last.error.message

    verifier = FakeVerifier()

    async def unreachable(specs: list[Any]) -> list[Any]:
        raise BackendError("connection refused")

    verifier.open = unreachable  # type: ignore[method-assign]
    [(_, last)] = generate(scheduler(verifier, FakeDrafter()), [PROMPTS[0]])
    assert isinstance(last, Failed) and last.error.status == 503


def test_a_failed_verify_fails_the_round_with_503() -> None:
    verifier = FakeVerifier()
    verifier.fail_next = BackendError("verifier died")
    [(_, last)] = generate(scheduler(verifier, FakeDrafter()), [PROMPTS[0]])
    assert isinstance(last, Failed) and last.error.status == 503


def test_unknown_pipeline_is_refused() -> None:
    sched = scheduler(FakeVerifier(), FakeDrafter())
    with pytest.raises(GenerationError) as info:
        sched.submit([1, 2], GenerationParams(4, GREEDY, pipeline="sideways"))
    assert info.value.status == 400
    with pytest.raises(ValueError):
        scheduler(FakeVerifier(), FakeDrafter(), "sideways")


def test_per_request_pipeline_mixes_in_one_batch() -> None:
    verifier, drafter = FakeVerifier(), FakeDrafter()
    sched = scheduler(verifier, drafter)

    async def main() -> list[Any]:
        sched.start()
        try:
            seqs = [
                sched.submit(p, GenerationParams(20, GREEDY, pipeline=mode))
                for p, mode in zip(PROMPTS, ["sequential", "cohort", "ahead", "cohort", "ahead", None], strict=True)
            ]
            return await asyncio.gather(*(collect(sched, s) for s in seqs))
        finally:
            await sched.stop()

    results = asyncio.run(main())
    assert [ids for ids, _ in results] == [reference(p, 20) for p in PROMPTS]


def test_cohort_sequences_that_do_not_draft_are_verified_every_round() -> None:
    """With k = 0 (the policy found drafting does not pay) cohorts have nothing to overlap:
    every sequence must be verified every round, as target-only."""
    verifier, drafter = FakeVerifier(), FakeDrafter()
    sched = scheduler(verifier, drafter, "cohort", k=0)
    results = generate(sched, PROMPTS[:4], max_tokens=12)
    assert [ids for ids, _ in results] == [reference(p, 12) for p in PROMPTS[:4]]
    # Each request needs 12 verifies; sharing every round, 4 requests need about 12 rounds, not 24.
    assert len(verifier.requests) <= 14


def test_the_wait_for_a_join_is_not_taught_to_the_policy_as_verify_or_round_cost() -> None:
    verifier, drafter = FakeVerifier(delay_s=0.005), FakeDrafter()
    drafter.open_delay_s = 0.2  # a join far slower than a verify
    sched = scheduler(verifier, drafter, "sequential")
    learned: list[Any] = []
    real = sched.policy.observe_round
    sched.policy.observe_round = lambda *a, **kw: learned.append(a) or real(*a, **kw)  # type: ignore[method-assign]
    results = generate(sched, PROMPTS[:2], max_tokens=12)
    assert [ids for ids, _ in results] == [reference(p, 12) for p in PROMPTS[:2]]
    assert drafter.opens
    # (ks, round_ns, draft_ns, verify_ns, ...): no round, nor its verify, learnt as the join's 0.2 s.
    assert learned and max(a[1] for a in learned) < 0.1e9 and max(a[3] for a in learned) < 0.1e9


def test_drafts_beside_the_verify_are_priced_at_the_drafter_s_step_there() -> None:
    sched = scheduler(FakeVerifier(), FakeDrafter(), "cohort")
    a, b, c = (sched.submit(p, GenerationParams(8, GREEDY)) for p in PROMPTS[:3])
    items = [DraftItem(a, 4), DraftItem(b, 2), DraftItem(c, 0, prefill=16)]
    assert drafting_beside(sched.policy, items) == 0  # nothing timed yet
    costs = sched.policy.costs
    costs.verify.observe(1, 65e6)
    costs.step.observe(2, 40e6)
    costs.step_beside.observe(2, 25e6)
    costs.draft_fixed.observe(1e6)
    assert drafting_beside(sched.policy, items) == pytest.approx(1e6 + 4 * 25e6)  # the longest block, two sequences
    assert drafting_beside(sched.policy, items[2:]) == 0  # prefill only


def test_min_tokens_reaches_both_services_with_every_eos_id_the_scheduler_stops_on() -> None:
    drafter = FakeDrafter()
    verifier = FakeVerifier(drafter=drafter)
    sched = Scheduler(CharTokenizer(), verifier, drafter, 4, 16, [EOS, 77], speculative_mode="fixed")
    generate(sched, [PROMPTS[0]], 8, penalties=Penalties.of(min_tokens=5))
    for service in (verifier, drafter):
        (spec,) = [s for opened in service.opens for s in opened]
        penalties = penalties_from_pb(spec.sampling)
        assert penalties.min_tokens == 5 and penalties.eos == tuple(sorted({EOS, 77}))


def test_a_rounds_metrics_are_recorded_once_the_next_rounds_request_is_sent() -> None:
    """Off the round's critical path, yet every round counted: round n's metrics come after the
    first request of round n + 1 (its draft or its verify), and each round's are recorded once."""
    drafter = FakeDrafter()
    verifier = FakeVerifier(drafter=drafter)
    sched = scheduler(verifier, drafter)
    order: list[tuple[str, int]] = []
    verify, draft, observe_round = verifier.verify, drafter.draft, sched.metrics.observe_round

    async def verify_sent(request: Any) -> Any:
        order.append(("request", request.round_id))
        return await verify(request)

    async def draft_sent(request: Any) -> Any:
        order.append(("request", request.round_id))
        return await draft(request)

    def recorded(*args: Any) -> None:
        order.append(("metrics", 0))
        observe_round(*args)

    verifier.verify, drafter.draft = verify_sent, draft_sent  # type: ignore[method-assign]
    sched.metrics.observe_round = recorded  # type: ignore[method-assign]
    [(ids, last)] = generate(sched, [PROMPTS[0]], max_tokens=12)
    assert ids == reference(PROMPTS[0], 12) and isinstance(last, Finished)
    rounds = sorted({n for kind, n in order if kind == "request"})
    firsts = [order.index(("request", n)) for n in rounds]
    records = [i for i, (kind, _) in enumerate(order) if kind == "metrics"]
    assert len(records) == len(rounds) > 2
    assert all(next_sent < record for next_sent, record in zip(firsts[1:], records, strict=False))
    family = next(m for m in sched.metrics.registry.collect() if m.name == "specd_rounds")
    assert next(s.value for s in family.samples if s.name.endswith("_total")) == len(rounds)
