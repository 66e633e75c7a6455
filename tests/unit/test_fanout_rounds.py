"""Fan-out draft-ahead at the gateway (DraftTask.num_branches): which draft-aheads ask for
branches, the drafter's branches checked before anything commits, the branch a verdict confirms
adopted where the main block missed, what that teaches, and the whole round over fake services
with a drafter that fans out, token-identical to target-only."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from fake_backends import EOS, FakeDrafter, FakeVerifier, reference
from test_round_steps import CharTokenizer, K, limits, plan_for, policy, running, verified

from gateway.metrics import GatewayMetrics, RoundTimes
from gateway.round.apply import Applied, apply
from gateway.round.decide import MAX_BRANCHES, Limits, branches_for, decide
from gateway.round.exchange import DraftExchange, assume_block
from gateway.round.messages import Block, DraftItem, DraftVerdicts, RoundPlan, draft_request, proposal_problem
from gateway.round.observer import RoundObserver, RoundOutcome
from gateway.round.prefill_budget import DrafterPrefillBudget
from gateway.round.scheduler import Delta, GenerationParams, Scheduler
from specd.engine.params import Penalties, SamplingParams
from specd.proto.speculative.v1 import common_pb2, drafter_pb2
from specd.rpc.tracing import Tracing

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = [[3, 4, 5], [9], [1, 2, 3, 4, 5, 6, 7], [11, 12], [20, 21, 22], [5, 5]]


# -- decide ---------------------------------------------------------------------------------


def test_only_draft_aheads_ask_for_branches_and_never_more_than_the_other_verdicts() -> None:
    plain, penalised, schema, grammar, named, many = (
        running("a"),
        running("b", penalties=Penalties.of(presence=0.5)),
        running("c", json_schema='{"type": "object"}'),
        running("d", grammar="start: /[a-z]+/"),
        running("e", branches=1),
        running("f", branches=9),
    )
    seqs = [plain, penalised, schema, grammar, named, many]
    plan = plan_for(seqs, "ahead", branches=2)
    # The drafter drafts penalties and grammars one history: no branches; at most MAX_BRANCHES.
    assert {i.seq.id: i.branches for i in plan.ahead} == {"a": 2, "b": 0, "c": 0, "d": 0, "e": 1, "f": MAX_BRANCHES}
    assert all(i.branches == 0 for i in plan.pre_draft)
    for pipeline in ("sequential", "cohort"):
        other = plan_for([running("a"), running("b", branches=2)], pipeline, branches=2)
        assert all(i.branches == 0 for i in [*other.pre_draft, *other.ahead]), pipeline
    # A first round verifies no drafts: its other verdicts are other tokens than the guess.
    assert branches_for(running("g", output=()), 0, limits("ahead", branches=2), 0) == 2


def test_auto_sequences_fan_out_as_the_policy_chooses() -> None:
    p = policy()
    seqs = [running("a"), running("b", branches=0)]
    for s in seqs:
        s.acceptance, s.guess = p.new_sequence(), p.new_guess_rate()
    auto = Limits(K, K - 1, 4096, "auto", "ahead", branches=2)
    plan = decide(seqs, 1, auto, p, 0, DrafterPrefillBudget(0))
    # Untimed, the policy asks the most the flag allows, so the wider exchange gets measured.
    assert {i.seq.id: i.branches for i in plan.ahead} == {"a": 2, "b": 0}
    none = decide(seqs, 2, Limits(K, K - 1, 4096, "auto", "ahead"), p, 0, DrafterPrefillBudget(0))
    assert [i.branches for i in none.ahead] == [0, 0]


def test_the_draft_task_asks_branches_of_draft_aheads_alone() -> None:
    a, b, c = running("a"), running("b"), running("c")
    items = [DraftItem(a, 3, assumed=(5,), branches=2), DraftItem(b, 3, branches=2), DraftItem(c, 0, prefill=4)]
    request = draft_request(1, items, {})
    assert [t.num_branches for t in request.tasks] == [2, 0, 0]
    assert [t.guess_first for t in request.tasks] == [True, False, False]


def test_a_draft_ahead_assumes_the_drafts_verified_and_keeps_its_branches() -> None:
    s = running("a")
    item = DraftItem(s, 4, assumed=(), branches=K + 1)
    block = Block([11, 12, 13], [], len(s.tokens))
    assumed = assume_block(item, {"a": block}, {"a": 1})
    assert (assumed.assumed, assumed.branches) == ((11,), K + 1)
    # No block verified: its branches guess other tokens than the main guess.
    assert assume_block(item, {}, {}).branches == K + 1


# -- the drafter's branches, checked before anything commits ----------------------------------


def proposal(*branches: tuple[int, list[int], int], main_q: bool = True) -> drafter_pb2.DraftProposal:
    """A draft-ahead's proposal (guess 40, drafts 41, 42), with branches (num_assumed, tokens, q rows)."""
    p = drafter_pb2.DraftProposal(sequence_id="a", token_ids=[40, 41, 42])
    if main_q:
        p.distributions.extend(common_pb2.SparseDistribution(token_ids=[t], probs=[1.0]) for t in p.token_ids)
    for assumed, tokens, rows in branches:
        branch = p.branches.add(num_assumed=assumed, token_ids=tokens)
        branch.distributions.extend(common_pb2.SparseDistribution(token_ids=[t], probs=[1.0]) for t in tokens[:rows])
    return p


