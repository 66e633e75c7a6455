"""The int8-activation products (specd.engine.gemv, `gemv_int8.c`), in their AVX-512 VNNI and AVX2
forms: the same bits as a torch reference of the same quantized arithmetic in the same order, the
two forms bitwise alike, a row's outputs bitwise the same alone or in a batch of any size, close to
the float32 product, plumbed through the fused forward (a verify's logits its steps'), and refused,
never dropped, where they cannot run."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import tinymodels
import torch
from test_gemv import ROW_COUNTS, _greedy, _q4_weight, _q8_weight
from torch import nn

from drafter_service.config import DrafterConfig
from specd.engine import fused_llama, gemv
from specd.engine.head_product import HeadProduct
from specd.engine.kvcache import BatchedCausalLM, Row
from verifier_service.config import VerifierConfig

MAKERS = {"q4": _q4_weight, "q8": _q8_weight}
# (outputs, inputs): outputs in whole groups of 16 and with a partial last group, one block, the
# embedded target's widest input.
SHAPES = [(37, 576), (32, 96), (5, 32), (19, 1536)]


@pytest.fixture(params=[False, True], ids=["avx2", "vnni"])
def int8_kernel(kernel: gemv.Gemv, request: pytest.FixtureRequest) -> Iterator[gemv.Gemv]:
    """The kernel with its int8 products in AVX2 or AVX-512 VNNI form; the latter skips on a CPU
    without VNNI. The default (VNNI where the CPU has it) is restored after."""
    used = kernel.set_int8_vnni(request.param)
    try:
        if not kernel.int8_supported():
            pytest.skip("this CPU runs no int8 products")
        if used != request.param:
            pytest.skip("this CPU has no AVX-512 VNNI")
        yield kernel
    finally:
        kernel.set_int8_vnni(True)


@pytest.fixture
def both_forms(kernel: gemv.Gemv) -> Iterator[gemv.Gemv]:
    """The kernel where both int8 forms run (a CPU with AVX-512 VNNI), the default restored after."""
    try:
        if not kernel.set_int8_vnni(True):
            pytest.skip("this CPU has no AVX-512 VNNI to compare the AVX2 form with")
        yield kernel
    finally:
        kernel.set_int8_vnni(True)


def _in_form(kernel: gemv.Gemv, vnni: bool, x: torch.Tensor, weight: torch.Tensor, packed: gemv.Packed) -> torch.Tensor:
    assert kernel.set_int8_vnni(vnni) == vnni
    return kernel.linear(x, weight, None, None, packed)


def _quantized(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [R, blocks, 32], d_x and s_x [R, blocks], by gemv_int8.c's float32 operations."""
    g = x.reshape(x.shape[0], -1, 32)
    amax = g.abs().amax(-1)
    d = amax / 127
    inverse = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    q = torch.round(g * inverse[..., None]).long()
    return q, d, d * q.sum(-1).float()


def reference(x: torch.Tensor, blocks: gemv.Blocks) -> torch.Tensor:
    """gemv_int8.c's outputs, operation for operation (its header states the order)."""
    qx, dx, sx = _quantized(x)
    n, nblocks = blocks.q.shape[0], qx.shape[1]
    if blocks.kind == "q4":
        packed = blocks.q.reshape(n, nblocks, 16)
        qw = torch.cat([packed & 15, packed >> 4], dim=-1).long()
        dw, mw = blocks.scales[..., 0], blocks.scales[..., 1]
    else:
        qw = blocks.q.view(torch.int8).reshape(n, nblocks, 32).long()
        dw = blocks.scales.reshape(n, nblocks)
    isum = (qx[:, None] * qw[None]).sum(-1)
    acc = torch.zeros(x.shape[0], n)
    for b in range(nblocks):
        acc = acc + isum[:, :, b].float() * (dw[None, :, b] * dx[:, None, b])
        if blocks.kind == "q4":
            acc = acc + mw[None, :, b] * sx[:, None, b]
    return acc


