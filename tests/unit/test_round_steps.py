"""The round's steps one at a time, in-process: decide as a pure function (given the sequences,
the plan), apply as one (given the services' answers, the commits), observe (given the commits,
the metrics and what the policy learns), and the steps chained over fake services with no
Scheduler."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from fake_backends import EOS, FakeDrafter, FakeVerifier, reference

from gateway.metrics import GatewayMetrics, RoundTimes
from gateway.round import apply as round_apply
from gateway.round.apply import apply
from gateway.round.decide import Limits, decide
from gateway.round.detokenize import TextStream
from gateway.round.drafter_link import DrafterLink
from gateway.round.exchange import DraftExchange, Exchange, RoundResult, spec
from gateway.round.messages import (
    Block,
    DraftItem,
    DraftVerdicts,
    ProtocolError,
    RoundPlan,
    Verdict,
    proposal_problem,
    verify_request,
)
from gateway.round.observer import RoundObserver, RoundOutcome
from gateway.round.prefill_budget import DrafterPrefillBudget
from gateway.round.speculation import PolicyConfig, SpeculationPolicy
from gateway.round.state import Delta, Finished, GenerationParams, Life, _Sequence, opened
from specd.engine.params import Penalties, SamplingParams
from specd.proto.speculative.v1 import common_pb2, drafter_pb2, verifier_pb2
from specd.rpc.tracing import Tracing

GREEDY = SamplingParams(temperature=0.0)
K = 4


class CharTokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(65 + i % 26) for i in ids)


def limits(pipeline: str = "sequential", **kw: Any) -> Limits:
    return Limits(K, K - 1, 4096, "fixed", pipeline, **kw)


def running(
    sid: str,
    output: tuple[int, ...] = (7,),
    prompt: tuple[int, ...] = (1, 2, 3),
    drafting: bool = True,
    max_tokens: int = 20,
    **params: Any,
) -> _Sequence:
    """A sequence open on the verifier, with `output` committed, and (`drafting`) on the drafter."""
    s = _Sequence(
        sid, list(prompt), GenerationParams(max_tokens, GREEDY, **params), max_tokens, TextStream(CharTokenizer(), ())
    )
    s.tokens, s.output = [*prompt, *output], list(output)
    opened(s, 0)
    if drafting:
        s.drafter.want()
        s.drafter.opened(len(s.tokens))
    return s


def policy() -> SpeculationPolicy:
    return SpeculationPolicy(PolicyConfig(k_max=K))


def plan_for(seqs: list[_Sequence], pipeline: str = "sequential", round_id: int = 1, **kw: Any) -> RoundPlan:
    p = policy()
    for s in seqs:
        s.acceptance, s.guess = p.new_sequence(), p.new_guess_rate()
    return decide(seqs, round_id, limits(pipeline, **kw), p, 0, DrafterPrefillBudget(0))


def snapshot(s: _Sequence) -> tuple[Any, ...]:
    return (
        list(s.tokens),
        s.block,
        s.life.state,
        s.drafter.state,
        s.drafter.synced,
        s.rounds_on_drafter,
        s.rounds_drafting,
        s.joined_for_auto,
        s.prefill_pending,
        s.events.qsize(),
    )


# -- decide ---------------------------------------------------------------------------------


def test_decide_sequential_drafts_before_the_verify_and_leaves_first_rounds_target_only() -> None:
    drafting, first, target_only = running("a"), running("b", output=()), running("c", drafting=False)
    plan = plan_for([drafting, first, target_only])
    assert [s.id for s in plan.verify] == ["a", "b", "c"]
    assert [(i.seq.id, i.num_draft_tokens, i.assumed) for i in plan.pre_draft] == [("a", K, None)]
    assert plan.ks == {"a": K}
    assert plan.ahead == [] and plan.join == [] and plan.prefill == []
    # Only those on the drafter with room to draft count towards the policy's follow-through.
    assert [(s.id, drafted) for s, drafted in plan.counted] == [("a", True), ("b", True)]
    assert plan.not_as_chosen  # b's first round runs none of the drafts chosen for it


def test_decide_changes_no_sequence() -> None:
    seqs = [running("a"), running("b", output=()), running("c", drafting=False), running("d")]
    seqs[3].block = Block([5, 6], [], len(seqs[3].tokens))
    seqs[2].drafter.want()  # waiting to join the drafter
    before = [snapshot(s) for s in seqs]
    for pipeline in ("sequential", "cohort", "ahead"):
        plan_for(seqs, pipeline)
    assert [snapshot(s) for s in seqs] == before


def test_decide_verifies_a_block_drafted_earlier_instead_of_drafting_again() -> None:
    s = running("a")
    s.block = Block([5, 6], [], len(s.tokens))
    plan = plan_for([s])
    assert plan.pre_draft == [] and plan.ks == {"a": 2}
    s.block = Block([5, 6], [], len(s.tokens) - 1)  # drafted after other tokens: stale
    plan = plan_for([s])
    assert [i.seq.id for i in plan.pre_draft] == ["a"] and plan.ks == {"a": K}


def test_decide_cohorts_take_turns_the_other_drafting_for_the_next_round() -> None:
    a, b = running("a"), running("b")
    b.cohort = 1
    plan = plan_for([a, b], "cohort", round_id=1)
    assert [s.id for s in plan.verify] == ["b"]
    assert [(i.seq.id, i.num_draft_tokens, i.assumed) for i in plan.ahead] == [("a", K, None)]
    plan = plan_for([a, b], "cohort", round_id=2)
    assert [s.id for s in plan.verify] == ["a"]


def test_decide_draft_ahead_asks_a_guess_and_a_block_beside_the_verify() -> None:
    plan = plan_for([running("a")], "ahead")
    assert [i.seq.id for i in plan.pre_draft] == ["a"]
    # As many drafts as this round's k (within ahead_limit), after a guess at the verifier's token.
    assert [(i.num_draft_tokens, i.assumed) for i in plan.ahead] == [(K - 1 + 1, ())]


def test_decide_leaves_prefilling_sequences_to_their_chunk_and_joins_those_waiting() -> None:
    prefilling, joining = running("p", drafting=False), running("j", drafting=False)
    prefilling.prefill_pending = 30
    joining.drafter.want()
    plan = plan_for([prefilling, joining], prefill_chunk_tokens=8)
    assert [(s.id, n) for s, n in plan.prefill] == [("p", 8)]
    assert [s.id for s in plan.verify] == ["j"] and plan.ks == {}
    assert [s.id for s in plan.join] == ["j"]  # fixed k: it joins to draft from a later round


def test_decide_caps_drafts_by_what_the_sequence_may_still_emit() -> None:
    plan = plan_for([running("a", output=(7, 8), max_tokens=4)])
    assert plan.ks == {"a": 1}  # two left to emit: one draft and the verifier's own token


def test_decide_asks_siblings_where_the_verifier_checks_trees() -> None:
    plain, penalised, named, short = (
        running("a"),
        running("b", penalties=Penalties.of(presence=0.5)),
        running("c", siblings=1),
        running("d", output=(7, 8), max_tokens=4),
    )
    plan = plan_for([plain, penalised, named, short], siblings=2)
    # Penalties follow one history: chains only. k caps the siblings (d may draft one).
    assert {i.seq.id: i.siblings for i in plan.pre_draft} == {"a": 2, "b": 0, "c": 1, "d": 1}
    assert {i.seq.id: i.siblings for i in plan_for([running("a")]).pre_draft} == {"a": 0}
    # The services take five drafts a task: four in the chain leave room for one sibling.
    assert {i.seq.id: i.siblings for i in plan_for([running("a")], siblings=2, draft_room=5).pre_draft} == {"a": 1}


def test_a_tree_block_is_verified_up_to_k_with_the_siblings_of_the_drafts_kept() -> None:
    s = running("a")
    # Chain 11 12 13, then siblings of 12 (parent 0) and of 11 (parent -1).
    block = Block([11, 12, 13, 22, 21], [], len(s.tokens), parents=(-1, 0, 1, 0, -1))
    assert block.chain == 3
    assert block.tree(3) == ([0, 1, 2, 3, 4], [-1, 0, 1, 0, -1])
    assert block.tree(1) == ([0, 4], [-1, -1])  # 12 is not verified: nor is its sibling
    task = verify_request(1, [s], {"a": block}, {"a": 2}, {}).tasks[0]
    assert list(task.draft_token_ids) == [11, 12, 22, 21] and list(task.draft_parents) == [-1, 0, 0, -1]
    chain = verify_request(1, [s], {"a": Block([11, 12], [], len(s.tokens))}, {"a": 2}, {}).tasks[0]
    assert list(chain.draft_parents) == []


def test_a_proposal_that_is_not_a_chain_and_siblings_within_the_task_is_refused() -> None:
    item = DraftItem(running("a"), 2, siblings=1)

    def problem(tokens: list[int], parents: list[int]) -> str:
        return proposal_problem(item, drafter_pb2.DraftProposal(token_ids=tokens, parents=parents))

    assert problem([5, 6, 7], [-1, 0, -1]) == ""
    assert problem([5, 6], []) == ""
    assert "more than asked" in problem([5, 6, 7, 8], [-1, 0, -1, 0])  # two siblings, one asked
    assert "more than asked" in problem([5, 6, 7], [-1, 0, 1])  # a chain of three, two asked
    assert "malformed" in problem([5, 6, 7], [-1, 0, 1 + 1])  # beside a draft the chain has not
    assert "malformed" in problem([5, 6, 7], [-1, 0])


def tree_result(s: _Sequence, path: list[int], nxt: int) -> RoundResult:
    block = Block([11, 12, 22], [], len(s.tokens), parents=(-1, 0, 0))
    request = verify_request(1, [s], {"a": block}, {"a": 2}, {})
    reply = verifier_pb2.VerifyResponse(round_id=1)
    reply.results.add(sequence_id="a", num_accepted=len(path), next_token_id=nxt, accepted_path=path)
    return RoundResult(request, reply, {"a": block}, {"a": 2}, None, [], None, 0, RoundTimes(1, 0, 1, 0, 1, 0, 1))


def test_apply_commits_a_tree_s_accepted_path_through_a_sibling() -> None:
    s = running("a")
    applied = apply(RoundPlan(verify=[s], ks={"a": 2}), tree_result(s, [0, 2], 40), {EOS})
    assert s.output == [7, 11, 22, 40]
    [v] = applied.verdicts
    assert (v.drafted, v.accepted, v.siblings, v.sibling_hit) == (2, 2, 1, True)
    metrics, p = GatewayMetrics(K), policy()
    s.acceptance = p.new_sequence()
    RoundObserver(metrics, p, Tracing("test")).observe(
        RoundOutcome(1, applied.verdicts, RoundTimes(1, 0, 1, 0, 1, 0, 1))
    )
    # The chain's second draft was rejected (the sibling beside it was the target's token).
    assert (s.acceptance.tried[:2], s.acceptance.accepted[:2]) == ([1.0, 1.0], [1.0, 0.0])
    assert metrics.registry.get_sample_value("specd_spec_decode_num_accepted_siblings_total") == 1.0
    assert metrics.registry.get_sample_value("specd_spec_decode_num_sibling_tokens_total") == 1.0


def test_apply_commits_a_tree_whose_every_draft_was_rejected() -> None:
    s = running("a")
    applied = apply(RoundPlan(verify=[s], ks={"a": 2}), tree_result(s, [], 40), {EOS})
    assert s.output == [7, 40] and applied.verdicts[0].sibling_hit is False


@pytest.mark.parametrize("path", [[1], [0, 1, 2], [2]])
def test_apply_refuses_a_path_that_is_not_in_the_tree(path: list[int]) -> None:
    s = running("a")
    with pytest.raises(ProtocolError):
        apply(RoundPlan(verify=[s], ks={"a": 2}), tree_result(s, path, 40), {EOS})
    assert s.output == [7]


# -- apply ----------------------------------------------------------------------------------


def verified(seqs: list[_Sequence], blocks: dict[str, list[int]], answers: dict[str, tuple[int, int]]) -> RoundResult:
    """The verifier's reply to verifying `blocks`: for each sequence (accepted drafts, next token)."""
    block_of = {sid: Block(tokens, [], len(s.tokens)) for s in seqs for sid, tokens in blocks.items() if sid == s.id}
    ks = {s.id: len(blocks.get(s.id, ())) for s in seqs}
    request = verify_request(1, seqs, block_of, ks, {})
    reply = verifier_pb2.VerifyResponse(round_id=1)
    for s in seqs:
        accepted, nxt = answers[s.id]
        reply.results.add(sequence_id=s.id, num_accepted=accepted, next_token_id=nxt)
    return RoundResult(request, reply, block_of, ks, None, [], None, 0, RoundTimes(1, 0, 1, 0, 1, 0, 1))