def test_a_proposal_s_branches_must_answer_the_task() -> None:
    item = DraftItem(running("a"), 3, assumed=(11, 12), branches=2)
    assert proposal_problem(item, proposal((0, [21, 22], 2), (2, [30], 1))) == ""
    assert proposal_problem(item, proposal((1, [21], 0), main_q=False)) == ""  # greedy: no q anywhere
    assert "assumes 3 of 2" in proposal_problem(item, proposal((3, [21], 1)))
    assert "a branch of 0 tokens" in proposal_problem(item, proposal((1, [], 0)))
    assert "a branch of 4 tokens" in proposal_problem(item, proposal((1, [21, 22, 23, 24], 4)))
    assert "distributions" in proposal_problem(item, proposal((1, [21, 22], 1)))
    assert "distributions" in proposal_problem(item, proposal((1, [21, 22], 0)))  # sampled: q for every draft
    assert "more branches" in proposal_problem(item, proposal((0, [21], 1), (1, [22], 1), (2, [23], 1)))
    cohort = DraftItem(running("b"), 3, branches=2)  # drafted after committed tokens: nothing to fan out from
    assert "more branches" in proposal_problem(cohort, proposal((0, [21], 1)))


# -- apply: the branch the verdict confirms --------------------------------------------------


def fanned_out(answer: tuple[int, int]) -> tuple[Any, Applied]:
    """A sequence verified with block [11, 12] while it drafted ahead (guess 40, drafts 50, 51),
    fanning out after "11 accepted, then 41" and "both accepted, then 45"; the verifier's
    (accepted, next token) is `answer`."""
    s = running("a")
    result = verified([s], {"a": [11, 12]}, {"a": answer})
    p = drafter_pb2.DraftProposal(sequence_id="a", token_ids=[40, 50, 51])
    p.branches.add(num_assumed=1, token_ids=[41, 60, 61])
    p.branches.add(num_assumed=2, token_ids=[45, 70])
    result.ahead = DraftExchange(DraftVerdicts(proposals={"a": p}), common_pb2.ServiceTimings(), 0)
    result.ahead_items = [DraftItem(s, 3, (11, 12), branches=2)]
    return s, apply(RoundPlan(verify=[s], ks={"a": 2}), result, {EOS})


def test_the_branch_a_verdict_confirms_replaces_the_main_block_that_missed() -> None:
    s, applied = fanned_out((1, 41))
    assert s.output == [7, 11, 41]
    assert s.block == Block([60, 61], [], len(s.tokens), (11, 41)) and s.block.valid_for(s.tokens)
    assert (applied.branches, applied.branch_hits, applied.branch_outcomes) == (2, 1, [True])
    assert applied.fan_out_misses == 0
    assert applied.wasted == 3 + 2  # the main block (its guess and two drafts), the other branch
    assert applied.guesses == []  # the main block's assumption missed: its guess says nothing


