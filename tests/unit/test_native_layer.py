"""The fused forward's decoder layers in one C call each (specd.engine.native_layer): the torch
forward's hidden states and tokens, a token's bits the same alone or beside others, and the
torch forward wherever the native layers do not apply."""

from __future__ import annotations

import time
from collections.abc import Callable

import tinymodels
import torch
from torch import nn

from specd.engine import fused_llama, gemv
from specd.engine.kvcache import BatchedCausalLM, Row
from specd.engine.native_layer import NativeLayers

ROWS = frozenset(range(1, 9))


def _lm(kernel: gemv.Gemv, seed: int = 3, **overrides: object) -> BatchedCausalLM:
    # head_dim 16 (64 / 4 heads), 2 key/value heads; intermediate 100: not a multiple of 8.
    model = tinymodels.build_model(seed, 120, 1, 2, layers=3, intermediate_size=100, **overrides)
    fused = fused_llama.fuse(model)
    fused.body.linears.kernel, fused.body.linears.kernel_rows = kernel, ROWS
    fused.body.native = NativeLayers.build(fused.body, kernel)
    lm = BatchedCausalLM(fused, torch.device("cpu"), torch.float32, max_slots=4, max_positions=64)
    # The head's product as calibration would choose it: the kernel's, whose rows do not interact.
    lm.head_product.kernel, lm.head_product.kernel_rows = kernel, ROWS
    return lm


def _native(lm: BatchedCausalLM, on: bool, kernel: gemv.Gemv) -> None:
    body = lm.model.body
    body.native = NativeLayers.build(body, kernel) if on else None


def _rounds(lm: BatchedCausalLM) -> list[torch.Tensor]:
    """Prefills (torch: more tokens than ROWS), then ragged batches of steps and verifies over
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
    assert {threads for fed, threads in seen if fed in ROWS} == {1}
    assert {threads for fed, threads in seen if fed not in ROWS} == {2}


def _paced(lm: BatchedCausalLM, native_s: float, torch_s: float) -> fused_llama.RoundForward:
    """A round forward whose time says which layers ran it: `native_s` where the kernel takes
    its token count (the native layers), `torch_s` where it does not."""
    body = lm.model.body

    def round_forward(tokens: int) -> Callable[[], object]:
        return lambda: time.sleep(native_s if body.kernel_takes(tokens) else torch_s)

    return round_forward


def test_whole_forwards_take_back_counts_the_products_left_to_torch(kernel: gemv.Gemv) -> None:
    # Where the products alone are about even, the native layers still save torch's attention,
    # norms and rotations: the whole forward decides. Untimed counts follow the next timed one.
    lm = _lm(kernel)
    body = lm.model.body
    body.linears.kernel_rows = frozenset(range(1, 17))
    settled = body.settle_native(32, _paced(lm, native_s=0.002, torch_s=0.006))
    assert settled == frozenset(range(1, 33))
    assert body.linears.kernel_rows == frozenset(range(1, 17))  # as it was, for the caller to set


def test_whole_forwards_leave_torch_where_it_runs_them_faster(kernel: gemv.Gemv) -> None:
    lm = _lm(kernel)
    body = lm.model.body
    body.linears.kernel_rows = frozenset(range(1, 17))
    assert body.settle_native(32, _paced(lm, native_s=0.006, torch_s=0.002)) == frozenset(range(1, 17))


def test_the_calibration_times_whole_forwards_and_frees_its_slots(kernel: gemv.Gemv, monkeypatch) -> None:
    lm = _lm(kernel)
    body = lm.model.body

    def products_say(linears: object, rows: int) -> frozenset[int]:
        body.linears.kernel_rows = frozenset({1, 2})
        return body.linears.kernel_rows

    monkeypatch.setattr(body.linears, "calibrate", products_say)
    timed: list[int] = []
    real = lm.round_forward

    def spy(tokens: int, context: int = 16) -> Callable[[], object] | None:
        timed.append(tokens)
        return real(tokens, context)

    monkeypatch.setattr(lm, "round_forward", spy)
    lm.calibrate_products(6)
    assert timed == [3, 4, 5, 6]
    assert body.kernel_takes(1) and body.native is not None
    assert not any(lm.cache._high)  # every slot the timing filled is free again
