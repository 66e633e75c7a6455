"""The default sampled path, end to end: unseeded temperature-1 requests through the gateway's
real Scheduler and the real drafter and verifier engines (their servicers in process, q on the
wire as protobuf), in every pipeline.

A tiny target with a 12-token vocabulary and a drafter initialised independently of it (far:
its q is nowhere near p, so the rejection rule's residual decides often). Two prompts,
alternating; the first two tokens of each sequence must follow the target's own two-token
distribution at temperature 1, computed from the model (chi-square, cells of small
expectation pooled). No verify block may be refused for its q: the gateway's counter of
refused blocks stays 0, so a misaligned q cannot hide as silently lost speculation.

Every block's q is also checked directly: each token the verifier is asked to check must come
with the very distribution the drafter drew it from for that sequence (`QLedger`). That check
catches a misaligned q (the ahead block's q shifted by one position, the same in a fan-out
branch's block, a block sent with another sequence's q) in a few hundred sequences; the
chi-square runs test the rejection rule itself, and the mutant of the verifier's path through a
token tree, which no q check can see.

Nothing here depends on the machine's timing: every pipeline that drafts ahead drafts every
block it may beside the verify (`fits_in_verify` forced), the policy's costs are fixed
(`frozen_costs`) and each run must exercise a floor of ahead and branch verdicts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import tinymodels
import torch
from engine_backends import EngineDrafter, EngineVerifier
from scipy import stats
from synthetic_costs import costs

from drafter_service.engine import ModelDrafter
from gateway.round import apply as round_apply
from gateway.round import decide as round_decide
from gateway.round import exchange as round_exchange
from gateway.round import messages as round_messages
from gateway.round.costs import CostModel
from gateway.round.messages import Block, DraftItem
from gateway.round.scheduler import Delta, Finished, GenerationParams, Scheduler
from specd.engine import sampling
from specd.engine.kvcache import BatchedCausalLM
from specd.engine.params import SamplingParams
from verifier_service.engine import VerifierEngine

CPU = torch.device("cpu")
VOCAB = 12
PROMPTS = ([2, 5, 7], [4, 2, 6])
K = 2
BATCH = 64
SEQUENCES = 2400  # per pipeline, half per prompt
MAX_TOKENS = 3  # the second token may be an ahead draft, verified with one more to go
# Unseeded: a correct pipeline fails one of its two prompts' tests with probability about 2e-4;
# the tree-path mutant below gives p-values far under it (below 1e-6 and 1.3e-6 in two runs).
MIN_P_VALUE = 1e-4
PIPELINES = ("sequential", "cohort", "ahead", "auto")
SAMPLED = SamplingParams(temperature=1.0)  # what a request without temperature or seed asks for

Pair = tuple[int, int]


class _Tokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(65 + i) for i in ids)


@pytest.fixture(scope="module")
def target() -> Any:
    return tinymodels.build_model(0, VOCAB, 0, 1)


@pytest.fixture(scope="module")
def far_draft() -> Any:
    # Independent weights (total variation from the target 0.5 or more at each prompt and after
    # its guess), whose likeliest token at each prompt, draft-ahead's guess, is right about half
    # the time: the ahead blocks are verified often enough for their q to show.
    return tinymodels.build_model(8, VOCAB, 0, 1)


@pytest.fixture(scope="module")
def near_draft(target: Any) -> Any:
    # The target with noise on its weights: its second and third likeliest first tokens are the
    # target's often enough that fan-out branches decide about a third of the second tokens,
    # and it agrees with the target about half the time.
    return tinymodels.perturbed(target, 0.6, 3)


def _probs(model: Any, context: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.softmax(model(torch.tensor([context])).logits[0, -1].double(), -1)


@pytest.fixture(scope="module")
def joints(target: Any) -> list[dict[Pair, float]]:
    """Per prompt, P(first two tokens = (a, b)) under target-only sampling at temperature 1."""
    out = []
    for prompt in PROMPTS:
        first = _probs(target, prompt)
        out.append(
            {(a, b): float(first[a] * _probs(target, [*prompt, a])[b]) for a in range(VOCAB) for b in range(VOCAB)}
        )
    return out


@pytest.fixture(autouse=True)
def counted_generators(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each unseeded sequence's generator as the services make it, but seeded from a counter, so
    the test is repeatable; the drafter's and the verifier's are still independent."""
    counter = itertools.count(1)
    original = sampling.make_generator

    def make(params: SamplingParams, device: torch.device) -> torch.Generator | None:
        gen = original(params, device)
        return gen.manual_seed(next(counter)) if gen is not None else None

    monkeypatch.setattr(sampling, "make_generator", make)