def test_branches_are_wasted_where_the_main_block_stands() -> None:
    s, applied = fanned_out((2, 40))
    assert s.block == Block([50, 51], [], len(s.tokens), (11, 12, 40))
    assert (applied.branches, applied.branch_hits, applied.branch_outcomes) == (2, 0, [])
    assert applied.fan_out_misses == 0
    assert applied.wasted == 3 + 2 and [hit for _, hit in applied.guesses] == [True]


@pytest.mark.parametrize(
    ("answer", "outcomes"),
    [((0, 33), []), ((1, 42), [False]), ((2, 46), [False])],
    ids=["no branch for the verdict", "a rejection, another token than the branch's", "another bonus"],
)
def test_a_verdict_no_branch_guessed_keeps_no_block(answer: tuple[int, int], outcomes: list[bool]) -> None:
    s, applied = fanned_out(answer)
    assert s.block is None and (applied.branch_hits, applied.fan_out_misses) == (0, 1)
    assert applied.branch_outcomes == outcomes  # what the policy learns: the branches whose verdict came
    assert applied.wasted == 3 + 3 + 2


def test_a_sequence_that_finished_adopts_no_branch() -> None:
    s = running("a", max_tokens=3)
    result = verified([s], {"a": [11, 12]}, {"a": (1, 41)})
    p = drafter_pb2.DraftProposal(sequence_id="a", token_ids=[40, 50])
    p.branches.add(num_assumed=1, token_ids=[41, 60])
    result.ahead = DraftExchange(DraftVerdicts(proposals={"a": p}), common_pb2.ServiceTimings(), 0)
    result.ahead_items = [DraftItem(s, 2, (11, 12), branches=1)]
    applied = apply(RoundPlan(verify=[s], ks={"a": 2}), result, {EOS})
    assert s.done and s.block is None and (applied.branch_hits, applied.fan_out_misses) == (0, 0)


def test_observe_counts_branches_and_teaches_their_hit_rate() -> None:
    metrics, p = GatewayMetrics(K), policy()
    outcome = RoundOutcome(1, [], RoundTimes(1, 0, 1, 0, 1, 0, 1), branches=3, branch_hits=1, fan_out_misses=2)
    outcome.branch_outcomes = [True, False]
    RoundObserver(metrics, p, Tracing("test")).observe(outcome)
    assert metrics.registry.get_sample_value("specd_spec_decode_num_branches_total") == 3.0
    assert metrics.registry.get_sample_value("specd_spec_decode_num_branch_hits_total") == 1.0
    assert metrics.registry.get_sample_value("specd_spec_decode_num_fan_out_misses_total") == 2.0
    assert p.branch_hits.value(0.0) == pytest.approx(1 / (2 + 2), rel=0.01)  # two prior weights


# -- the scheduler over fake services whose drafter fans out ------------------------------------


def scheduler(verifier: Any, drafter: Any, pipeline: str = "ahead", branches: int = 2) -> Scheduler:
    return Scheduler(
        CharTokenizer(), verifier, drafter, K, 16, [EOS], speculative_mode="fixed", pipeline=pipeline, branches=branches
    )


def generate(sched: Scheduler, prompts: list[list[int]], max_tokens: int = 40) -> list[list[int]]:
    async def collect(seq: Any) -> list[int]:
        return [t async for e in sched.events(seq) if isinstance(e, Delta) for t in e.token_ids]

    async def main() -> list[list[int]]:
        sched.start()
        try:
            seqs = [sched.submit(p, GenerationParams(max_tokens, GREEDY)) for p in prompts]
            return await asyncio.gather(*(collect(s) for s in seqs))
        finally:
            await sched.stop()

    return asyncio.run(main())


def counter(sched: Scheduler, name: str) -> float:
    return sched.metrics.registry.get_sample_value(name) or 0.0


def pre_drafts(drafter: FakeDrafter) -> int:
    """Draft tasks on the round's critical path (drafted after committed tokens, before a verify)."""
    return sum(1 for r in drafter.requests for t in r.tasks if t.num_draft_tokens and not t.guess_first)