def expected_commit(result: RoundResult, sid: str) -> list[int]:
    """What the verifier's answer commits for one sequence, read from the messages themselves."""
    task = next(t for t in result.request.tasks if t.sequence_id == sid)
    answer = next(r for r in result.reply.results if r.sequence_id == sid)
    return [*task.draft_token_ids[: answer.num_accepted], answer.next_token_id]


def check_commits(seqs: list[_Sequence], before: dict[str, list[int]], result: RoundResult) -> None:
    for s in seqs:
        assert s.tokens == before[s.id] + expected_commit(result, s.id), s.id
        deltas = [e for e in list(s.events._queue) if isinstance(e, Delta)]  # type: ignore[attr-defined]
        assert [t for d in deltas for t in d.token_ids] == s.output[-len(expected_commit(result, s.id)) :]


def test_apply_commits_the_accepted_drafts_and_the_verifier_s_token() -> None:
    a, b = running("a"), running("b")
    plan = RoundPlan(verify=[a, b], ks={"a": 3, "b": 2})
    result = verified([a, b], {"a": [11, 12, 13], "b": [21, 22]}, {"a": (2, 40), "b": (0, 41)})
    before = {s.id: list(s.tokens) for s in (a, b)}
    applied = apply(plan, result, {EOS})
    check_commits([a, b], before, result)
    assert a.output == [7, 11, 12, 40] and b.output == [7, 41]
    assert (a.drafted, a.accepted, b.drafted, b.accepted) == (3, 2, 2, 0)
    assert [(v.seq.id, v.drafted, v.accepted) for v in applied.verdicts] == [("a", 3, 2), ("b", 2, 0)]
    assert [(e.seq.id, e.tokens) for e in applied.emitted] == [("a", 3), ("b", 1)]
    assert applied.finished == [] and not a.done and not b.done


