"""Loading causal LMs onto a device, for the services and the tools.

Where a model's files are and how its tokenizer loads is specd.engine.checkpoints (no torch there,
for the gateway); nothing here downloads either.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specd.engine import LOAD_FORMAT_CHOICES, draftlm, featurehead, synthetic
from specd.engine.attention_layout import UnsupportedAttention, layout
from specd.engine.checkpoints import ModelLoadError, is_distilled, load_tokenizer, materialize
from specd.engine.cpus import pin
from specd.engine.end_tokens import end_token_ids
from specd.engine.fingerprint import TokenizerFingerprint

log = logging.getLogger(__name__)

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


def load_distilled(path: str | Path, dtype: torch.dtype, materialize: Any) -> Any:
    """A distilled drafter directory as a causal LM, whichever design its manifest names."""
    path = Path(path)
    info = draftlm.manifest(path)
    if info.get("design") == "feature-head":
        return featurehead.load(path, info, dtype, materialize)
    return draftlm.load(path, dtype, materialize)


def read_config(path: Path, load_format: str) -> Any:
    """The transformers config in `path`'s config.json, for weights made rather than loaded."""
    from transformers import AutoConfig

    if not (path / "config.json").is_file():
        raise ModelLoadError(f"--load-format {load_format} needs a directory with a config.json, not {str(path)!r}")
    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:
        raise ModelLoadError(f"cannot read the model config in {path}: {exc}") from exc


def load_dummy(spec: str, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Any:
    """`--load-format dummy`: a causal LM of the architecture and shape in `spec`'s config.json,
    with random weights made on `device` in `dtype` (an 8B shape on a GPU takes seconds, and never
    passes through host memory). Its output is meaningless: it is for timing a model whose
    weights are not at hand."""
    from transformers import AutoModelForCausalLM

    path = Path(spec)
    config = read_config(path, "dummy")
    log.warning(
        "--load-format dummy: %s has RANDOM weights in the shape of %s; every token it outputs is meaningless",
        config.model_type,
        path / "config.json",
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=attention_implementation(path)
        )
    return model.eval()


def load_synthetic(
    spec: str, device: torch.device, dtype: torch.dtype, made: synthetic.SyntheticSpec, tokens: int, end_ids: Any
) -> Any:
    """`--load-format synthetic` (specd.engine.synthetic): a causal LM of the shape in `spec`'s
    config.json, made on `device` so that its greedy successors agree with the target's at `made`'s rate."""
    from transformers import AutoModelForCausalLM

    path = materialize(spec)
    config = read_config(path, "synthetic")
    synthetic.untie(config)
    log.warning(
        "--load-format synthetic: %s has %s weights in the shape of %s; its text is meaningless",
        config.model_type,
        made.describe().upper(),
        path / "config.json",
    )
    torch.manual_seed(made.seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=attention_implementation(path)
        )
    return synthetic.make(model, made, tokens, end_ids)


def load_model(spec: str, device: torch.device, dtype: torch.dtype, load_format: str = "auto") -> Any:
    from transformers import AutoModelForCausalLM

    if load_format == "dummy":
        return load_dummy(spec, device, dtype)
    if load_format == "synthetic":
        raise ValueError("--load-format synthetic builds its weights beside the tokenizer: use load_for_serving")
    if load_format != "auto":
        raise ValueError(f"--load-format takes {', '.join(LOAD_FORMAT_CHOICES)}, not {load_format!r}")
    path = materialize(spec)
    if is_distilled(path):
        try:
            model = load_distilled(path, dtype, materialize)
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
    # How the weights were made, for ModelInfo.weights: "" (the checkpoint's), "dummy", or synthetic's.
    weights: str = ""


def load_for_serving(
    spec: str,
    device_name: str,
    dtype_name: str,
    threads: int = 0,
    cpus: str = "",
    load_format: str = "auto",
    made: synthetic.SyntheticSpec | None = None,
) -> LoadedModel:
    """What a model service loads at startup: weights on their device, and the tokenizer's identity.
    `made`: what --load-format synthetic builds from (default: the target's, seed 0).

    Pinning comes first, so every thread torch starts afterwards inherits it.
    """
    pinned = pin(cpus)
    device = parse_device(device_name)
    dtype = parse_dtype(dtype_name)
    if threads or pinned:
        torch.set_num_threads(threads or len(pinned))
    tokenizer = load_tokenizer(spec)
    end_ids = end_token_ids(spec, tokenizer)
    if load_format == "synthetic":
        made = made or synthetic.SyntheticSpec()
        model = load_synthetic(spec, device, dtype, made, len(tokenizer), end_ids)
        weights = made.describe()
    else:
        model = load_model(spec, device, dtype, load_format)
        weights = "" if load_format == "auto" else load_format
    fingerprint = TokenizerFingerprint.of(tokenizer, end_ids)
    return LoadedModel(model, device, dtype, fingerprint, tokenizer, weights)