def _blocks(kind: str, n: int, k: int) -> tuple[torch.Tensor, gemv.Blocks, gemv.Packed]:
    weight = MAKERS[kind](n, k, n * k)
    blocks = gemv.as_blocks(weight)
    assert blocks is not None and blocks.kind == kind
    return weight, blocks, gemv.pack_int8(blocks)


@pytest.mark.parametrize("kind", ["q4", "q8"])
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_the_int8_products_are_the_reference_s_bit_for_bit(int8_kernel: gemv.Gemv, kind: str, n: int, k: int) -> None:
    weight, blocks, packed = _blocks(kind, n, k)
    torch.manual_seed(k + n)
    # Rows of very different magnitudes, a zero block and exact ties of the rounding.
    x = torch.randn(17, k) * torch.logspace(-3, 2, 17)[:, None]
    x[3, :32] = 0
    x[4, :32] = torch.arange(-15, 17) + 0.5
    x[4, 0] = 127.0
    for rows in (1, 2, 5, 9, 17):
        got = int8_kernel.linear(x[:rows], weight, None, blocks, packed)
        assert torch.equal(got, reference(x[:rows], blocks)), rows
    # Within the activations' rounding of the float32 product: at most half of d_x per input, times
    # the weight's magnitude (and float32's own rounding).
    exact = int8_kernel.linear(x, weight, None, blocks)
    error = (int8_kernel.linear(x, weight, None, blocks, packed) - exact).abs()
    _, dx, _ = _quantized(x)
    bound = (dx / 2) @ weight.abs().reshape(n, -1, 32).sum(-1).t() + 1e-5 * (x.abs() @ weight.abs().t())
    assert (error <= bound).all()


@pytest.mark.parametrize("kind", ["q4", "q8"])
# 165 x 576: past the weights a product needs to be split among threads, 11 groups of 16 outputs.
@pytest.mark.parametrize(("n", "k"), [(37, 576), (11, 96), (19, 1536), (165, 576)])
def test_an_int8_row_is_bitwise_the_same_alone_or_in_a_batch_of_any_size(
    int8_kernel: gemv.Gemv, kind: str, n: int, k: int
) -> None:
    # The verifier's exactness in this mode: up to max_sequences x (k + 1) rows, at the start and the
    # end of a batch (past the 8 rows a pass takes), with one thread and with two.
    weight, blocks, packed = _blocks(kind, n, k)
    torch.manual_seed(n)
    x = torch.randn(64, k)
    int8_kernel.set_threads(1)
    alone = torch.cat([int8_kernel.linear(x[i : i + 1], weight, None, blocks, packed) for i in range(64)])
    try:
        for threads in (1, 2):
            int8_kernel.set_threads(threads)
            for rows in ROW_COUNTS:
                assert torch.equal(int8_kernel.linear(x[:rows], weight, None, blocks, packed), alone[:rows])
                assert torch.equal(int8_kernel.linear(x[64 - rows :], weight, None, blocks, packed), alone[64 - rows :])
    finally:
        int8_kernel.set_threads(1)


# Output counts from one to past a thread split, with partial groups and halves of 8; inputs of one
# block to the embedded target's widest.
FORM_OUTPUTS = [1, 5, 8, 9, 15, 16, 17, 37, 165]
FORM_INPUTS = [32, 96, 576, 1536]
FORM_ROWS = [*range(1, 18), 24, 33]


@pytest.mark.parametrize("kind", ["q4", "q8"])
@pytest.mark.parametrize("k", FORM_INPUTS)
def test_the_avx2_form_gives_the_vnni_form_s_bits(both_forms: gemv.Gemv, kind: str, k: int) -> None:
    torch.manual_seed(k)
    x = torch.randn(33, k) * torch.logspace(-4, 3, 33)[:, None]
    # A zero block, exact ties of the rounding, a block below float32's normal range.
    x[2, :32] = 0
    x[5, :32] = torch.arange(-15, 17) + 0.5
    x[5, 0] = 127.0
    x[7, -32:] = 1e-40
    for n in FORM_OUTPUTS:
        weight, _, packed = _blocks(kind, n, k)
        want = _in_form(both_forms, True, x, weight, packed)
        for rows in FORM_ROWS:
            got = _in_form(both_forms, False, x[:rows], weight, packed)
            assert torch.equal(got, want[:rows]), (n, rows)
            # Each row alone: its bits in the batch.
            assert torch.equal(_in_form(both_forms, False, x[rows - 1 : rows], weight, packed), want[rows - 1 : rows])


