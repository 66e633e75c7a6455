"""Position ids and attention masks of a batched forward over the slot KV cache
(`specd.engine.kvcache.BatchedCausalLM`), for rows that are chains or token trees."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from specd.engine.attention_layout import AttentionLayout
from specd.engine.trees import check_parents, is_chain, tree_layout


def row_tree(parents: Sequence[int] | None, count: int) -> list[int] | None:
    """A row's tree of `count` fed tokens, checked; None for a chain (no parents, or parents
    that make one), which keeps the forwards that place every token at its index."""
    if parents is None:
        return None
    if len(parents) != count:
        raise ValueError(f"{len(parents)} parents for {count} tokens")
    if is_chain(parents):
        return None
    if problem := check_parents(parents):
        raise ValueError(problem)
    return list(parents)


def positions_and_mask(
    attention: AttentionLayout,
    starts: list[int],
    counts: list[int],
    trees: Sequence[list[int] | None],
    last_position: int,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, Any]:
    """Position ids [rows, max(counts)] and the model's attention mask for rows feeding `counts`
    tokens at `starts` (padded to the longest); `trees`: each row's token tree, or None for a chain."""
    num_new = max(counts)
    # Keys up to the furthest real token: a short row's padding is neither
    # written nor attended to by real tokens (its outputs are discarded).
    kv_len = max(s + n for s, n in zip(starts, counts, strict=True))
    if any(trees):
        positions, key_pos, visible = (_on(t, device) for t in tree_layout(starts, trees, num_new, kv_len))
        # Only padding can run past the model's last position (its outputs are discarded).
        positions = positions.clamp(max=last_position)
        return positions, attention.masks(visible, key_pos, positions, dtype)
    positions = _on(torch.tensor(starts), device)[:, None] + torch.arange(num_new, device=device)[None, :]
    # Padding of a short row may run past the model's last position; its outputs are
    # discarded, but learned position tables would index out of range.
    positions = positions.clamp(max=last_position)
    key_pos = torch.arange(kv_len, device=device)
    # Query at absolute position p sees keys 0..p of its own row only.
    visible = key_pos[None, None, :] <= positions[:, :, None]
    return positions, attention.masks(visible, key_pos, positions, dtype)


def _on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`, copied without waiting for the work queued there."""
    return t if device.type == "cpu" else t.to(device, non_blocking=True)