@pytest.mark.parametrize("n", [1, 6])
def test_fan_out_is_token_identical_to_target_only_and_its_branches_are_used(n: int) -> None:
    drafter = FakeDrafter()
    verifier = FakeVerifier(drafter=drafter)
    sched = scheduler(verifier, drafter)
    for prompt, ids in zip(PROMPTS, generate(sched, PROMPTS[:n]), strict=False):
        assert ids == reference(prompt, 40)
    # Only blocks drafted after exactly the committed tokens are verified, adopted branches included.
    assert verifier.stale_blocks == 0 and verifier.bad_q_blocks == 0
    assert drafter.branches > 0 and counter(sched, "specd_spec_decode_num_branches_total") == drafter.branches
    assert counter(sched, "specd_spec_decode_num_branch_hits_total") > 0
    assert sched.policy.branch_hits.tried > 0
    assert max(t.num_branches for r in drafter.requests for t in r.tasks) == 2


def test_a_branch_stands_in_for_a_missed_guess_and_saves_the_critical_path_draft() -> None:
    """n % 5 == 2 with a 7-token prompt and k = 4: every block is accepted whole and every guess
    at the verifier's own token is wrong, so every main ahead block misses; the branch after
    "all accepted, another guess" is right."""
    runs = {}
    for branches in (0, 2):
        drafter = FakeDrafter(wrong=lambda n: n % 5 == 2)
        verifier = FakeVerifier(drafter=drafter)
        sched = scheduler(verifier, drafter, branches=branches)
        [ids] = generate(sched, [PROMPTS[2]], max_tokens=60)
        assert ids == reference(PROMPTS[2], 60) and verifier.stale_blocks == 0
        runs[branches] = (sched, drafter)
    (plain, plain_drafter), (fanned, fanned_drafter) = runs[0], runs[2]
    assert counter(plain, "specd_spec_decode_num_branch_hits_total") == 0
    hits = counter(fanned, "specd_spec_decode_num_branch_hits_total")
    assert hits >= 5
    assert pre_drafts(fanned_drafter) <= pre_drafts(plain_drafter) - hits + 1


def test_non_ahead_pipelines_never_ask_for_branches() -> None:
    for pipeline in ("sequential", "cohort"):
        drafter = FakeDrafter()
        verifier = FakeVerifier(drafter=drafter)
        for prompt, ids in zip(PROMPTS, generate(scheduler(verifier, drafter, pipeline), PROMPTS[:4]), strict=False):
            assert ids == reference(prompt, 40)
        assert all(t.num_branches == 0 for r in drafter.requests for t in r.tasks), pipeline


class BadBranchDrafter(FakeDrafter):
    """Fans out out of protocol: a branch assuming more tokens than the task did, or one q row short."""

    def __init__(self, fault: str) -> None:
        super().__init__()
        self.fault = fault

    def add_branches(self, proposal: Any, committed: list[int], assumed: list[int], n: int, most: int) -> None:
        super().add_branches(proposal, committed, assumed, n, most)
        if self.fault == "num_assumed":
            proposal.branches[0].num_assumed = len(assumed) + 1
        else:
            del proposal.branches[0].distributions[-1]


@pytest.mark.parametrize("fault", ["num_assumed", "distributions"])
def test_a_branch_out_of_protocol_is_refused_before_it_commits_anything(fault: str) -> None:
    drafter = BadBranchDrafter(fault)
    verifier = FakeVerifier(drafter=drafter)
    sched = scheduler(verifier, drafter)
    assert generate(sched, PROMPTS[:2]) == [reference(p, 40) for p in PROMPTS[:2]]
    assert drafter.branches > 0 and counter(sched, "specd_spec_decode_num_branch_hits_total") == 0
    # Refused as any proposal out of protocol: its sequence drafts no more, nothing of it verified.
    fanned = [t for r in drafter.requests for t in r.tasks if t.num_branches]
    assert len(fanned) == 2  # one refused draft-ahead each, and then target-only
    last_fanned = max(i for i, r in enumerate(drafter.requests) if any(t.num_branches for t in r.tasks))
    assert drafter.requests[last_fanned + 1 :] == []
