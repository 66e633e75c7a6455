"""`--load-format dummy`: random weights in the shape of any config.json, made on the device."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from drafter_service.config import DrafterConfig
from specd.engine import models
from specd.engine.checkpoints import ModelLoadError
from verifier_service.config import VerifierConfig

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 80,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
}


def test_a_config_alone_gives_a_model_of_its_shape_with_a_warning(tmp_path: Path, caplog) -> None:
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    with caplog.at_level(logging.WARNING):
        model = models.load_model(str(tmp_path), torch.device("cpu"), torch.bfloat16, "dummy")
    assert isinstance(model, LlamaForCausalLM)
    assert len(model.model.layers) == 2 and model.lm_head.weight.shape == (80, 32)
    assert all(p.dtype == torch.bfloat16 and p.device.type == "cpu" for p in model.parameters())
    assert "RANDOM weights" in caplog.text and "meaningless" in caplog.text
    # Seeded: the same dummy weights every time, so two services given one config agree.
    again = models.load_model(str(tmp_path), torch.device("cpu"), torch.bfloat16, "dummy")
    assert torch.equal(model.lm_head.weight, again.lm_head.weight)
    with torch.inference_mode():
        logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, 80) and torch.isfinite(logits).all()


def test_dummy_needs_a_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"needs a directory with a config\.json"):
        models.load_model(str(tmp_path), torch.device("cpu"), torch.float32, "dummy")
    with pytest.raises(ValueError, match="--load-format takes auto, dummy, synthetic"):
        models.load_model(str(tmp_path), torch.device("cpu"), torch.float32, "pt")


def test_both_services_take_the_flags() -> None:
    for cls in (VerifierConfig, DrafterConfig):
        config = cls.from_args(["--load-format", "dummy", "--cuda-graphs", "off"])
        assert (config.load_format, config.cuda_graphs) == ("dummy", "off")
    with pytest.raises(SystemExit):
        VerifierConfig.from_args(["--cuda-graphs", "maybe"])