@pytest.mark.parametrize("mutant", ["one_more", "all_drafts"])
def test_a_wrong_commit_is_caught(monkeypatch: pytest.MonkeyPatch, mutant: str) -> None:
    """The check above fails for an apply that commits drafts the verifier did not accept."""
    read = round_apply.read_verdicts

    def wrong(request: Any, reply: Any, seqs: Any) -> list[Verdict]:
        out = []
        for v, task in zip(read(request, reply, seqs), request.tasks, strict=True):
            extra = 1 if mutant == "one_more" else len(task.draft_token_ids) - v.accepted
            drafts = tuple(task.draft_token_ids[: v.accepted + extra])
            out.append(Verdict(v.seq, v.drafted, v.accepted + extra, (*drafts, v.tokens[-1])))
        return out

    monkeypatch.setattr(round_apply, "read_verdicts", wrong)
    a = running("a")
    result = verified([a], {"a": [11, 12, 13]}, {"a": (1, 40)})
    before = {"a": list(a.tokens)}
    apply(RoundPlan(verify=[a], ks={"a": 3}), result, {EOS})
    with pytest.raises(AssertionError):
        check_commits([a], before, result)


def test_apply_finishes_on_eos_and_on_the_length_limit() -> None:
    eos, length = running("e"), running("l", max_tokens=3)
    result = verified([eos, length], {"e": [11, EOS, 13], "l": [21, 22, 23]}, {"e": (3, 40), "l": (3, 41)})
    applied = apply(RoundPlan(verify=[eos, length], ks={"e": 3, "l": 3}), result, {EOS})
    assert eos.output == [7, 11, EOS] and length.output == [7, 21, 22]
    assert [(s.id, reason) for s, reason in applied.finished] == [("e", "stop"), ("l", "length")]
    assert eos.life.state is Life.DONE and length.life.state is Life.DONE
    finished = [e for e in list(length.events._queue) if isinstance(e, Finished)]  # type: ignore[attr-defined]
    # The one verify step that carried drafts: 3 drafted, all 3 accepted (the per-request statistics).
    assert finished == [Finished("length", 3, 3, ((3, 3),))]


