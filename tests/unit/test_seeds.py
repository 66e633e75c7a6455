"""Seeded sampling through the real drafter and verifier engines (in-process, tiny models).

A seeded request's tokens must be the target-only tokens for that seed whatever
k is, per round or per sequence, whatever else is in the batch, and whether or
not a drafter takes part. The reference is computed here from the target model
alone (full forward, no cache, no engine).
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from drafter_service.engine import ModelDrafter
from drafter_service.ngram_engine import NgramDrafter
from specd.engine.params import SamplingParams
from specd.engine.sampling import gumbel_argmax, position_keys, probabilities
from specd.engine.tasks import DraftTask, SequenceSpec, VerifyTask
from verifier_service.engine import VerifierEngine

CPU = torch.device("cpu")
NEW_TOKENS = 12
TEXTS = [
    "Hello world, this is a test.",
    "The quick brown fox jumps over the lazy dog.",
    "1, 2, 3, 4, 5, 6",
    "a",
    "def add(a, b):\n    return a + b",
    "Speculative decoding splits generation into a cheap draft and an exact verification.",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time",
]
PARAMS = [
    SamplingParams(temperature=0.8, top_p=0.9, seed=11),
    SamplingParams(temperature=1.0, seed=12),
    SamplingParams(temperature=1.3, top_k=20, seed=13),
    SamplingParams(temperature=0.6, top_k=50, top_p=0.95, seed=2**64 - 1),
    SamplingParams(temperature=1.0, seed=0),
    SamplingParams(temperature=0.9, top_p=0.8, seed=987654321),
    SamplingParams(temperature=1.1, seed=5),
    SamplingParams(temperature=0.7, top_k=5, seed=77),
]

KChoice = Callable[[str, int], int]  # (sequence id, round) -> k; 0 = target-only round


@pytest.fixture(scope="module")
def prompts(tok) -> dict[str, list[int]]:
    return {f"s{i}": tok.encode(text) for i, text in enumerate(TEXTS)}


@pytest.fixture(scope="module")
def params(prompts) -> dict[str, SamplingParams]:
    return dict(zip(prompts, PARAMS, strict=True))


def target_only(model, prompt: list[int], params: SamplingParams, new_tokens: int) -> list[int]:
    """What target-only sampling with this seed emits: argmax(log p + g(seed, position)) per step."""
    assert params.seed is not None
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1:].float()
            keys = position_keys(params.seed, len(ids), 1, CPU)
            ids.append(int(gumbel_argmax(probabilities(logits, [params]), keys)[0]))
    return ids[len(prompt) :]


@pytest.fixture(scope="module")
def references(tiny_target, prompts, params) -> dict[str, list[int]]:
    return {sid: target_only(tiny_target, prompts[sid], params[sid], NEW_TOKENS) for sid in prompts}


def generate(
    verifier: VerifierEngine,
    drafter: ModelDrafter | NgramDrafter | None,
    prompts: dict[str, list[int]],
    params: dict[str, SamplingParams],
    k_of: KChoice,
    drafter_down: Callable[[int], bool] = lambda r: False,
) -> tuple[dict[str, list[int]], int, int]:
    """Rounds as the gateway runs them; returns (outputs, drafted, accepted).

    drafter_down(r): the drafter is unreachable in round r (those rounds are
    target-only); when it is back, its sequences are re-opened from the committed
    tokens, as the gateway does after a drafter restart.
    """
    specs = [SequenceSpec(sid, list(prompts[sid]), params[sid]) for sid in prompts]
    assert verifier.open(specs)[0] == [None] * len(specs)
    if drafter is not None:
        assert drafter.open(specs)[0] == [None] * len(specs)
    committed = {sid: list(p) for sid, p in prompts.items()}
    unsent: dict[str, list[int]] = {sid: [] for sid in prompts}
    active = sorted(prompts)
    drafted = accepted = 0
    was_down = False
    r = 0
    while active:
        down = drafter is None or drafter_down(r)
        if was_down and not down and drafter is not None:
            drafter.close(active)
            assert drafter.open([SequenceSpec(s, list(committed[s]), params[s]) for s in active])[0] == [None] * len(
                active
            )
            for sid in active:
                unsent[sid] = []
        was_down = down
        drafts = {sid: [] for sid in active}
        if not down:
            assert drafter is not None
            ks = {sid: min(k_of(sid, r), NEW_TOKENS - (len(committed[sid]) - len(prompts[sid])) - 1) for sid in active}
            proposals, _ = drafter.draft([DraftTask(s, unsent[s], len(committed[s]), ks[s]) for s in active])
            for sid, proposal in zip(active, proposals, strict=True):
                assert proposal.error is None, proposal.error
                assert proposal.dists == []  # seeded: the coupling needs no q
                drafts[sid] = proposal.tokens
                unsent[sid] = []
        results, _ = verifier.verify([VerifyTask(s, len(committed[s]), drafts[s]) for s in active])
        for sid, result in zip(active, results, strict=True):
            assert result.error is None, result.error
            emitted = [*drafts[sid][: result.num_accepted], result.next_token]
            committed[sid] += emitted
            unsent[sid] += emitted
            drafted += len(drafts[sid])
            accepted += result.num_accepted
        for sid in list(active):
            if len(committed[sid]) - len(prompts[sid]) >= NEW_TOKENS:
                active.remove(sid)
                verifier.close([sid])
                if drafter is not None:
                    drafter.close([sid])
        r += 1
    return {sid: committed[sid][len(prompts[sid]) :] for sid in prompts}, drafted, accepted


def fixed(k: int) -> KChoice:
    return lambda sid, r: k


def varying(seed: int) -> KChoice:
    rng = random.Random(seed)
    table: dict[tuple[str, int], int] = {}
    return lambda sid, r: table.setdefault((sid, r), rng.randint(0, 6))


@pytest.mark.parametrize("k_of", [fixed(0), fixed(2), fixed(4), varying(1)], ids=["k0", "k2", "k4", "varying"])
def test_batched_seeded_output_is_the_target_only_output_whatever_k(
    make_verifier, make_drafter, prompts, params, references, k_of
):
    outputs, drafted, accepted = generate(make_verifier(), make_drafter(), prompts, params, k_of)
    assert outputs == references
    if drafted:
        assert 0 < accepted < drafted  # the tiny drafter is sometimes right, sometimes not


def test_seeded_output_alone_equals_batched(make_verifier, make_drafter, prompts, params, references):
    for sid in list(prompts)[:3]:
        alone, _, _ = generate(make_verifier(), make_drafter(), {sid: prompts[sid]}, params, varying(3))
        assert alone[sid] == references[sid]


def test_seeded_output_without_a_drafter_or_while_it_is_down(make_verifier, make_drafter, prompts, params, references):
    outputs, drafted, _ = generate(make_verifier(), None, prompts, params, fixed(4))
    assert outputs == references and drafted == 0
    # Down for rounds 2-5, then back (re-opened from the committed tokens).
    outputs, drafted, accepted = generate(
        make_verifier(), make_drafter(), prompts, params, fixed(3), drafter_down=lambda r: 2 <= r < 6
    )
    assert outputs == references
    assert accepted > 0


def test_seeded_output_with_an_ngram_drafter(make_verifier, make_ngram, prompts, params, references):
    outputs, _, _ = generate(make_verifier(), make_ngram(), prompts, params, fixed(4))
    assert outputs == references


def test_a_drafter_identical_to_the_target_is_always_accepted_under_the_coupling(
    make_verifier, make_drafter, tiny_target, prompts, params, references
):
    # Same logits, same noise: the noisy argmaxes agree (up to float rounding
    # between a cached batched forward and the verifier's).
    outputs, drafted, accepted = generate(make_verifier(), make_drafter(model=tiny_target), prompts, params, fixed(4))
    assert outputs == references
    assert accepted >= 0.95 * drafted


def test_different_seeds_give_different_outputs(make_verifier, prompts, params, references):
    other = {sid: SamplingParams(p.temperature, p.top_p, p.top_k, (p.seed or 0) + 1) for sid, p in params.items()}
    outputs, _, _ = generate(make_verifier(), None, prompts, other, fixed(0))
    assert sum(outputs[sid] != references[sid] for sid in prompts) >= len(prompts) - 1