@dataclasses.dataclass
class Run:
    pairs: list[list[Pair]]  # per prompt
    refused_blocks: float
    drafted: int
    accepted: int
    branch_hits: int = 0
    ahead_verdicts: int = 0  # draft-ahead guesses the verifier ruled on
    ledger: QLedger = dataclasses.field(default_factory=lambda: QLedger())


class QLedger:
    """Every (sequence, token, q) the drafter drew, and every draft the verifier was sent checked
    against them: a draft whose q is not the one its token was drawn from, for its sequence, is wrong."""

    def __init__(self) -> None:
        self.drawn: set[tuple[Any, ...]] = set()
        self.checked = 0
        self.wrong = 0

    @staticmethod
    def key(sequence: str, token: int, q: Any) -> tuple[Any, ...]:
        return (sequence, token, tuple(q.token_ids), tuple(round(p, 6) for p in q.probs))

    def record(self, reply: Any) -> None:
        for proposal in reply.proposals:
            blocks = [(proposal.token_ids, proposal.distributions)]
            blocks += [(branch.token_ids, branch.distributions) for branch in proposal.branches]
            for tokens, qs in blocks:
                self.drawn.update(self.key(proposal.sequence_id, t, q) for t, q in zip(tokens, qs, strict=False))

    def check(self, request: Any) -> None:
        for task in request.tasks:
            for token, q in zip(task.draft_token_ids, task.draft_distributions, strict=False):
                self.checked += 1
                self.wrong += self.key(task.sequence_id, token, q) not in self.drawn


class LedgerDrafter(EngineDrafter):
    def __init__(self, engine: ModelDrafter, max_sequences: int, ledger: QLedger) -> None:
        super().__init__(engine, max_sequences)
        self.ledger = ledger

    async def draft(self, request: Any) -> Any:
        reply = await super().draft(request)
        self.ledger.record(reply)
        return reply


class LedgerVerifier(EngineVerifier):
    def __init__(self, engine: VerifierEngine, max_sequences: int, ledger: QLedger) -> None:
        super().__init__(engine, max_sequences)
        self.ledger = ledger

    async def verify(self, request: Any) -> Any:
        self.ledger.check(request)
        return await super().verify(request)


def frozen_costs() -> CostModel:
    """Costs the rounds' own timings never move: a verify dear beside cheap draft steps, so every
    pipeline drafts, whatever this machine's speed."""
    model = costs(verify_fixed_ms=20, verify_per_token_ms=1, step_ms=1)
    for part in (model.verify, model.verify_beside, model.step, model.step_beside, model.draft_fixed, model.overhead):
        part.observe = lambda *args: None  # type: ignore[method-assign]
    model.seed_steps = lambda timings: None  # type: ignore[method-assign]
    return model