def test_apply_refuses_a_reply_out_of_protocol_before_committing_anything() -> None:
    a, b = running("a"), running("b")
    result = verified([a, b], {"a": [11]}, {"a": (0, 40), "b": (0, 41)})
    result.reply.results[0].sequence_id, result.reply.results[1].sequence_id = "b", "a"
    with pytest.raises(ProtocolError):
        apply(RoundPlan(verify=[a, b], ks={"a": 1}), result, {EOS})
    result = verified([a], {"a": [11]}, {"a": (2, 40)})  # accepts more drafts than it was sent
    with pytest.raises(ProtocolError):
        apply(RoundPlan(verify=[a], ks={"a": 1}), result, {EOS})
    assert a.output == [7] and b.output == [7]


def test_apply_keeps_an_ahead_block_whose_assumption_held_and_drops_one_that_missed() -> None:
    held, missed = running("h"), running("m")
    result = verified([held, missed], {"h": [11, 12], "m": [21, 22]}, {"h": (2, 40), "m": (1, 41)})
    # Drafted beside the verify, assuming the whole block accepted: the first token guesses the verifier's.
    proposals = {
        "h": drafter_pb2.DraftProposal(sequence_id="h", token_ids=[40, 50, 51]),
        "m": drafter_pb2.DraftProposal(sequence_id="m", token_ids=[45, 60, 61]),
    }
    result.ahead = DraftExchange(DraftVerdicts(proposals=proposals), common_pb2.ServiceTimings(), 0)
    result.ahead_items = [DraftItem(held, 3, (11, 12)), DraftItem(missed, 3, (21, 22))]
    applied = apply(RoundPlan(verify=[held, missed], ks={"h": 2, "m": 2}), result, {EOS})
    assert held.block == Block([50, 51], [], len(held.tokens), (11, 12, 40))
    assert held.block.valid_for(held.tokens)
    assert missed.block is None and applied.wasted == 3  # two drafts and the guess
    assert [(s.id, hit) for s, hit in applied.guesses] == [("h", True)]


