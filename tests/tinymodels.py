"""Tiny random-weight causal LMs for tests, saved like any local HF checkpoint.

They use the embedded model's tokenizer cut to its first TEST_VOCAB tokens (`tokenizer`), so the
gateway tokenizes real text, chat templates and special tokens are the embedded model's and
fingerprints are meaningful, with a 2-layer body that runs in milliseconds.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from specd.engine.checkpoints import EMBEDDED, materialize


def device_under_test() -> torch.device:
    """Where engine tests run their models: SPECD_TEST_DEVICE (e.g. cuda), default the CPU."""
    return torch.device(os.environ.get("SPECD_TEST_DEVICE", "cpu"))


def on_test_device(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """The model on the test device; a copy off the CPU, so session-wide CPU models stay put."""
    device = device_under_test()
    return model if device.type == "cpu" else copy.deepcopy(model).to(device)


def backed_kv_bytes(table, positions: int) -> int:
    """What a SequenceTable's kv_bytes() reports with `positions` written: on the CPU the written
    positions alone are backed by memory; a CUDA cache is allocated whole up front."""
    if device_under_test().type == "cpu":
        return positions * table.kv_bytes_per_token()
    return table.kv_reserved_bytes()


def merged(pair: list[str] | str) -> str:
    """What a merge makes: tokenizer.json writes a merge as a pair or as "left right"."""
    return "".join(pair) if isinstance(pair, list) else pair.replace(" ", "", 1)


# The embedded tokenizer's first 4,096 tokens: its special tokens, bytes and first merges. Text
# takes about a third more tokens than with all 49,152, and the LM head, most of a tiny model's
# work, is twelve times smaller.
TEST_VOCAB = 4096


def tokenizer():
    """The embedded model's tokenizer cut to TEST_VOCAB tokens: a byte-level BPE keeps working
    with a prefix of its merges (ids past the bytes are merges in the order they were learned), so
    every text still encodes and decodes to itself. SPECD_TEST_TOKENIZER names a directory holding
    the full one (the shipped drafter's, src/specd/data/smollm2-135m-drafter) where the embedded
    GGUF is not at hand: a GPU host it cannot travel to (scripts/gpu_check.py)."""
    source = Path(os.environ.get("SPECD_TEST_TOKENIZER") or materialize(EMBEDDED))
    cut = Path(tempfile.mkdtemp(prefix="specd-test-tokenizer-"))
    for name in ("tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (source / name).exists():
            shutil.copy(source / name, cut)
    spec = json.loads((source / "tokenizer.json").read_text())
    model = spec["model"]
    model["vocab"] = {token: i for token, i in model["vocab"].items() if i < TEST_VOCAB}
    model["merges"] = [pair for pair in model["merges"] if merged(pair) in model["vocab"]]
    (cut / "tokenizer.json").write_text(json.dumps(spec))
    made = AutoTokenizer.from_pretrained(str(cut), local_files_only=True)
    shutil.rmtree(cut)
    return made


def build_model(seed: int, vocab_size: int, bos: int, eos: int, layers: int = 2, **overrides: Any) -> LlamaForCausalLM:
    """`overrides`: LlamaConfig fields that differ from the tests' usual tiny model."""
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        # Larger than the usual 0.02 so that logits are decisive: greedy argmax
        # then does not hinge on float rounding.
        initializer_range=0.2,
        tie_word_embeddings=True,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    for name, value in overrides.items():
        setattr(config, name, value)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    return model


def perturbed(model: LlamaForCausalLM, scale: float, seed: int) -> LlamaForCausalLM:
    """A copy of `model` with noise on every weight: a drafter that agrees partly."""
    clone = type(model)(model.config).eval()
    clone.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in clone.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale * p.std())
    return clone


def save(model: LlamaForCausalLM, tok, path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


# The architectures a user's own pair is likely to have, each as tiny as the Llama above
# (2 layers, hidden 64), with what sets it apart switched on: biases on q/k/v (Qwen2), norms on
# q and k (Qwen3), a sliding window (Mistral, Phi-3 and Gemma-2's every other layer, narrow
# enough that the tests' sequences outgrow it), a fused qkv and gate_up (Phi-3), soft-capping,
# a scaled embedding and extra norms (Gemma-2).
SLIDING_WINDOW = 8
ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 16}),
    "mistral": ("MistralConfig", {"sliding_window": SLIDING_WINDOW, "head_dim": 16}),
    "phi3": ("Phi3Config", {"sliding_window": SLIDING_WINDOW, "pad_token_id": None}),
    "gemma2": (
        "Gemma2Config",
        {
            "sliding_window": SLIDING_WINDOW,
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "hidden_activation": "gelu_pytorch_tanh",
            # Tied to its scaled embedding, a tiny random Gemma-2 repeats its last token forever.
            "tie_word_embeddings": False,
        },
    ),
}


def build_architecture(arch: str, seed: int, vocab_size: int, bos: int, eos: int | list[int]) -> Any:
    """A tiny random-weight causal LM of architecture `arch` (a key of ARCHITECTURES)."""
    import transformers

    name, extra = ARCHITECTURES[arch]
    fields: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "initializer_range": 0.2,
        "tie_word_embeddings": True,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": eos if isinstance(eos, int) else eos[0],
        **extra,
    }
    config = getattr(transformers, name)(**fields)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    return model
