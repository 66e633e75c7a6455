"""One product path for every verify and step forward on the CPU: the gemv kernel is taken by rule,
never by start-up timing, so under any timer every row count up to the bound takes it, a position's
logits are bitwise the same in a one-token step and in a verify of any size, and greedy speculation
is target-only's at 1, 4 and 16 sequences: with float32 activations, and with int8 ones against a
model whose weights are a GGUF's exact blocks (the default where they run)."""

from __future__ import annotations

import copy
import itertools
import random

import pytest
import torch
from test_engines import GREEDY, speculate
from test_gemv import _q4_weight, _q8_weight
from torch import nn

from specd.engine import fused_llama, gemv
from specd.engine.kvcache import BatchedCausalLM, Row
from verifier_service.engine import VerifierEngine
from verifier_service.server import verify_rows

K = 4
SEQUENCES = (1, 4, 16)
MAX_ROWS = verify_rows(max(SEQUENCES), K)


@pytest.fixture
def adversarial_timer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A clock whose intervals are long or short at random: a choice made by timing then takes one
    product for some row counts and the other for the rest."""
    rng = random.Random(7)
    ticks = itertools.count()
    monkeypatch.setattr("time.perf_counter", lambda: next(ticks) + (0.9 if rng.random() < 0.5 else 0.0))


@pytest.fixture(params=["float32", "int8"])
def activations(kernel: gemv.Gemv, request: pytest.FixtureRequest) -> str:
    if request.param == "int8" and not kernel.int8_supported():
        pytest.skip("this CPU runs no int8 products")
    return request.param


@pytest.fixture
def target_model(tiny_target: nn.Module, activations: str) -> nn.Module:
    """The tiny target; for int8, a copy whose weights are made as a GGUF's load (Q4_1, the head Q8_0)."""
    if activations == "float32":
        return tiny_target
    model = copy.deepcopy(tiny_target)
    with torch.no_grad():
        for i, m in enumerate(m for m in model.modules() if isinstance(m, nn.Linear)):
            m.weight.copy_(_q8_weight(*m.weight.shape, i) if m is model.lm_head else _q4_weight(*m.weight.shape, i))
    return model


@pytest.fixture
def fused_lm(target_model: nn.Module, activations: str, adversarial_timer: None) -> BatchedCausalLM:
    fused = fused_llama.fuse(copy.deepcopy(target_model))
    lm = BatchedCausalLM(fused, torch.device("cpu"), torch.float32, max_slots=16, max_positions=160)
    lm.calibrate_products(MAX_ROWS, activations=activations)
    assert fused.body.linears.int8 == (activations == "int8")
    return lm


def test_every_row_count_to_the_bound_takes_the_kernel_under_any_timer(fused_lm: BatchedCausalLM) -> None:
    body, head = fused_lm.model.body, fused_lm.head_product
    assert body.native is not None and head.kernel is not None
    assert [rows for rows in range(1, MAX_ROWS + 1) if not body.kernel_takes(rows)] == []
    # int8 takes every forward the cache holds (its products are not torch's at all).
    assert head.kernel_max_rows == (MAX_ROWS if not body.linears.int8 else 16 * 160)


@pytest.mark.parametrize("sequences", SEQUENCES)
def test_a_verify_s_logits_are_the_steps_bit_for_bit(fused_lm: BatchedCausalLM, sequences: int) -> None:
    rng = random.Random(sequences)
    vocab = fused_lm.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(6 + s)] for s in range(sequences)]
    drafts = [[rng.randrange(vocab) for _ in range(K + 1)] for _ in range(sequences)]
    for slot, prompt in enumerate(prompts):
        fused_lm.forward([Row(slot, 0, prompt, 0)])
    # One-token steps of every sequence at once, then the same positions as one verify.
    steps = [
        fused_lm.forward([Row(s, len(prompts[s]) + j, [drafts[s][j]], 0) for s in range(sequences)])
        for j in range(K + 1)
    ]
    verify = fused_lm.forward([Row(s, len(prompts[s]), drafts[s], 0) for s in range(sequences)])
    for s in range(sequences):
        assert torch.equal(verify[s], torch.cat([step[s] for step in steps])), f"sequence {s}"
        fused_lm.cache.release(s)


@pytest.mark.parametrize("sequences", SEQUENCES)
def test_greedy_speculation_is_target_only(
    fused_lm: BatchedCausalLM, fingerprint, make_drafter, target_model, tok, sequences: int
) -> None:
    texts = ["Hello world, this is a test.", "1, 2, 3, 4, 5, 6", "The quick brown fox", "def add(a, b):"]
    prompts = {f"p{i}": tok.encode(texts[i % len(texts)] + " x" * i) for i in range(sequences)}
    params = dict.fromkeys(prompts, GREEDY)
    outputs = {}
    for k in (K, 0):
        verifier = VerifierEngine(fused_lm, fingerprint, max(SEQUENCES), 512, K)
        # The target drafts for itself: every draft is right, so every verify feeds k + 1 rows.
        drafter = make_drafter(max_sequences=max(SEQUENCES), max_draft_tokens=K, model=target_model)
        outputs[k], accepted = speculate(verifier, drafter, prompts, dict.fromkeys(prompts, k), params, 16)
        assert (accepted > 0) == (k > 0)
    assert outputs[K] == outputs[0]