def _extreme_blocks(kind: str, n: int, k: int) -> gemv.Blocks:
    """Blocks at the edge of the AVX2 form's int16 pair sums: every Q4_1 nibble 15, every Q8_0 q -127."""
    blocks = k // 32
    if kind == "q4":
        scales = torch.tensor([1.0, -0.5]).repeat(n, blocks, 1)
        return gemv.Blocks("q4", torch.full((n, blocks * 16), 0xFF, dtype=torch.uint8), scales)
    q = torch.full((n, blocks * 32), -127, dtype=torch.int8).view(torch.uint8)
    return gemv.Blocks("q8", q, torch.full((n, blocks), 0.25))


@pytest.mark.parametrize("kind", ["q4", "q8"])
def test_the_avx2_form_is_exact_at_the_largest_sums(int8_kernel: gemv.Gemv, kind: str) -> None:
    # q_x = ±127 everywhere: the largest integer sums the packing and the quantizer can make (a Q8_0
    # byte stored plus 128 would saturate a maddubs pair against them).
    n, k = 21, 96
    blocks = _extreme_blocks(kind, n, k)
    packed = gemv.pack_int8(blocks)
    x = torch.ones(4, k)
    x[1] = -1
    x[2, ::2] = -1
    x[3] = torch.randn(k)
    got = int8_kernel.linear(x, torch.empty(n, k), None, None, packed)
    assert torch.equal(got, reference(x, blocks))


def _block_model(hidden: int = 96, inter: int = 160) -> nn.Module:
    """A tiny Llama whose decoder weights are Q4_1-made and head Q8_0-made, as a GGUF's load (odd
    block counts, output counts not in groups of 16)."""
    model = tinymodels.build_model(3, 120, 1, 2, hidden_size=hidden, intermediate_size=inter)
    with torch.no_grad():
        for i, m in enumerate(m for m in model.modules() if isinstance(m, nn.Linear)):
            m.weight.copy_(_q8_weight(*m.weight.shape, i) if m is model.lm_head else _q4_weight(*m.weight.shape, i))
    return fused_llama.fuse(model)


def test_the_fused_forward_in_int8_keeps_a_verify_s_logits_the_steps(int8_kernel: gemv.Gemv) -> None:
    fused = _block_model()
    lm = BatchedCausalLM(fused, torch.device("cpu"), torch.float32)
    prompt = [5, 17, 33, 2, 90, 41, 8]
    lm.calibrate_products(64)
    _, (want_steps, _) = _greedy(lm, prompt, 16)
    lm.calibrate_products(64, activations="int8")
    assert fused.body.linears.int8 and lm.head_product.packed is not None
    assert fused.body.native is not None and all(p.qkv.kind == 3 for p in fused.body.native.layers)
    got, (steps, verify) = _greedy(lm, prompt, 16)
    # The verify of five positions: the bits of the five one-token steps.
    assert torch.equal(verify, steps)
    # Not the float32 products (the mode is taken), but near them.
    assert not torch.equal(steps, want_steps)
    torch.testing.assert_close(steps, want_steps, rtol=0.05, atol=0.05 * float(want_steps.abs().max()))
    # The same products with torch's calls between them (whose norms and attention round otherwise).
    native = fused.body.native
    fused.body.native = None
    again, (torch_steps, _) = _greedy(lm, prompt, 16)
    fused.body.native = native
    assert again == got
    torch.testing.assert_close(torch_steps, steps, rtol=1e-4, atol=1e-4)


