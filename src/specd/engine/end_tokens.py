"""The ids that end a sequence: one set for the gateway, both services and the grammar.

A model may end its output with more than its tokenizer's eos token: Llama 3 lists
`<|eot_id|>` beside `<|end_of_text|>` in `generation_config.json`, Qwen2.5 `<|im_end|>`
beside `<|endoftext|>`. transformers' `generate` and vLLM stop on every id listed there;
so does specd, with this set. No torch here: the gateway reads it too.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from specd.engine.checkpoints import MANIFEST, ModelLoadError, is_distilled, materialize

log = logging.getLogger(__name__)

GENERATION_CONFIG = "generation_config.json"


def _as_ids(value: Any, source: str) -> list[int]:
    """`eos_token_id` as written: absent, one id or a list of ids."""
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ModelLoadError(f"{source}: eos_token_id must be a token id or a list of them, not {value!r}")
    return values


def generation_config_end_ids(path: Path) -> list[int]:
    """The eos ids `path`'s generation_config.json lists (none without one)."""
    file = path / GENERATION_CONFIG
    if not file.is_file():
        return []
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {file}: {exc}") from exc
    return _as_ids(config.get("eos_token_id") if isinstance(config, dict) else None, str(file))


def _model_dir(spec: str) -> Path:
    """Where `spec`'s generation config is: a distilled drafter ends where its target does."""
    path = materialize(spec)
    if not is_distilled(path):
        return path
    target = json.loads((path / MANIFEST).read_text()).get("target")
    if not isinstance(target, str) or not target:
        return path
    try:
        return materialize(target)
    except ModelLoadError as exc:
        log.warning("the end ids of %s come from its own files: its target %r is not here (%s)", path, target, exc)
        return path


def end_token_ids(spec: str, tokenizer: Any) -> tuple[int, ...]:
    """Every id that ends a sequence of model `spec` whose tokenizer is `tokenizer`, ascending."""
    return merge(generation_config_end_ids(_model_dir(spec)), tokenizer)


def merge(ids: Iterable[int], tokenizer: Any) -> tuple[int, ...]:
    """`ids` and the tokenizer's eos id, ascending, each once."""
    out = set(ids)
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None:
        out.add(int(eos))
    return tuple(sorted(out))
