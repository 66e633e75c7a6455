"""The fused forward's decoder layers in one C call each (specd.engine.native_layer): the torch
forward's hidden states and tokens, a token's bits the same alone or beside others, and the
torch forward wherever the native layers do not apply."""

from __future__ import annotations

import pytest
import tinymodels
import torch
from torch import nn

from specd.engine import fused_llama, gemv
from specd.engine.kvcache import BatchedCausalLM, Row
from specd.engine.native_layer import NativeLayers

MAX_ROWS = 8


def _lm(
    kernel: gemv.Gemv, seed: int = 3, max_rows: int = MAX_ROWS, max_positions: int = 64, **overrides: object
) -> BatchedCausalLM:
    # head_dim 16 (64 / 4 heads), 2 key/value heads; intermediate 100: not a multiple of 8.
    model = tinymodels.build_model(seed, 120, 1, 2, layers=3, intermediate_size=100, **overrides)
    fused = fused_llama.fuse(model)
    fused.body.linears.kernel, fused.body.linears.max_rows = kernel, max_rows
    fused.body.native = NativeLayers.build(fused.body, kernel)
    lm = BatchedCausalLM(fused, torch.device("cpu"), torch.float32, max_slots=4, max_positions=max_positions)
    # The head's product as `calibrate_products` chooses it: the kernel's, whose rows do not interact.
    lm.head_product.kernel, lm.head_product.kernel_max_rows = kernel, max_rows
    return lm


def _native(lm: BatchedCausalLM, on: bool, kernel: gemv.Gemv) -> None:
    body = lm.model.body
    body.native = NativeLayers.build(body, kernel) if on else None


def _rounds(lm: BatchedCausalLM) -> list[torch.Tensor]:
    """Prefills (torch: more tokens than MAX_ROWS), then ragged batches of steps and verifies over
    three slots: every forward's logits."""
    prompts = {0: [5, 17, 33, 2, 90, 41, 8, 11, 60], 2: [7, 7, 19, 100, 3, 55, 31, 9, 12, 13], 3: [44] * 9}
    out = [lm.forward([Row(s, 0, p, len(p) - 1)])[0] for s, p in prompts.items()]
    lengths = {s: len(p) for s, p in prompts.items()}
    for step in range(6):
        feeds = {0: [3 + step], 2: [8, 9, 10][: 1 + step % 3], 3: [20 + step, 21]}
        out += lm.forward([Row(s, lengths[s], t, 0) for s, t in feeds.items()])
        for s, t in feeds.items():
            lengths[s] += len(t)
    for s in prompts:
        lm.cache.release(s)
    return out


