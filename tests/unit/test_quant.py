"""The int8 drafter's weights: the int8 kernel for narrow inputs, bfloat16 copies for wide ones,
and the start-up measurement that chooses between them."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from drafter_service.config import DrafterConfig
from specd.quant import (
    NEVER,
    Int8WeightOnlyLinear,
    calibrate_wide_rows,
    choose_wide_rows,
    quantize_int8,
    set_wide_rows,
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
    for bad in (DrafterConfig(int8_wide_rows=32, quantize="none"), DrafterConfig(int8_wide_rows=-2)):
        with pytest.raises(ValueError, match="int8_wide_rows"):
            bad.validate()
