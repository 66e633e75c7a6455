"""The quantized drafter's weights: the int8 and int4 kernels for narrow inputs, bfloat16 copies for wide
ones, the start-up measurement that chooses between them, and int4's exactness on 4-bit weights."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from drafter_service.config import DrafterConfig
from specd.engine.quant import (
    NEVER,
    Int4WeightOnlyLinear,
    Int8WeightOnlyLinear,
    calibrate_wide_rows,
    choose_wide_rows,
    quantize_copy,
    quantize_int4,
    quantize_int8,
    set_wide_rows,
    weights_are_int4,
)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 32, bias=False))


def test_wide_inputs_use_the_bfloat16_copy_and_narrow_ones_the_int8_kernel() -> None:
    reference = model()
    quantized = quantize_int8(model(), keep_wide=True)
    set_wide_rows(quantized, 8)
    first = quantized[0]
    assert isinstance(first, Int8WeightOnlyLinear) and first.wide_weight is not None
    for rows in (1, 7, 8, 40):
        x = torch.randn(rows, 64)
        int8 = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), first.qweight, first.scales) + first.bias
        wide = nn.functional.linear(x.to(torch.bfloat16), reference[0].weight.to(torch.bfloat16)) + first.bias
        assert torch.equal(first(x), (wide if rows >= 8 else int8).float())
        # Either way it is the float layer, within the precision of its kernel.
        assert torch.allclose(quantized(x), reference(x), atol=0.05, rtol=0.05)


def test_the_copies_are_not_saved_and_never_drops_them() -> None:
    quantized = quantize_int8(model(), keep_wide=True)
    assert not any("wide" in key for key in quantized.state_dict())
    set_wide_rows(quantized, 0)
    assert all(m.wide_weight is None and m.wide_rows == NEVER for m in quantized if isinstance(m, Int8WeightOnlyLinear))
    assert quantize_int8(model())[0].wide_weight is None  # not kept unless asked for


@pytest.mark.parametrize(
    ("timings", "want"),
    [
        ({8: (1.0, 2.0), 16: (2.0, 2.1), 64: (8.0, 3.0)}, 64),
        ({8: (1.0, 0.9), 16: (2.0, 1.5), 64: (8.0, 3.0)}, 8),
        ({8: (1.0, 0.5), 16: (2.0, 2.5), 64: (8.0, 3.0)}, 64),  # only from where it keeps winning
        ({8: (1.0, 2.0), 16: (2.0, 4.0), 64: (8.0, 9.0)}, NEVER),  # no fast bfloat16 (AVX2 only)
        ({}, NEVER),
    ],
)
def test_choose_wide_rows(timings: dict[int, tuple[float, float]], want: int) -> None:
    assert choose_wide_rows(timings) == want


@pytest.mark.parametrize(("fast_from", "want"), [(16, 16), (None, NEVER)])
def test_calibration_measures_both_kernels_and_keeps_the_faster(fast_from: int | None, want: int) -> None:
    quantized = quantize_int8(model(), keep_wide=True)
    linear = quantized[0]
    assert isinstance(linear, Int8WeightOnlyLinear)

    def forward(rows: int) -> None:
        # A machine whose bfloat16 products beat the int8 kernel from `fast_from` rows on.
        wide = rows >= linear.wide_rows
        fast = wide == (fast_from is not None and rows >= fast_from)
        time.sleep(0.002 if fast else 0.008)

    assert calibrate_wide_rows(quantized, forward, sizes=(8, 16, 64)) == want
    assert linear.wide_rows == want and (linear.wide_weight is None) == (want == NEVER)


def test_int8_wide_rows_is_refused_where_it_cannot_apply() -> None:
    DrafterConfig(int8_wide_rows=32).validate()
    DrafterConfig(int8_wide_rows=0).validate()
    DrafterConfig(int8_wide_rows=16, quantize="int4").validate()
    for bad in (DrafterConfig(int8_wide_rows=32, quantize="none"), DrafterConfig(int8_wide_rows=-2)):
        with pytest.raises(ValueError, match="int8_wide_rows"):
            bad.validate()


class TinyLM(nn.Module):
    """Two inner layers and a head, as `quantize_int4` sees a causal LM."""

    def __init__(self, inner: nn.Linear, head: nn.Linear) -> None:
        super().__init__()
        self.inner, self.odd, self.head = inner, nn.Linear(40, 48), head

    def get_output_embeddings(self) -> nn.Module:
        return self.head


def four_bit_linear(out_features: int, in_features: int, group: int = 32) -> nn.Linear:
    """A layer whose weights are 4-bit in asymmetric groups, as a Q4_1 GGUF's dequantize to."""
    torch.manual_seed(1)
    q = torch.randint(0, 16, (out_features, in_features // group, group)).float()
    q[..., 0], q[..., 1] = 0, 15  # Q4_1 puts each group's minimum at 0 and its maximum at 15
    scale = torch.rand(out_features, in_features // group, 1) * 0.02 + 0.001
    low = torch.randn(out_features, in_features // group, 1) * 0.05
    linear = nn.Linear(in_features, out_features, bias=True)
    with torch.no_grad():
        linear.weight.copy_((q * scale + low).view(out_features, in_features))
    return linear


def test_int4_holds_four_bit_weights_exactly_and_others_closely() -> None:
    exact = four_bit_linear(96, 128)
    copy = Int4WeightOnlyLinear(exact)
    assert copy.max_error <= 1e-6 * float(exact.weight.detach().abs().max())
    x = torch.randn(3, 128)
    # With exact weights only the bfloat16 activations and accumulation differ from the layer.
    want = nn.functional.linear(x.to(torch.bfloat16).float(), exact.weight, exact.bias)
    with torch.no_grad():
        assert torch.allclose(copy(x), want, atol=0.02, rtol=0.02)
    # A layer of ordinary float weights is quantized with a bounded, nonzero error.
    torch.manual_seed(2)
    plain = nn.Linear(128, 96)
    lossy = Int4WeightOnlyLinear(plain)
    groups = plain.weight.detach().view(96, 4, 32)
    group_range = groups.amax(-1) - groups.amin(-1)
    assert 0 < lossy.max_error <= float(group_range.max()) / 30 + 1e-6  # half a step at most
    with torch.no_grad():
        # 4-bit steps of 1/15 of a group's range: a few percent of the output, not more.
        relative = (lossy(x) - plain(x)).norm() / plain(x).norm()
    assert 0.005 < relative < 0.12


def test_int4_keeps_the_head_and_layers_the_kernel_refuses_in_int8() -> None:
    lm = TinyLM(four_bit_linear(96, 128), nn.Linear(96, 64, bias=False))
    assert weights_are_int4(lm)
    assert quantize_copy(lm, "auto") == "int4"
    assert isinstance(lm.inner, Int4WeightOnlyLinear)
    assert isinstance(lm.odd, Int8WeightOnlyLinear)  # 40 inputs: not whole groups of 32
    assert isinstance(lm.head, Int8WeightOnlyLinear)
    # Weights that are not 4-bit already get the int8 copy under auto: int4 would round them more coarsely.
    torch.manual_seed(3)
    plain = TinyLM(nn.Linear(128, 96), nn.Linear(96, 64))
    assert not weights_are_int4(plain)
    assert quantize_copy(plain, "auto") == "int8" and isinstance(plain.inner, Int8WeightOnlyLinear)
    with pytest.raises(ValueError, match="int4 needs"):
        Int4WeightOnlyLinear(nn.Linear(40, 48))


def test_int4_layers_take_the_bfloat16_copy_for_wide_inputs() -> None:
    lm = TinyLM(four_bit_linear(96, 128), nn.Linear(96, 64))
    quantize_int4(lm, keep_wide=True)
    set_wide_rows(lm, 8)
    inner = lm.inner
    assert isinstance(inner, Int4WeightOnlyLinear) and inner.wide_weight is not None
    for rows in (1, 8):
        x = torch.randn(rows, 128)
        flat = x.to(torch.bfloat16)
        narrow = inner.narrow(flat) + inner.bias
        wide = nn.functional.linear(flat, inner.wide_weight) + inner.bias
        assert torch.equal(inner(x), (wide if rows >= 8 else narrow).float())
    assert not any("wide" in key for key in lm.state_dict())


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("keep_wide", [False, True])
def test_a_quantized_model_computes_in_the_dtype_it_is_moved_to(kind: str, keep_wide: bool) -> None:
    """`specd drafter --dtype float32` quantizes, then moves the model to float32: the layers' own
    buffers stay bfloat16, what the kernels take, and each layer answers in the caller's dtype."""
    x = torch.randn(3, 96)
    layers = []
    for dtype in (torch.bfloat16, torch.float32):
        torch.manual_seed(4)
        layer = nn.Sequential(nn.Linear(96, 64))
        quantize_copy(layer, kind, keep_wide=keep_wide)
        set_wide_rows(layer, 2)
        layer.to(dtype)
        buffers = {name: b.dtype for name, b in layer.named_buffers() if b.is_floating_point()}
        assert buffers and set(buffers.values()) == {torch.bfloat16}, buffers
        with torch.no_grad():
            out = layer(x[:1].to(dtype)), layer(x.to(dtype))  # the quantized kernel, then the wide copy
        assert all(o.dtype == dtype for o in out)
        layers.append(out)
    # The same kernels on the same bfloat16 inputs: the same numbers, only the output dtype differs.
    for bf16, f32 in zip(*layers, strict=True):
        assert torch.equal(bf16.float(), f32)


@pytest.mark.parametrize("bias", [False, True])
def test_a_scouted_head_s_argmax_is_the_int8_one_found_in_the_int4_shortlist(bias: bool) -> None:
    """A quantized LM head's `argmax` rescores, with the int8 weights, the outputs its int4 scout
    ranks highest: the int8 argmax, at half the bytes read, where the scout's own would differ."""
    torch.manual_seed(4)
    head = nn.Linear(128, 4096, bias=bias)
    with torch.no_grad():
        # Heavy tails, as trained weights have: int4's groups of 32 rank outputs coarsely.
        head.weight.mul_(torch.randn_like(head.weight).abs().pow(2))
    scouted = Int8WeightOnlyLinear(head, scout=True)
    assert scouted.scout is not None and Int8WeightOnlyLinear(head).scout is None
    x = torch.randn(200, 128)
    weights = scouted.qweight.float() * scouted.scales.float()[:, None]
    exact = x.to(torch.bfloat16).float() @ weights.T
    if bias:
        exact = exact + scouted.bias.float()
    want = exact.argmax(dim=-1)
    with torch.no_grad():
        assert torch.equal(scouted.argmax(x), want)
        assert int((scouted.scout(x).argmax(dim=-1) != want).sum()) >= 10  # the rescoring matters
        # The int8 kernel's own argmax, but for its bfloat16 rounding of the outputs.
        assert float((scouted(x).argmax(dim=-1) == want).float().mean()) > 0.9


def test_quantized_heads_keep_a_scout_and_no_other_layer_does() -> None:
    for quantize in (quantize_int8, quantize_int4):
        lm = TinyLM(four_bit_linear(96, 128), nn.Linear(96, 128, bias=False))
        quantize(lm)
        scouted = [m for m in lm.modules() if isinstance(m, Int8WeightOnlyLinear) and m.scout is not None]
        assert scouted == [lm.head]
