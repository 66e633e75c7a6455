"""Loading causal LMs onto a device, for the services and the tools.

Where a model's files are and how its tokenizer loads is specd.checkpoints (no torch there,
for the gateway); nothing here downloads either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from specd import draftlm
from specd.attention_layout import UnsupportedAttention, layout
from specd.checkpoints import ModelLoadError, is_distilled, load_tokenizer, materialize
from specd.end_tokens import end_token_ids
from specd.fingerprint import TokenizerFingerprint
from specd.placement import pin

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}") from None


def parse_device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"device {name!r} requested but only {torch.cuda.device_count()} CUDA devices exist")
    return device


def load_model(spec: str, device: torch.device, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    path = materialize(spec)
    if is_distilled(path):
        try:
            model = draftlm.load(path, dtype, materialize)
        except (OSError, ValueError, KeyError) as exc:
            raise ModelLoadError(f"cannot load the distilled drafter in {path}: {exc}") from exc
        model.to(device)
        return model
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=dtype, local_files_only=True, attn_implementation=attention_implementation(path)
        )
    except Exception as exc:
        raise ModelLoadError(f"cannot load a causal LM from {path}: {exc}") from exc
    try:
        layout(model.config.get_text_config())
    except UnsupportedAttention as exc:
        raise ModelLoadError(f"cannot serve {path} exactly: {exc}") from exc
    model.to(device)
    model.eval()
    return model


def attention_implementation(path: Any) -> str:
    """PyTorch's fused attention where transformers offers it for the model's class, else its
    eager attention: transformers refuses SDPA for some (Gemma-2, for its soft-capping)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except Exception:
        return "sdpa"  # from_pretrained then names what is wrong
    return "sdpa" if getattr(model_class, "_supports_sdpa", False) else "eager"


@dataclass(frozen=True)
class LoadedModel:
    model: Any
    device: torch.device
    dtype: torch.dtype
    fingerprint: TokenizerFingerprint
    # The tokenizer itself: structured output compiles grammars against it.
    tokenizer: Any = None


def load_for_serving(spec: str, device_name: str, dtype_name: str, threads: int = 0, cpus: str = "") -> LoadedModel:
    """What a model service loads at startup: weights on their device, and the tokenizer's identity.

    Pinning comes first, so every thread torch starts afterwards inherits it.
    """
    pinned = pin(cpus)
    device = parse_device(device_name)
    dtype = parse_dtype(dtype_name)
    if threads or pinned:
        torch.set_num_threads(threads or len(pinned))
    model = load_model(spec, device, dtype)
    tokenizer = load_tokenizer(spec)
    fingerprint = TokenizerFingerprint.of(tokenizer, end_token_ids(spec, tokenizer))
    return LoadedModel(model, device, dtype, fingerprint, tokenizer)