def test_apply_commits_what_the_plan_taught_each_sequence() -> None:
    a, b = running("a"), running("b")
    plan = RoundPlan(verify=[a, b], counted=[(a, True), (b, False)], joined_for_auto=[b])
    apply(plan, verified([a, b], {}, {"a": (0, 40), "b": (0, 41)}), {EOS})
    assert (a.rounds_on_drafter, a.rounds_drafting, a.joined_for_auto) == (1, 1, False)
    assert (b.rounds_on_drafter, b.rounds_drafting, b.joined_for_auto) == (1, 0, True)


def test_an_exception_applying_one_verdict_fails_that_sequence_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = running("a"), running("b")
    commit = round_apply.commit

    def broken(seq: Any, *args: Any) -> None:
        if seq.id == "a":
            raise RuntimeError("injected")
        commit(seq, *args)

    monkeypatch.setattr(round_apply, "commit", broken)
    apply(RoundPlan(verify=[a, b]), verified([a, b], {}, {"a": (0, 40), "b": (0, 41)}), {EOS})
    assert a.life.state is Life.FAILED and b.output == [7, 41] and not b.done


# -- the steps chained, no Scheduler ----------------------------------------------------------


@pytest.mark.parametrize(
    ("pipeline", "siblings"), [("sequential", 0), ("cohort", 0), ("ahead", 0), ("sequential", 2), ("cohort", 2)]
)
@pytest.mark.parametrize("overlap", [True, False])
def test_decide_exchange_apply_over_fake_services_match_target_only(
    pipeline: str, siblings: int, overlap: bool
) -> None:
    drafter = FakeDrafter()
    verifier = FakeVerifier(drafter=drafter)
    prompts = [[3, 4, 5], [9], [1, 2, 3, 4, 5, 6, 7]]
    seqs = [
        _Sequence(f"s{i}", p, GenerationParams(16, GREEDY), 16, TextStream(CharTokenizer(), ()), tokens=list(p))
        for i, p in enumerate(prompts)
    ]
    for i, s in enumerate(seqs):
        s.cohort = i % 2
    p = policy()
    link = DrafterLink(drafter, None, lambda: None)
    exchange = Exchange(verifier, drafter, link, DrafterPrefillBudget(0), overlap, lambda: seqs)

    async def main() -> None:
        await verifier.open([spec(s) for s in seqs])
        for s in seqs:
            opened(s, 0)
            s.drafter.want()
        await exchange.join(seqs, [], True)
        for round_id in range(1, 60):
            live = [s for s in seqs if not s.done]
            if not live:
                return
            for s in live:
                s.acceptance, s.guess = s.acceptance or p.new_sequence(), s.guess or p.new_guess_rate()
            plan = decide(live, round_id, limits(pipeline, siblings=siblings), p, 0, exchange.drafter_prefill)
            apply(plan, await exchange.run(plan, round_id, {}), {EOS})

    asyncio.run(main())
    for s, prompt in zip(seqs, prompts, strict=True):
        assert s.output == reference(prompt, 16) and s.life.state is Life.DONE
    assert verifier.stale_blocks == 0
    assert sum(len(t.draft_token_ids) for r in verifier.requests for t in r.tasks) > 0
    trees = sum(bool(t.draft_parents) for r in verifier.requests for t in r.tasks)
    assert (trees > 0, verifier.sibling_hits > 0) == (siblings > 0, siblings > 0)


# -- observe --------------------------------------------------------------------------------


def test_observe_records_what_apply_committed() -> None:
    metrics, p = GatewayMetrics(K), policy()
    observer = RoundObserver(metrics, p, Tracing("test"))
    a, b = running("a"), running("b", max_tokens=3)
    b.joined_for_auto, b.rounds_on_drafter, b.rounds_drafting = True, 4, 1
    result = verified([a, b], {"a": [11, 12], "b": [21, 22]}, {"a": (1, 40), "b": (2, 41)})
    applied = apply(RoundPlan(verify=[a, b], ks={"a": 2, "b": 2}), result, {EOS})
    observer.observe_commits(applied.emitted, applied.finished)

    def sample(name: str, **labels: str) -> float:
        return metrics.registry.get_sample_value(name, labels) or 0.0

    assert sample("specd_generation_tokens_total") == 2 + 2  # b stops at its length
    assert sample("specd_time_to_first_token_seconds_count") == 2  # the first tokens these sequences emitted
    assert sample("specd_request_success_total", finished_reason="length") == 1
    assert p.output_tokens.value == 3.0  # the finished sequence's length, for pricing joins
    assert p.join_follow_through.value == pytest.approx(0.25)  # it drafted in 1 of its 4 rounds there