def run(
    target: Any, draft: Any, pipeline: str, siblings: int = 0, branches: int = 0, sequences: int = SEQUENCES
) -> Run:
    ledger = QLedger()
    verifier = VerifierEngine(BatchedCausalLM(target, CPU, torch.float32), None, BATCH, 32, K + 1 + siblings)
    lm = BatchedCausalLM(draft, CPU, torch.float32)
    # Two branch slots a sequence: every draft-ahead of the batch fans out in full.
    drafter = ModelDrafter(lm, None, BATCH, 32, K + 1 + siblings, VOCAB, branch_slots=2 * BATCH)
    sched = Scheduler(
        _Tokenizer(),
        LedgerVerifier(verifier, BATCH, ledger),
        LedgerDrafter(drafter, BATCH, ledger),
        K,
        BATCH,
        [],  # no end id: every sequence runs to MAX_TOKENS
        speculative_mode="fixed",
        pipeline=pipeline,
        siblings=siblings,
        branches=branches,
        max_waiting=sequences,
        # What the rounds deliver against the frozen costs would still move the choice.
        policy_off=frozenset({"calibration"}),
    )
    sched.policy.costs = frozen_costs()
    sched.policy.overlap.observe = lambda *args: None  # type: ignore[method-assign]  # perfect, its prior
    # Every sequence joins the drafter at its open, whatever the machine's timings say fits:
    # a sequence that joined after its second token would test nothing here.
    sched.drafter_prefill.fits_beside_open = lambda tokens: 1 << 20  # type: ignore[method-assign]

    async def tokens(seq: Any) -> list[int]:
        ids: list[int] = []
        async for event in sched.events(seq):
            if isinstance(event, Delta):
                ids.extend(event.token_ids)
            else:
                assert isinstance(event, Finished) and event.reason == "length", event
        return ids

    async def main() -> list[list[int]]:
        sched.start()
        try:
            seqs = [sched.submit(PROMPTS[i % 2], GenerationParams(MAX_TOKENS, SAMPLED)) for i in range(sequences)]
            return await asyncio.gather(*(tokens(s) for s in seqs))
        finally:
            await sched.stop()

    fits = round_decide.fits_in_verify
    # Draft ahead beside every first round, so the second token is often decided by a block drafted
    # ahead (with branches, often by a branch's), however fast this machine's verify is.
    round_decide.fits_in_verify = lambda policy, k_limit, sequences: k_limit
    try:
        outputs = asyncio.run(main())
    finally:
        round_decide.fits_in_verify = fits
    pairs: list[list[Pair]] = [[], []]
    for i, out in enumerate(outputs):
        pairs[i % 2].append((out[0], out[1]))
    m = sched.metrics
    guesses = sum(m.ahead_guesses.labels(outcome=o)._value.get() for o in ("right", "wrong"))
    return Run(
        pairs,
        m.refused_draft_blocks._value.get(),
        int(m.num_draft_tokens._value.get()),
        int(m.num_accepted_tokens._value.get()),
        int(m.num_branch_hits._value.get()),
        int(guesses),
        ledger,
    )


def p_value(joint: dict[Pair, float], pairs: list[Pair]) -> float:
    """Chi-square of the pairs against the joint, cells expected under 5 times pooled into one."""
    counts = Counter(pairs)
    n = len(pairs)
    big = [c for c in joint if joint[c] * n >= 5]
    small = [c for c in joint if joint[c] * n < 5]
    observed = [counts[c] for c in big] + [sum(counts[c] for c in small)]
    expected = [joint[c] * n for c in big] + [sum(joint[c] for c in small) * n]
    return float(stats.chisquare(observed, expected).pvalue)


def smallest_p_value(joints: list[dict[Pair, float]], result: Run) -> float:
    return min(p_value(j, p) for j, p in zip(joints, result.pairs, strict=True))


def exercised(result: Run, sequences: int, pipeline: str, branches: int = 0) -> None:
    """The run checked what it is there to check: no block refused for its q, every draft's q the
    one it was drawn from, and (drafting ahead) a verdict on an ahead block for every sequence."""
    assert result.refused_blocks == 0
    assert result.ledger.wrong == 0 and result.ledger.checked >= result.drafted >= sequences // 2
    if pipeline == "ahead":
        assert result.ahead_verdicts >= sequences, result.ahead_verdicts
    if branches:
        assert result.branch_hits >= sequences // 10, result.branch_hits


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_unseeded_sampling_through_the_scheduler_emits_the_targets_distribution(target, far_draft, joints, pipeline):
    """Under auto the policy picks among the pipelines each round (with these costs, mostly
    sequential and cohort): the ahead path is held to its floor by the ahead run."""
    result = run(target, far_draft, pipeline)
    exercised(result, SEQUENCES, pipeline)
    # The drafts decided tokens often enough for their q to matter, and were rejected often enough for the residual to.
    assert 0.1 < result.accepted / result.drafted < 0.9, (result.accepted, result.drafted)
    assert smallest_p_value(joints, result) > MIN_P_VALUE


@pytest.mark.parametrize("pipeline", ["sequential", "cohort"])
def test_unseeded_sampling_with_token_trees_emits_the_targets_distribution(target, far_draft, joints, pipeline):
    """Two siblings beside each chain of two, drawn from the chain's q: the multi-candidate rule
    decides between them, and the pairs still follow the target's joint."""
    result = run(target, far_draft, pipeline, siblings=2)
    exercised(result, SEQUENCES, pipeline)
    assert smallest_p_value(joints, result) > MIN_P_VALUE


