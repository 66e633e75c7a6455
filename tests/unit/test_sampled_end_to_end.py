"""The default sampled path, end to end: unseeded temperature-1 requests through the gateway's
real Scheduler and the real drafter and verifier engines (their servicers in process, q on the
wire as protobuf), in every pipeline.

A tiny target with a 12-token vocabulary and a drafter initialised independently of it (far:
its q is nowhere near p, so the rejection rule's residual decides often). Two prompts,
alternating; the first two tokens of each sequence must follow the target's own two-token
distribution at temperature 1, computed from the model (chi-square, cells of small
expectation pooled). No verify block may be refused for its q: the gateway's counter of
refused blocks stays 0, so a misaligned q cannot hide as silently lost speculation.

Mutants that must fail: the ahead block's q shifted by one position (each ahead draft sent
with the q of the draft before it), the same in a fan-out branch's block, and each block sent
with the q of another sequence.
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

from drafter_service.engine import ModelDrafter
from gateway.round import apply as round_apply
from gateway.round import decide as round_decide
from gateway.round import exchange as round_exchange
from gateway.round import messages as round_messages
from gateway.round.messages import Block, DraftItem
from gateway.round.scheduler import Delta, Finished, GenerationParams, Scheduler
from specd.engine import sequences
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
# every mutant below gives p-values under DETECTED_P_VALUE.
MIN_P_VALUE = 1e-4
DETECTED_P_VALUE = 1e-6
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
    original = sequences.make_generator

    def make(params: SamplingParams, device: torch.device) -> torch.Generator | None:
        gen = original(params, device)
        return gen.manual_seed(next(counter)) if gen is not None else None

    monkeypatch.setattr(sequences, "make_generator", make)


@dataclasses.dataclass
class Run:
    pairs: list[list[Pair]]  # per prompt
    refused_blocks: float
    drafted: int
    accepted: int
    branch_hits: int = 0


def run(target: Any, draft: Any, pipeline: str, siblings: int = 0, branches: int = 0) -> Run:
    verifier = VerifierEngine(BatchedCausalLM(target, CPU, torch.float32), None, BATCH, 32, K + 1 + siblings)
    lm = BatchedCausalLM(draft, CPU, torch.float32)
    # Two branch slots a sequence: every draft-ahead of the batch fans out in full.
    drafter = ModelDrafter(lm, None, BATCH, 32, K + 1 + siblings, VOCAB, branch_slots=2 * BATCH)
    sched = Scheduler(
        _Tokenizer(),
        EngineVerifier(verifier, BATCH),
        EngineDrafter(drafter, BATCH),
        K,
        BATCH,
        [],  # no end id: every sequence runs to MAX_TOKENS
        speculative_mode="fixed",
        pipeline=pipeline,
        siblings=siblings,
        branches=branches,
        max_waiting=SEQUENCES,
    )
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
            seqs = [sched.submit(PROMPTS[i % 2], GenerationParams(MAX_TOKENS, SAMPLED)) for i in range(SEQUENCES)]
            return await asyncio.gather(*(tokens(s) for s in seqs))
        finally:
            await sched.stop()

    fits = round_decide.fits_in_verify
    if branches:
        # And drafts ahead beside that first round whatever its timings say, so the second token
        # is often decided by a block drafted ahead: with branches, often by a branch's.
        round_decide.fits_in_verify = lambda policy, k_limit, sequences: k_limit
    try:
        outputs = asyncio.run(main())
    finally:
        round_decide.fits_in_verify = fits
    pairs: list[list[Pair]] = [[], []]
    for i, out in enumerate(outputs):
        pairs[i % 2].append((out[0], out[1]))
    m = sched.metrics
    return Run(
        pairs,
        m.refused_draft_blocks._value.get(),
        int(m.num_draft_tokens._value.get()),
        int(m.num_accepted_tokens._value.get()),
        int(m.num_branch_hits._value.get()),
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


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_unseeded_sampling_through_the_scheduler_emits_the_targets_distribution(target, far_draft, joints, pipeline):
    result = run(target, far_draft, pipeline)
    assert result.refused_blocks == 0
    # The sequences drafted (cohorts take turns), the drafts decided tokens often enough for their q to matter, and
    # were rejected often enough for the residual to matter.
    assert result.drafted >= SEQUENCES // 2
    assert 0.1 < result.accepted / result.drafted < 0.9, (result.accepted, result.drafted)
    assert smallest_p_value(joints, result) > MIN_P_VALUE


@pytest.mark.parametrize("pipeline", ["sequential", "cohort"])
def test_unseeded_sampling_with_token_trees_emits_the_targets_distribution(target, far_draft, joints, pipeline):
    """Two siblings beside each chain of two, drawn from the chain's q: the multi-candidate rule
    decides between them, and the pairs still follow the target's joint."""
    result = run(target, far_draft, pipeline, siblings=2)
    assert result.refused_blocks == 0
    assert result.drafted >= SEQUENCES // 2
    assert smallest_p_value(joints, result) > MIN_P_VALUE


def test_unseeded_sampling_with_fan_out_emits_the_targets_distribution(target, near_draft, joints):
    """Draft-ahead with two branches: where the main guess misses (often, with a far drafter), the
    block drafted after the verdict that came is verified instead, and the pairs still follow
    the target's joint: each branch's drafts were drawn from q after exactly that verdict."""
    result = run(target, near_draft, "ahead", branches=2)
    assert result.refused_blocks == 0
    assert result.branch_hits >= SEQUENCES // 10, result.branch_hits
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


@pytest.mark.parametrize(
    ("mutant", "pipeline"),
    [
        ("ahead q shifted by one", "ahead"),
        ("branch q shifted by one", "ahead"),
        ("q of another sequence", "sequential"),
        ("q of another sequence", "cohort"),
        ("siblings' path read as a chain", "sequential"),
    ],
    indirect=["mutant"],
)
def test_a_misaligned_q_fails_the_test(target, far_draft, near_draft, joints, mutant, pipeline):
    # The ahead mutant touches only the sequences whose second token came from a block drafted
    # beside their prefill, and how many do depends on the machine's timing: one run on a busy
    # CI machine left so few that the test missed it (p = 0.025). A mutant the test catches in
    # one of three runs is caught; the unmutated test above gets no such second chance.
    found = []
    for _ in range(3):
        trees, fans = mutant.startswith("siblings"), mutant.startswith("branch")
        draft = near_draft if fans else far_draft
        result = run(target, draft, pipeline, siblings=2 if trees else 0, branches=2 if fans else 0)
        found.append((result.refused_blocks, smallest_p_value(joints, result)))
        if result.refused_blocks > 0 or found[-1][1] < DETECTED_P_VALUE:
            return
    raise AssertionError(f"{mutant} was not detected in 3 runs (refused blocks, smallest p): {found}")
