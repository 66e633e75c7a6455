"""A weight's exact 4- or 8-bit blocks (`specd.engine.gemv.as_blocks`), found once per machine.

Finding them decodes and checks every weight of the model, the longest part of a cached start of
the embedded model's services. The blocks are kept under the cache directory's blocks/, named by
a hash of the weight's bytes (which the blocks rebuild bit for bit) and of the blocks' layout, so
a later start, or the other service holding the same weights, reads them instead.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from specd.engine.checkpoints import cache_dir

log = logging.getLogger(__name__)


def blocks_dir() -> Path:
    return cache_dir() / "blocks"


def weight_digest(weight: torch.Tensor, layout: int) -> str:
    """The hash of a float32 CPU weight's shape and bytes, and of the blocks' `layout` version."""
    digest = hashlib.blake2b(f"{layout}:{tuple(weight.shape)}".encode(), digest_size=16)
    digest.update(memoryview(weight.detach().contiguous().numpy()).cast("B"))
    return digest.hexdigest()


def on_threads(work: Callable[[torch.Tensor], Any], weights: Sequence[torch.Tensor]) -> list[Any]:
    """`work(weight)` for each weight (`kept`'s callers), on a thread per core this process may run
    on, in order: hashing a weight releases the GIL, and so do the tensor operations that find its
    blocks."""
    if len(weights) < 2:
        return [work(w) for w in weights]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    with ThreadPoolExecutor(max_workers=max(1, min(cores, len(weights)))) as pool:
        return list(pool.map(work, weights))


def kept(
    weight: torch.Tensor,
    find: Callable[[torch.Tensor], Any],
    make: Callable[[str, torch.Tensor, torch.Tensor], Any],
    layout: int,
    directory: Path | None = None,
) -> Any:
    """`find(weight)` (blocks with kind, q and scales, or None), or `make(kind, q, scales)` from what
    an earlier start kept for the same bytes and `layout`."""
    path = (directory or blocks_dir()) / f"{weight_digest(weight, layout)}.pt"
    with contextlib.suppress(OSError, RuntimeError, ValueError, KeyError, EOFError):
        saved = torch.load(path, mmap=True, weights_only=True)
        return make(saved["kind"], saved["q"], saved["scales"])
    blocks = find(weight)
    if blocks is None:
        return None  # a weight without blocks fails the search at its first rows: nothing to keep
    saved = {"kind": blocks.kind, "q": blocks.q, "scales": blocks.scales}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        torch.save(saved, partial)
        os.replace(partial, path)
    except OSError as exc:  # a read-only cache costs the next start the search again
        log.warning("could not keep a weight's blocks in %s: %s", path, exc)
    return blocks
