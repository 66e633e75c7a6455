"""The float32 few-row product kernel (specd.engine.gemv): it computes torch's product, a row's
outputs do not depend on the rows beside it, it is used only where chosen, and where it cannot be
built everything stays on torch's product."""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import tinymodels
import torch
from torch import nn
from torch.nn import functional as F

from specd.engine import fused_llama, gemv
from specd.engine.head_product import HeadProduct
from specd.engine.kvcache import BatchedCausalLM, Row
from specd.engine.quant import Int8WeightOnlyLinear
from specd.engine.timing import best_times

# (outputs, inputs): odd output counts, inputs with and without a partial last group of 8.
SHAPES = [(37, 64), (37, 19), (5, 3), (129, 100), (8, 576)]
# Row counts a product is checked at against each row alone: every one to 12 (steps, verifies of a few
# sequences), then past the block forms' rows per pass and up to a verify of many sequences.
ROW_COUNTS = [*range(1, 13), 16, 17, 24, 25, 33, 45, 64]


@pytest.fixture
def fresh_load() -> Iterator[None]:
    """`load` caches its answer per process; a test that changes what it finds gets its own."""
    gemv.load.cache_clear()
    yield
    gemv.load.cache_clear()


@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("rows", range(1, 13))
def test_the_kernel_computes_torch_s_product(kernel: gemv.Gemv, rows: int, n: int, k: int) -> None:
    torch.manual_seed(rows * 1000 + n + k)
    x, weight, bias = torch.randn(rows, k), torch.randn(n, k), torch.randn(n)
    assert kernel.accepts(x, weight)
    want = x.double() @ weight.double().t()
    torch.testing.assert_close(kernel.linear(x, weight).double(), want, rtol=1e-5, atol=1e-5)
    # Against torch's float32 product both carry float32 rounding: twice the tolerance.
    torch.testing.assert_close(kernel.linear(x, weight, bias), F.linear(x, weight, bias), rtol=2e-5, atol=2e-5)
    # Leading dimensions are kept, as F.linear keeps them.
    assert kernel.linear(x.view(1, rows, k), weight).shape == (1, rows, n)


@pytest.mark.parametrize(("n", "k"), [(37, 576), (50, 100), (19, 1536)])
def test_a_row_s_outputs_are_bitwise_the_same_alone_or_in_any_batch(kernel: gemv.Gemv, n: int, k: int) -> None:
    # The exactness the verifier relies on: a verify of R positions gives each position the bits a
    # one-token step gives it. Over hundreds of inputs a different summation order differs in the
    # last bits for some output, so a kernel whose order depended on R or on the block would fail.
    torch.manual_seed(n + k)
    weight = torch.randn(n, k)
    x = torch.randn(64, k)
    alone = torch.cat([kernel.linear(x[i : i + 1], weight) for i in range(64)])
    for rows in ROW_COUNTS:
        torch.testing.assert_close(kernel.linear(x[:rows], weight), alone[:rows], rtol=0, atol=0)
        # The same row at another place in the batch.
        shifted = kernel.linear(x[64 - rows :], weight)
        torch.testing.assert_close(shifted, alone[64 - rows :], rtol=0, atol=0)


def test_only_float32_contiguous_cpu_tensors_without_autograd_are_accepted(kernel: gemv.Gemv) -> None:
    x, weight = torch.randn(2, 16), torch.randn(8, 16)
    assert kernel.accepts(x, weight)
    assert not kernel.accepts(x.bfloat16(), weight.bfloat16())
    assert not kernel.accepts(x, weight.t().contiguous().t())
    assert not kernel.accepts(torch.randn(2, 8), weight)
    assert not kernel.accepts(x, weight.requires_grad_())
    with torch.no_grad():
        assert kernel.accepts(x, weight)


