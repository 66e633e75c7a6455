"""Token trees: the shape of a forward that feeds several branches of drafts at once.

A tree is given by its parents: node i's parent is an earlier node's index, or -1 for the
root (the last token already in the cache, or the last committed one). A chain is the tree
whose node i has parent i - 1. Pure functions of the parents: no model, no cache.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def check_parents(parents: Sequence[int]) -> str | None:
    """Why `parents` is not a tree in this encoding (each parent earlier, or -1), or None."""
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            return f"node {i} has parent {parent}: a parent is -1 or an earlier node's index"
    return None


def chain(count: int) -> list[int]:
    """The parents of a chain of `count` nodes."""
    return list(range(-1, count - 1))


def is_chain(parents: Sequence[int]) -> bool:
    return all(parent == i - 1 for i, parent in enumerate(parents))


def depths(parents: Sequence[int]) -> list[int]:
    """Each node's depth below the root: 0 for a child of the root."""
    out: list[int] = []
    for parent in parents:
        out.append(0 if parent < 0 else out[parent] + 1)
    return out


def row_depths(parents: Sequence[int]) -> list[int]:
    """How far past the root each of a verify's rows decides: row 0 (the root's) the first token,
    row 1 + i (node i's) the token after node i, depth(i) + 1 past the root."""
    return [0, *(d + 1 for d in depths(parents))]


def path_to(parents: Sequence[int], node: int) -> list[int]:
    """The nodes from the root's child down to `node` (none for the root, -1)."""
    out: list[int] = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


def children(parents: Sequence[int]) -> dict[int, list[int]]:
    """Each node's children in order (the root's under -1); a leaf has none listed."""
    out: dict[int, list[int]] = {}
    for i, parent in enumerate(parents):
        out.setdefault(parent, []).append(i)
    return out


def ancestor_mask(parents: Sequence[int]) -> torch.Tensor:
    """[n, n] bool: entry (i, j) is whether node j is node i itself or one of its ancestors,
    which is what node i attends to among the fed nodes."""
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    for i, parent in enumerate(parents):
        if parent >= 0:
            mask[i] |= mask[parent]
    return mask


def with_prefix(prefix: int, parents: Sequence[int]) -> list[int]:
    """The parents of a forward's fed tokens: `prefix` tokens in a chain (committed, not cached
    yet), then the tree's nodes, whose root is the prefix's last token."""
    root = prefix - 1
    return chain(prefix) + [root if parent < 0 else prefix + parent for parent in parents]


def tree_layout(
    starts: Sequence[int], trees: Sequence[Sequence[int] | None], num_new: int, kv_len: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a batched forward over a slot cache needs for rows that may be trees, on the CPU:
    position ids [rows, num_new], each key's position [rows, kv_len] and which keys each query
    sees [rows, num_new, kv_len]. Row i's node j is written at cache index starts[i] + j but sits
    at position starts[i] + its depth, and sees the keys before starts[i] and its own ancestors
    and itself. A row without a tree (None) is a chain, as is each row's padding."""
    index = torch.arange(num_new)
    key_index = torch.arange(kv_len)
    start = torch.tensor(list(starts), dtype=torch.long)
    positions = start[:, None] + index[None, :]
    key_pos = key_index.repeat(len(starts), 1)
    visible = key_index[None, None, :] <= positions[:, :, None]
    for i, parents in enumerate(trees):
        if parents is None:
            continue
        n, s = len(parents), starts[i]
        at = s + torch.tensor(depths(parents), dtype=torch.long)
        positions[i, :n] = at
        key_pos[i, s : s + n] = at
        visible[i, :n, s : s + n] = ancestor_mask(parents)
    return positions, key_pos, visible