def test_the_native_layers_compute_the_torch_forward(kernel: gemv.Gemv) -> None:
    lm = _lm(kernel)
    assert lm.model.body.native is not None
    native = _rounds(lm)
    _native(lm, False, kernel)
    want = _rounds(lm)
    assert len(native) == len(want)
    for got, expected in zip(native, want, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_a_token_s_logits_are_bitwise_the_same_alone_or_beside_others(kernel: gemv.Gemv) -> None:
    lm = _lm(kernel)
    prompt = [5, 17, 33, 2, 90, 41, 8, 11, 60]
    tokens = [9, 14, 3, 77, 5]
    lm.forward([Row(0, 0, prompt, 0)])
    steps = [lm.forward([Row(0, len(prompt) + i, [t], 0)])[0] for i, t in enumerate(tokens)]
    lm.cache.release(0)
    # The same five as one verify, beside another slot's rows.
    lm.forward([Row(0, 0, prompt, 0)])
    lm.forward([Row(1, 0, prompt[:4], 0)])
    verify = lm.forward([Row(0, len(prompt), tokens, 0), Row(1, 4, [6, 6, 6], 0)])[0]
    assert torch.equal(verify, torch.cat(steps))


@pytest.mark.parametrize("verified", [5, 9, 24, 61])
def test_a_verify_of_any_length_to_the_bound_is_its_steps_bit_for_bit(kernel: gemv.Gemv, verified: int) -> None:
    # A verify of k = 4 or 8 and on to the bound (64 tokens with the other row's 3): every position's
    # logits are its one-token step's, attention over the new positions included.
    lm = _lm(kernel, max_rows=64, max_positions=80)
    rng = torch.Generator().manual_seed(verified)
    prompt = torch.randint(0, 120, (9,), generator=rng).tolist()
    tokens = torch.randint(0, 120, (verified,), generator=rng).tolist()
    lm.forward([Row(0, 0, prompt, 0)])
    steps = [lm.forward([Row(0, len(prompt) + i, [t], 0)])[0] for i, t in enumerate(tokens)]
    lm.cache.release(0)
    lm.forward([Row(0, 0, prompt, 0)])
    lm.forward([Row(1, 0, prompt[:4], 0)])
    calls: list[int] = []
    real = lm.model.body.native.forward
    lm.model.body.native.forward = lambda x, *a: calls.append(x.shape[0]) or real(x, *a)  # type: ignore[method-assign]
    verify = lm.forward([Row(0, len(prompt), tokens, 0), Row(1, 4, [6, 6, 6], 0)])[0]
    assert calls == [verified + 3]
    for i in range(verified):
        assert torch.equal(verify[i], steps[i][0]), i


def test_forwards_the_native_layers_do_not_take_run_the_torch_forward(kernel: gemv.Gemv) -> None:
    lm = _lm(kernel)
    body = lm.model.body
    calls: list[int] = []
    real = body.native.forward

    def counted(x: torch.Tensor, *args: object) -> torch.Tensor | None:
        calls.append(x.shape[0])
        return real(x, *args)

    body.native.forward = counted  # type: ignore[method-assign]
    # A prefill of more tokens than the kernel's rows: torch's forward.
    lm.forward([Row(0, 0, list(range(3, 15)), 0)])
    assert calls == []
    lm.forward([Row(0, 12, [4, 5], 0)])
    assert calls == [2]


def test_layers_of_another_form_get_no_native_forward(kernel: gemv.Gemv) -> None:
    fused = fused_llama.fuse(tinymodels.build_model(0, 96, 1, 2, attention_bias=True))
    assert NativeLayers.build(fused.body, kernel) is None
    fused = fused_llama.fuse(tinymodels.build_model(0, 96, 1, 2))
    fused.body.layers[1].down_proj = nn.Linear(128, 64).to(torch.bfloat16)
    assert NativeLayers.build(fused.body, kernel) is None
    # head_dim 12: not a multiple of 8.
    fused = fused_llama.fuse(tinymodels.build_model(0, 96, 1, 2, hidden_size=48, head_dim=12))
    assert NativeLayers.build(fused.body, kernel) is None
    assert NativeLayers.build(fused_llama.fuse(tinymodels.build_model(0, 96, 1, 2)).body, None) is None


def test_torch_runs_on_one_thread_where_the_kernel_takes_the_products(kernel: gemv.Gemv, monkeypatch) -> None:
    # The kernel's own threads do the products; torch's idle workers spinning beside them would take
    # their cores. A forward the kernel does not take (a long prefill) keeps torch's threads.
    lm = _lm(kernel)
    seen: list[tuple[int, int]] = []
    real = lm.model.body.native_forward

    def spy(tokens, *args, **kwargs):
        fed = len(tokens) if isinstance(tokens, torch.Tensor) else sum(len(t) for t in tokens)
        seen.append((fed, torch.get_num_threads()))
        return real(tokens, *args, **kwargs)

    monkeypatch.setattr(lm.model.body, "native_forward", spy)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _rounds(lm)
        lm.forward_argmax([Row(1, 0, [4, 5, 6], 2)])
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert {threads for fed, threads in seen if fed <= MAX_ROWS} == {1}
    assert {threads for fed, threads in seen if fed > MAX_ROWS} == {2}