def test_int8_is_refused_where_it_cannot_run(
    kernel: gemv.Gemv, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fused = _block_model()
    with pytest.raises(ValueError, match="--activations takes"):
        fused.body.choose_products(8, "int4")
    # Float32 weights without exact blocks: nothing for int8 to multiply.
    plain = fused_llama.fuse(tinymodels.build_model(0, 96, 1, 2))
    with pytest.raises(ValueError, match="none of this model's linears"):
        plain.body.choose_products(8, "int8")
    # A transformers forward (no kernel for its layers).
    lm = BatchedCausalLM(tinymodels.build_model(0, 96, 1, 2), torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="fused forward"):
        lm.calibrate_products(8, activations="int8")
    monkeypatch.setattr(gemv.Gemv, "int8_supported", lambda self: False)
    with pytest.raises(ValueError, match="AVX-512 VNNI"):
        fused.body.choose_products(8, "int8")
    with pytest.raises(ValueError, match="AVX-512 VNNI"):
        HeadProduct(nn.Linear(64, 8, bias=False)).calibrate(4, activations="int8")
    for parse, argv, reason in [
        (VerifierConfig.from_args, ["--activations", "int8", "--dtype", "bfloat16"], "--dtype float32"),
        (DrafterConfig.from_args, ["--activations", "int8", "--drafter", "suffix"], "model drafter"),
    ]:
        with pytest.raises(SystemExit):
            parse(argv)
        assert reason in capsys.readouterr().err


def test_auto_takes_int8_where_it_runs_and_float32_elsewhere(
    kernel: gemv.Gemv, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    if not kernel.int8_supported():
        pytest.skip("this CPU runs no int8 products")
    caplog.set_level("INFO", logger="specd.engine.kvcache")
    blocks = BatchedCausalLM(_block_model(), torch.device("cpu"), torch.float32)
    assert blocks.calibrate_products(8, activations="auto") == "int8"
    assert blocks.head_product.packed is not None
    # Weights without exact blocks, and a forward without the kernel: float32, with the reason.
    plain = BatchedCausalLM(fused_llama.fuse(tinymodels.build_model(0, 96, 1, 2)), torch.device("cpu"), torch.float32)
    assert plain.calibrate_products(8, activations="auto") == "float32"
    unfused = BatchedCausalLM(tinymodels.build_model(0, 96, 1, 2), torch.device("cpu"), torch.float32)
    assert unfused.calibrate_products(8, activations="auto") == "float32"
    monkeypatch.setattr(gemv.Gemv, "int8_supported", lambda self: False)
    cpu_without = BatchedCausalLM(_block_model(), torch.device("cpu"), torch.float32)
    assert cpu_without.calibrate_products(8, activations="auto") == "float32"
    said = [r.getMessage() for r in caplog.records if "activations:" in r.getMessage()]
    assert said[0].startswith("activations: int8 (auto")
    assert "no exact 4- or 8-bit blocks" in said[1] and "does not take the CPU kernel" in said[2]
    assert "neither AVX-512 VNNI nor AVX2" in said[3]
    # Asked for by name, auto stays the default for the verifier alone.
    assert VerifierConfig.from_args([]).activations == "auto"
    assert DrafterConfig.from_args([]).activations == "float32"


def test_int8_takes_every_forward_so_a_prompt_s_bits_do_not_depend_on_its_chunks(int8_kernel: gemv.Gemv) -> None:
    """With a bound of 4 rows asked for, a 50-token prefill still takes the int8 kernel: its logits
    are bitwise those of the same prompt fed in chunks of 4 (a forward left to torch's float32
    products would give other ones)."""
    fused = _block_model()
    lm = BatchedCausalLM(fused, torch.device("cpu"), torch.float32, max_slots=2, max_positions=64)
    lm.calibrate_products(4, activations="int8")
    assert fused.body.kernel_takes(2 * 64) and lm.head_product.kernel_max_rows == 2 * 64
    prompt = [(7 * j + 3) % 120 for j in range(50)]
    whole = lm.forward([Row(0, 0, prompt, 0)])[0]
    chunks = torch.cat([lm.forward([Row(1, s, prompt[s : s + 4], 0)])[0] for s in range(0, 50, 4)])
    assert torch.equal(whole, chunks)
