"""How the drafter service holds a model's weights: `--quantize` and `--dtype`, auto included."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import tinymodels
import torch
from torch import nn

from drafter_service import model_build, server
from drafter_service.config import DrafterConfig
from drafter_service.engine import default_branch_slots
from specd.engine import gemv
from specd.engine.quant import Int4WeightOnlyLinear, Int8WeightOnlyLinear


def _four_bit(model: nn.Module) -> nn.Module:
    """The model with every inner linear's weight made as a Q4_1 GGUF's dequantize: w = d * q + m."""
    model = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    head = model.get_output_embeddings()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Linear) and m is not head:
                n, k = m.weight.shape
                q = torch.randint(0, 16, (n, k // 32, 32), generator=g).float()
                q[..., 0], q[..., 1] = 0, 15
                d = (torch.rand(n, k // 32, 1, generator=g) * 0.05 + 0.01).half().float()
                low = (-torch.rand(n, k // 32, 1, generator=g) * 0.3).half().float()
                m.weight.copy_((d * q + low).reshape(n, k))
    return model


@pytest.fixture(scope="module")
def four_bit_dir(tmp_path_factory, tok, tiny_target) -> Path:
    # Untied: a head sharing the embedding's weight would be made 4-bit with the inner layers.
    model = tinymodels.build_model(0, len(tok), tok.bos_token_id, tok.eos_token_id, tie_word_embeddings=False)
    return tinymodels.save(_four_bit(model), tok, tmp_path_factory.mktemp("four-bit") / "m")


def _linears(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, nn.Linear | Int4WeightOnlyLinear | Int8WeightOnlyLinear)]


def test_auto_reads_four_bit_weights_in_float32_through_the_kernel(four_bit_dir: Path) -> None:
    if gemv.load() is None:
        pytest.skip("the gemv kernel cannot be built here")
    config = DrafterConfig(model=str(four_bit_dir), max_sequences=2, max_context=64)
    loaded, quantization = model_build._load_weights(config)
    assert (quantization, loaded.dtype) == ("none", torch.float32)
    assert all(type(m) is nn.Linear and m.weight.dtype == torch.float32 for m in _linears(loaded.model))
    engine, info = server.build_engine(config)
    assert info.dtype == "float32"
    assert engine.lm.model.body.linears.kernel is not None  # calibrated, as the verifier's products are


def test_auto_with_bfloat16_asked_for_is_the_int4_copy(four_bit_dir: Path) -> None:
    config = DrafterConfig(model=str(four_bit_dir), dtype="bfloat16", max_sequences=2, max_context=64)
    loaded, quantization = model_build._load_weights(config)
    assert (quantization, loaded.dtype) == ("int4", torch.bfloat16)
    assert any(isinstance(m, Int4WeightOnlyLinear) for m in loaded.model.modules())


def test_auto_without_the_kernel_is_the_int4_copy(four_bit_dir: Path, monkeypatch) -> None:
    monkeypatch.setattr(model_build.gemv, "load", lambda: None)
    loaded, quantization = model_build._load_weights(DrafterConfig(model=str(four_bit_dir)))
    assert (quantization, loaded.dtype) == ("int4", torch.bfloat16)


def test_auto_on_weights_that_are_not_four_bit_is_the_int8_copy(model_dirs) -> None:
    loaded, quantization = model_build._load_weights(DrafterConfig(model=str(model_dirs["draft"])))
    assert (quantization, loaded.dtype) == ("int8", torch.bfloat16)


def test_wide_rows_name_a_quantized_drafter(four_bit_dir: Path) -> None:
    if gemv.load() is None:
        pytest.skip("the gemv kernel cannot be built here")
    with pytest.raises(ValueError, match="int8_wide_rows applies to a quantized drafter"):
        model_build._load_weights(DrafterConfig(model=str(four_bit_dir), int8_wide_rows=8))


def test_auto_dtype() -> None:
    assert model_build.activation_dtype("auto", "cpu", "none") == "float32"
    assert model_build.activation_dtype("auto", "cpu", "int4") == "bfloat16"
    assert model_build.activation_dtype("auto", "cuda", "none") == "bfloat16"
    assert model_build.activation_dtype("float16", "cpu", "none") == "float16"
    with pytest.raises(SystemExit):
        DrafterConfig.from_args(["--dtype", "float64"])


def test_branch_slots_reach_the_engine_and_its_cache(model_dirs) -> None:
    flags = ["--quantize", "none", "--max-sequences", "2", "--max-context", "64", "--branch-slots", "3"]
    config = DrafterConfig.from_args(["--model", str(model_dirs["draft"]), *flags])
    engine, _ = server.build_engine(config)
    assert engine.table.branch_slots == 3 and engine.lm.cache.max_slots == 2 + 3
    with pytest.raises(ValueError, match="branch_slots"):
        DrafterConfig(branch_slots=-2).validate()


def test_default_branch_slots_double_the_cache_only_where_pages_are_backed_as_written() -> None:
    assert default_branch_slots(8, torch.device("cpu")) == 8
    assert default_branch_slots(8, torch.device("cuda")) == 2
    assert default_branch_slots(2, torch.device("cuda")) == 1
