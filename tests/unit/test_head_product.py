from __future__ import annotations

import pytest
import torch
from torch import nn

from specd.engine import gemv, head_product
from specd.engine.head_product import HeadProduct
from specd.engine.quant import Int8WeightOnlyLinear
from specd.engine.timing import calibration_rows, choose_rows


def test_choose_rows_takes_a_candidate_product_only_where_it_is_clearly_faster():
    timings = {1: (10.0, 10.5), 2: (22.0, 5.5), 3: (33.0, 8.0), 4: (17.0, 16.0), 16: (24.0, 27.0)}
    assert choose_rows(timings) == frozenset({2, 3})
    assert choose_rows(timings, margin=0.0) == frozenset({2, 3, 4})
    assert choose_rows({}) == frozenset()


def test_counts_between_timed_ones_take_the_verdict_of_the_next_one_above():
    timings = {1: (10.0, 12.0), 2: (10.0, 5.0), 8: (30.0, 10.0), 16: (40.0, 45.0), 32: (90.0, 50.0)}
    assert choose_rows(timings) == frozenset({2, 3, 4, 5, 6, 7, 8, *range(17, 33)})


def test_calibration_times_every_count_to_16_then_fewer():
    assert calibration_rows(5) == [1, 2, 3, 4, 5]
    assert calibration_rows(16) == list(range(1, 17))
    assert calibration_rows(64) == [*range(1, 17), 24, 32, 48, 64]
    assert calibration_rows(100) == [*range(1, 17), 24, 32, 48, 64, 96, 100]
    assert calibration_rows(0) == []


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 17])
def test_both_products_give_the_head_s_logits(bias, rows):
    torch.manual_seed(0)
    head = nn.Linear(48, 1000, bias=bias)
    product = HeadProduct(head)
    hidden = torch.randn(rows, 48)
    want = head(hidden)
    product.transposed_rows = frozenset({rows})
    with torch.inference_mode():
        got = product(hidden)
    assert got.shape == want.shape and got.is_contiguous()
    torch.testing.assert_close(got, want.detach(), atol=1e-5, rtol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_the_product_is_picked_by_row_count(monkeypatch):
    head = nn.Linear(8, 32)
    product = HeadProduct(head)
    product.transposed_rows = frozenset({2})
    calls = []
    real_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda *a: calls.append(a[0].shape) or real_mm(*a))
    product(torch.randn(1, 8))
    product(torch.randn(3, 8))
    assert calls == []  # the plain product for row counts not chosen
    product(torch.randn(2, 8))
    assert calls == [torch.Size([32, 8])]  # W·hᵀ: the weight on the left


def test_without_the_kernel_calibration_measures_every_row_count(monkeypatch, caplog):
    monkeypatch.setattr(gemv, "load", lambda: None)
    product = HeadProduct(nn.Linear(64, 4096))
    with caplog.at_level("INFO", logger="specd.engine.head_product"):
        chosen = product.calibrate(6, repeats=1)
    assert chosen == product.transposed_rows
    assert chosen <= frozenset(range(1, 7))
    assert product.kernel is None and product.kernel_max_rows == 0
    assert "plain / transposed ms by rows: 1:" in caplog.text and " 6: " in caplog.text


def test_the_kernel_takes_the_head_for_every_row_count_by_rule_not_by_timing(kernel, monkeypatch):
    def no_timing(*args):
        raise AssertionError("the kernel's head is not chosen by timing")

    monkeypatch.setattr(head_product, "best_times", no_timing)
    product = HeadProduct(nn.Linear(64, 300))
    assert product.calibrate(80) == frozenset()
    assert product.kernel is gemv.load() and product.kernel_max_rows == 80 and product.transposed_rows == frozenset()


@pytest.mark.parametrize("tied", [False, True], ids=["float32", "q8-blocks"])
def test_a_row_s_logits_through_the_kernel_are_bitwise_its_own_at_any_row_count(kernel, tied):
    # A verify of k = 4 or 8 at 1 sequence, and up to 64 rows (16 sequences x 4 positions).
    torch.manual_seed(1)
    head = nn.Linear(576, 1000, bias=False)
    if tied:  # an embedding held as Q8_0, tied to the head
        with torch.no_grad():
            head.weight.copy_((head.weight / 1e-3).round().clamp(-127, 127) * 1e-3)
            scale = (head.weight.view(1000, 18, 32).abs().amax(-1, keepdim=True) / 127).half().float()
            head.weight.copy_(((head.weight.view(1000, 18, 32) / scale).round() * scale).view(1000, 576))
    product = HeadProduct(head)
    product.calibrate(64)
    assert product.kernel is gemv.load() and (product.blocks is not None) == tied
    hidden = torch.randn(64, 576)
    with torch.inference_mode():
        alone = torch.cat([product(hidden[i : i + 1]) for i in range(64)])
        for rows in [*range(1, 13), 16, 17, 33, 64]:
            assert torch.equal(product(hidden[:rows]), alone[:rows]), rows
            assert torch.equal(product(hidden[64 - rows :]), alone[64 - rows :]), rows


def test_a_head_that_is_not_a_plain_linear_layer_keeps_its_own_product():
    product = HeadProduct(Int8WeightOnlyLinear(nn.Linear(64, 256)))
    assert not product.applies
    assert product.calibrate(4) == frozenset()
    product.transposed_rows = frozenset({2})  # even if told otherwise
    hidden = torch.randn(2, 64)
    torch.testing.assert_close(product(hidden), product.head(hidden))