def test_unseeded_sampling_with_fan_out_emits_the_targets_distribution(target, near_draft, joints):
    """Draft-ahead with two branches: where the main guess misses (often, with a far drafter), the
    block drafted after the verdict that came is verified instead, and the pairs still follow
    the target's joint: each branch's drafts were drawn from q after exactly that verdict."""
    result = run(target, near_draft, "ahead", branches=2)
    exercised(result, SEQUENCES, "ahead", branches=2)
    assert smallest_p_value(joints, result) > MIN_P_VALUE


# -- the same test, proven able to fail -------------------------------------------------


def _shifted_ahead_block(original: Callable[..., Block | None]) -> Callable[..., Block | None]:
    def block(item: DraftItem, proposal: Any) -> Block | None:
        b = original(item, proposal)
        if b is None or not b.tail:
            return b
        # Each ahead draft with the q of the position before it (the guess's q first).
        return dataclasses.replace(b, distributions=list(proposal.distributions)[: len(b.tokens)])

    return block


def _shifted_branch_blocks(original: Callable[..., list[Block]]) -> Callable[..., list[Block]]:
    def blocks(item: DraftItem, proposal: Any) -> list[Block]:
        # Each branch's drafts with the q of the position before it (its guess's q first).
        return [
            dataclasses.replace(b, distributions=list(branch.distributions)[: len(b.tokens)])
            for b, branch in zip(original(item, proposal), proposal.branches, strict=True)
        ]

    return blocks


def _rotated_q(original: Callable[..., Any]) -> Callable[..., Any]:
    def request(*args: Any, **kwargs: Any) -> Any:
        req = original(*args, **kwargs)
        by_k: dict[int, list[Any]] = {}
        for task in req.tasks:
            if task.draft_distributions:
                by_k.setdefault(len(task.draft_distributions), []).append(task)
        for tasks in by_k.values():
            dists = [list(t.draft_distributions) for t in tasks]
            for task, other in zip(tasks, dists[1:] + dists[:1], strict=True):
                del task.draft_distributions[:]
                task.draft_distributions.extend(other)
        return req

    return request


@pytest.fixture
def mutant(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Iterator[str]:
    name = request.param
    if name == "siblings' path read as a chain":
        # The verifier's path through a sibling committed as the chain's drafts instead.
        monkeypatch.setattr(round_messages, "accepted_path", lambda task, result: list(range(result.num_accepted)))
    elif name == "branch q shifted by one":
        monkeypatch.setattr(round_apply, "branch_blocks", _shifted_branch_blocks(round_apply.branch_blocks))
    elif name == "ahead q shifted by one":
        monkeypatch.setattr(round_apply, "ahead_block", _shifted_ahead_block(round_apply.ahead_block))
    else:
        monkeypatch.setattr(round_exchange, "verify_request", _rotated_q(round_exchange.verify_request))
    yield name


# A few hundred sequences: the ledger sees a misaligned q in the first block that carries one.
LEDGER_SEQUENCES = 240


@pytest.mark.parametrize(
    ("mutant", "pipeline"),
    [
        ("ahead q shifted by one", "ahead"),
        ("branch q shifted by one", "ahead"),
        ("q of another sequence", "sequential"),
        ("q of another sequence", "cohort"),
    ],
    indirect=["mutant"],
)
def test_a_misaligned_q_is_caught(target, far_draft, near_draft, mutant, pipeline):
    fans = mutant.startswith("branch")
    result = run(
        target, near_draft if fans else far_draft, pipeline, branches=2 if fans else 0, sequences=LEDGER_SEQUENCES
    )
    assert result.refused_blocks > 0 or result.ledger.wrong > 0, (result.ledger.checked, result.ledger.wrong)


@pytest.mark.parametrize("mutant", ["siblings' path read as a chain"], indirect=True)
def test_a_tree_path_read_as_a_chain_fails_the_distribution_test(target, far_draft, joints, mutant):
    """Every q is right here: only the distribution of what is emitted can show the wrong path."""
    result = run(target, far_draft, "sequential", siblings=2)
    assert result.ledger.wrong == 0
    # The unmutated test's own threshold: this mutant makes that test fail.
    assert smallest_p_value(joints, result) < MIN_P_VALUE