def test_the_row_kernel_takes_every_count_to_its_bound_and_only_plain_float32_linears(
    kernel: gemv.Gemv, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[int, ...]] = []
    real = gemv.Gemv.linear
    monkeypatch.setattr(gemv.Gemv, "linear", lambda self, x, *a: calls.append(tuple(x.shape)) or real(self, x, *a))
    products = gemv.RowKernel()
    products.kernel, products.max_rows = kernel, 3
    linear = nn.Linear(16, 24)
    with torch.inference_mode():
        for shape in [(1, 1, 16), (1, 3, 16), (3, 1, 16), (1, 2, 16), (2, 2, 16), (1, 4, 16)]:
            x = torch.randn(shape)
            torch.testing.assert_close(products(linear, x), linear(x), rtol=1e-5, atol=1e-5)
        # Every count up to the bound, none past it; tokens, not sequences, count.
        assert calls == [(1, 1, 16), (1, 3, 16), (3, 1, 16), (1, 2, 16)]
        calls.clear()
        products(Int8WeightOnlyLinear(nn.Linear(64, 32)), torch.randn(1, 64))
        products(copy.deepcopy(linear).bfloat16(), torch.randn(1, 16, dtype=torch.bfloat16))
    assert calls == []


def test_without_a_compiler_everything_stays_on_torch(
    fresh_load: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(gemv, "COMPILERS", ("specd-no-such-compiler",))
    monkeypatch.delenv("CC", raising=False)
    with caplog.at_level(logging.INFO, logger="specd.engine.gemv"):
        assert gemv.load() is None
        assert gemv.load() is None
    assert caplog.text.count("the gemv kernel is unavailable") == 1
    linear = nn.Linear(16, 8)
    products = gemv.RowKernel()
    assert products.choose([linear], 4) == 0 and not products.takes(1)
    x = torch.randn(1, 2, 16)
    torch.testing.assert_close(products(linear, x), linear(x))
    head = HeadProduct(nn.Linear(16, 300))
    head.calibrate(3, repeats=1)
    assert head.kernel is None and head.kernel_max_rows == 0


def test_a_failed_build_falls_back_and_a_good_one_is_cached(
    kernel: gemv.Gemv, fresh_load: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    broken = tmp_path / "gemv.c"
    broken.write_text("this is not C\n", encoding="utf-8")
    monkeypatch.setattr(gemv, "SOURCE", broken)
    assert gemv.load() is None
    assert not list((tmp_path / "cache" / "specd").glob("*.so"))
    monkeypatch.undo()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    gemv.load.cache_clear()
    assert gemv.load() is not None
    assert [p.name.startswith("gemv-") for p in (tmp_path / "cache" / "specd").iterdir()] == [True]


def _greedy(lm: BatchedCausalLM, prompt: list[int], new: int) -> tuple[list[int], list[torch.Tensor]]:
    """Target-only greedy steps, then one verify of the tokens it chose: tokens and both logits."""
    tokens: list[int] = []
    logits = lm.forward([Row(0, 0, prompt, len(prompt) - 1)])[0]
    steps = [logits[-1]]
    for position in range(len(prompt), len(prompt) + new):
        tokens.append(int(logits[-1].argmax()))
        logits = lm.forward([Row(0, position, [tokens[-1]], 0)])[0]
        steps.append(logits[-1])
    verify = lm.forward([Row(0, len(prompt), tokens[:5], 0)])[0]
    lm.cache.release(0)
    return tokens, [torch.stack(steps[1:6]), verify]


def test_the_fused_forward_with_the_kernel_keeps_the_greedy_tokens(kernel: gemv.Gemv) -> None:
    # hidden 72 and intermediate 100: down_proj's inputs end in a partial group of 8.
    model = tinymodels.build_model(3, 120, 1, 2, hidden_size=72, intermediate_size=100)
    fused = fused_llama.fuse(model)
    lm = BatchedCausalLM(fused, torch.device("cpu"), torch.float32)
    prompt = [5, 17, 33, 2, 90, 41, 8]
    want, (want_steps, want_verify) = _greedy(lm, prompt, 24)
    fused.body.linears.kernel, fused.body.linears.max_rows = kernel, 64
    lm.head_product.kernel, lm.head_product.kernel_max_rows = kernel, 64
    got, (steps, verify) = _greedy(lm, prompt, 24)
    assert got == want
    torch.testing.assert_close(steps, want_steps, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(verify, want_verify, rtol=1e-4, atol=1e-4)
    # A verify of the first five tokens picks what the one-token steps picked after each.
    assert torch.equal(verify.argmax(-1), steps.argmax(-1))
    torch.testing.assert_close(verify, steps, rtol=1e-4, atol=1e-4)


def test_the_body_chooses_its_linears_once_for_every_layer(kernel: gemv.Gemv) -> None:
    fused = fused_llama.fuse(tinymodels.build_model(0, 96, 1, 2))
    assert fused.body.choose_products(3) == 3
    assert fused.body.linears.kernel is gemv.load() and fused.body.native is not None
    assert [fused.body.kernel_takes(rows) for rows in range(5)] == [False, True, True, True, False]
    assert all(layer.linears is fused.body.linears for layer in fused.body.layers)


def test_best_times_alternates_the_candidates_after_one_untimed_call_each() -> None:
    calls: list[str] = []
    times = best_times([lambda: calls.append("a"), lambda: calls.append("b")], 2)
    assert calls == ["a", "b", "a", "b", "a", "b"]
    assert len(times) == 2 and all(t >= 0 for t in times)


def _q4_weight(n: int, k: int, seed: int) -> torch.Tensor:
    """A float32 weight made as llama.cpp's Q4_1 dequantizes: d and m float16 values per 32 inputs,
    w = d * q + m with q in 0..15 (each block's smallest at q = 0 and largest at q = 15)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g).float()
    q[..., 3], q[..., 20] = 0, 15
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.02).half().float()
    m = (-torch.rand(n, k // 32, 1, generator=g) * 0.1).half().float()
    return (d * q + m).reshape(n, k)


def _q8_weight(n: int, k: int, seed: int) -> torch.Tensor:
    """As llama.cpp's Q8_0 dequantizes: w = d * q, d a float16 value, q in -127..127 (±127 present)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k // 32, 32), generator=g).float()
    q[..., 7] = -127
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.001).half().float()
    return (d * q).reshape(n, k)


@pytest.fixture(params=[False, True], ids=["avx2", "avx512"])
def block_form(kernel: gemv.Gemv, request: pytest.FixtureRequest) -> Iterator[gemv.Gemv]:
    """The kernel with its 8-lane (AVX2) or 16-lane (AVX-512F) block products; the latter skips on
    a CPU without AVX-512F. The default (16-lane where the CPU has it) is restored after."""
    used = kernel.set_wide(request.param)
    try:
        if used != request.param:
            pytest.skip("this CPU has no AVX-512F")
        yield kernel
    finally:
        kernel.set_wide(True)


@pytest.mark.parametrize(("kind", "make"), [("q4", _q4_weight), ("q8", _q8_weight)])
@pytest.mark.parametrize(("n", "k"), [(37, 576), (5, 32), (64, 1536)])
def test_exact_blocks_give_the_float32_kernel_s_outputs_bit_for_bit(
    block_form: gemv.Gemv, kind: str, make: object, n: int, k: int
) -> None:
    kernel = block_form
    assert callable(make)
    weight = make(n, k, n + k)
    blocks = gemv.as_blocks(weight)
    assert blocks is not None and blocks.kind == kind
    # An eighth (Q4_1) or a quarter (Q8_0) of float32's bytes, and float32 scales per 32 weights.
    assert blocks.nbytes <= 4 * weight.numel() * (0.1875 if kind == "q4" else 0.28125)
    torch.manual_seed(k)
    # Past 8 rows: the 16-lane form takes 8 rows per pass over a weight row, the 8-lane form 3.
    x = torch.randn(19, k)
    for rows in range(1, 20):
        want = kernel.linear(x[:rows], weight)
        torch.testing.assert_close(kernel.linear(x[:rows], weight, None, blocks), want, rtol=0, atol=0)
    # And a row alone is the same bits as in a batch, read from blocks too.
    alone = torch.cat([kernel.linear(x[i : i + 1], weight, None, blocks) for i in range(19)])
    torch.testing.assert_close(kernel.linear(x, weight, None, blocks), alone, rtol=0, atol=0)


@pytest.mark.parametrize(("kind", "make"), [("q4", _q4_weight), ("q8", _q8_weight)])
@pytest.mark.parametrize(("n", "k"), [(37, 576), (19, 1536)])
def test_a_row_read_from_blocks_is_bitwise_the_same_alone_or_in_a_batch_of_any_size(
    block_form: gemv.Gemv, kind: str, make: object, n: int, k: int
) -> None:
    # The verifier's exactness up to max_sequences x (k + 1) rows: 5 and 9 (a verify of k = 4 or 8)
    # and on to 64, at the start and the end of a batch, in the 8- and 16-lane forms.
    kernel = block_form
    assert callable(make)
    weight = make(n, k, n * k)
    blocks = gemv.as_blocks(weight)
    assert blocks is not None and blocks.kind == kind
    torch.manual_seed(n)
    x = torch.randn(64, k)
    alone = torch.cat([kernel.linear(x[i : i + 1], weight, None, blocks) for i in range(64)])
    for rows in ROW_COUNTS:
        assert torch.equal(kernel.linear(x[:rows], weight, None, blocks), alone[:rows]), rows
        assert torch.equal(kernel.linear(x[64 - rows :], weight, None, blocks), alone[64 - rows :]), rows


def test_weights_that_blocks_cannot_rebuild_exactly_keep_their_float32_product() -> None:
    assert gemv.as_blocks(torch.randn(16, 64)) is None
    # One weight one unit in the last place off its block's value: no block form is exact.
    weight = _q4_weight(16, 64, 3)
    weight[5, 40] = torch.nextafter(weight[5, 40], torch.tensor(1.0))
    assert gemv.as_blocks(weight) is None
    weight = _q8_weight(16, 64, 3)
    weight[2, 1] = torch.nextafter(weight[2, 1], torch.tensor(1.0))
    assert gemv.as_blocks(weight) is None
    # Inputs not in whole blocks of 32, or not float32.
    assert gemv.as_blocks(_q4_weight(4, 64, 1)[:, :48].contiguous()) is None
    assert gemv.as_blocks(_q4_weight(4, 64, 1).double()) is None


def test_the_body_reads_exact_blocks_and_keeps_its_tokens(kernel: gemv.Gemv) -> None:
    # A tiny model whose decoder weights are Q4_1-made and head Q8_0-made, as a GGUF's load.
    model = tinymodels.build_model(3, 128, 1, 2, hidden_size=64, intermediate_size=128)
    with torch.no_grad():
        for i, m in enumerate(m for m in model.modules() if isinstance(m, nn.Linear)):
            m.weight.copy_(_q8_weight(*m.weight.shape, i) if m is model.lm_head else _q4_weight(*m.weight.shape, i))
    fused = fused_llama.fuse(model)
    lm = BatchedCausalLM(fused, torch.device("cpu"), torch.float32)
    prompt = [5, 17, 33, 2, 90, 41, 8]
    assert fused.body.linears.choose(list(_body_products(fused)), 64) == 64
    held = [m.__dict__.get(gemv.BLOCKS_ATTRIBUTE) for m in _body_products(fused)]
    assert held and all(b is not None and b.kind == "q4" for b in held)
    got, (steps, verify) = _greedy(lm, prompt, 16)
    # The same forward on the float32 weights: bitwise the same logits.
    for m in _body_products(fused):
        m.__dict__[gemv.BLOCKS_ATTRIBUTE] = None
    want, (want_steps, want_verify) = _greedy(lm, prompt, 16)
    assert got == want
    assert torch.equal(steps, want_steps) and torch.equal(verify, want_verify)


def _body_products(fused: nn.Module) -> Iterator[nn.Linear]:
    for layer in fused.body.layers:
        yield from (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)


@pytest.mark.parametrize("rows", [1, 3, 5, 9])
def test_threads_share_a_product_s_rows_without_changing_a_bit(kernel: gemv.Gemv, rows: int) -> None:
    # Large enough to be split (gemv.c's SPLIT_WEIGHTS), with an odd number of weight rows.
    weight, x = _q4_weight(1031, 576, rows), torch.randn(rows, 576)
    blocks = gemv.as_blocks(weight)
    try:
        assert kernel.set_threads(1) == 1
        alone = [kernel.linear(x, weight), kernel.linear(x, weight, None, blocks)]
        assert kernel.set_threads(3) == 3
        for _ in range(20):
            assert torch.equal(kernel.linear(x, weight), alone[0])
            assert torch.equal(kernel.linear(x, weight, None, blocks), alone[1])
    finally:
        kernel.set_threads(torch.get_num_threads())


def test_products_called_from_several_threads_at_once_are_each_right(kernel: gemv.Gemv) -> None:
    # One caller shares its product with the helpers; another at the same time runs its own alone.
    import concurrent.futures

    weight = _q4_weight(2048, 576, 9)
    blocks = gemv.as_blocks(weight)
    inputs = [torch.randn(1 + i % 4, 576) for i in range(64)]
    kernel.set_threads(1)
    want = [kernel.linear(x, weight, None, blocks) for x in inputs]
    try:
        kernel.set_threads(2)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda x: kernel.linear(x, weight, None, blocks), inputs))
    finally:
        kernel.set_threads(torch.get_num_threads())
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_a_forked_child_runs_its_products_alone(kernel: gemv.Gemv) -> None:
    # The helpers are threads of the parent: a child of fork must not wait for them.
    import multiprocessing

    weight = _q4_weight(2048, 576, 4)
    x = torch.randn(3, 576)
    kernel.set_threads(2)
    try:
        want = kernel.linear(x, weight)
        context = multiprocessing.get_context("fork")
        parent, child = context.Pipe()
        process = context.Process(target=lambda: child.send(kernel.linear(x, weight).tolist()))
        process.start()
        assert parent.poll(60), "the forked child's product did not finish"
        got = torch.tensor(parent.recv())
        process.join(10)
    finally:
        kernel.set_threads(torch.get_num_threads())
    assert torch.equal(got, want)


def test_found_blocks_are_kept_and_read_back(tmp_path, monkeypatch) -> None:
    from specd.engine import block_cache

    monkeypatch.setenv("SPECD_CACHE_DIR", str(tmp_path))
    weight = _q4_weight(8, 64, 2)
    found = gemv.as_blocks(weight)
    assert found is not None and len(list((tmp_path / "blocks").iterdir())) == 1
    searched: list[int] = []
    monkeypatch.setattr(gemv, "_find_blocks", lambda w: searched.append(1))
    again = gemv.as_blocks(weight)
    assert not searched and again is not None
    assert again.kind == found.kind and torch.equal(again.q, found.q) and torch.equal(again.scales, found.scales)
    other = weight.clone()
    other[0, 0] = other[0, 1]  # other bytes: searched again
    gemv.as_blocks(other)
    assert searched == [1]
    assert block_cache.weight_digest(weight, 1) != block_cache.weight_digest(weight, 2)  # another layout
    for kept in (tmp_path / "blocks").iterdir():
        kept.write_bytes(b"not a tensor file")
    monkeypatch.setattr(gemv, "_find_blocks", lambda w: searched.append(2))
    gemv.as_blocks(weight)  # unreadable: searched again
    assert searched == [1, 2]


def test_layers_found_and_read_back_on_threads_get_their_own_blocks(tmp_path, monkeypatch) -> None:
    """attach_blocks finds (and keeps) or reads back every layer's blocks on a pool of threads: each
    layer gets its own, in order."""
    from specd.engine import block_cache

    monkeypatch.setenv("SPECD_CACHE_DIR", str(tmp_path))
    weights = [_q4_weight(8, 64, 3), _q8_weight(16, 64, 4), torch.randn(8, 64), _q4_weight(4, 96, 5)]
    assert block_cache.on_threads(lambda w: block_cache.weight_digest(w, 1), weights) == [
        block_cache.weight_digest(w, 1) for w in weights
    ]

    def layers() -> list[nn.Linear]:
        made = []
        for w in weights:
            layer = nn.Linear(w.shape[1], w.shape[0], bias=False)
            with torch.no_grad():
                layer.weight.copy_(w)
            made.append(layer)
        return made

    first = layers()
    assert gemv.attach_blocks(first) == 3  # the random weight has none
    searched: list[torch.Tensor] = []
    monkeypatch.setattr(gemv, "_find_blocks", lambda w: searched.append(w))
    second = layers()
    assert gemv.attach_blocks(second) == 3
    assert len(searched) == 1 and torch.equal(searched[0], weights[2])  # only the weight without blocks
    for a, b in zip(first, second, strict=True):
        found, read = a.__dict__[gemv.BLOCKS_ATTRIBUTE], b.__dict__[gemv.BLOCKS_ATTRIBUTE]
        assert (found is None) == (read is None)
        if found is not None:
            assert read.kind == found.kind and torch.equal(read.q, found.q) and torch.equal(read.scales, found.scales)
