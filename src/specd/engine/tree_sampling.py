"""The rules that accept a path of a token tree, for one sequence: pure tensor functions.

The target's rows are those of one forward over the tree (`specd.engine.trees`): row 0 is the
target at the root (the last committed token), row 1 + i the target after draft node i. Each
walk starts at the root and moves to an accepted child until none is; it then emits one token
from the node it stopped at. For a chain (node i's parent i - 1) both rules are the chain's
(`specd.engine.sampling`).

- greedy and seeded: the target's own token at each row decides (its argmax, or its Gumbel-max
  draw keyed by the row's absolute position); the walk follows the first child, in order, whose
  token is it, and emits it where no child's is.
- unseeded sampled: the multi-candidate rejection rule (SpecInfer, Miao et al. 2024, arXiv
  2305.09781; recursive rejection sampling with replacement). At a node with distribution p, its
  children are tried in order: child x, drawn from its own q, is accepted with probability
  min(1, p(x)/q(x)); on rejection p becomes norm(max(p - q, 0)) and the next child is tried
  against it. When every child is rejected (or there is none) the token is drawn from the last
  p. Each step is a chain's rejection step against the p left by the earlier ones, and each
  child is drawn independently of its siblings, so the emitted tokens are distributed as p's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specd.engine.sampling import sample_tensor
from specd.engine.trees import children


@dataclass(frozen=True)
class TreeVerdict:
    path: tuple[int, ...]  # the accepted drafts' node indices, root's child first
    next_token: int

    @property
    def num_accepted(self) -> int:
        return len(self.path)


def coupled_tree_verdict(
    target_tokens: Sequence[int], draft_tokens: Sequence[int], parents: Sequence[int]
) -> TreeVerdict:
    """Greedy and seeded: `target_tokens` [k + 1] are the target's own tokens at the root's row
    and at each node's; follow the first child whose draft is the target's token."""
    if len(target_tokens) != len(draft_tokens) + 1 or len(parents) != len(draft_tokens):
        raise ValueError(
            f"{len(target_tokens)} target tokens and {len(parents)} parents for {len(draft_tokens)} drafts"
        )
    kids = children(parents)
    path: list[int] = []
    node = -1
    while True:
        want = int(target_tokens[node + 1])
        node = next((c for c in kids.get(node, ()) if draft_tokens[c] == want), -2)
        if node == -2:
            return TreeVerdict(tuple(path), want)
        path.append(node)


def tree_rejection_sample(
    target_probs: torch.Tensor,
    draft_tokens: Sequence[int],
    parents: Sequence[int],
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None,
) -> TreeVerdict:
    """The multi-candidate rejection rule on one tree.

    target_probs: [k + 1, V], p at the root's row and at each node's.
    draft_probs:  [k, V], the q each node was drawn from; a row of zeros (or None for every node)
                  is a point mass on the node's token.
    generator:    the sequence's generator; None for a one-hot p (greedy), which needs no draw.
    """
    k = len(draft_tokens)
    if target_probs.shape[0] != k + 1 or len(parents) != k:
        raise ValueError(f"target_probs has {target_probs.shape[0]} rows and {len(parents)} parents for {k} drafts")
    kids = children(parents)
    path: list[int] = []
    node = -1
    while True:
        p = target_probs[node + 1]
        chosen = -2
        for child in kids.get(node, ()):
            q = draft_probs[child] if draft_probs is not None else None
            if accepts(p, draft_tokens[child], q, generator):
                chosen = child
                break
            p = after_rejection(p, draft_tokens[child], q)
        if chosen == -2:
            return TreeVerdict(tuple(path), int(sample_tensor(p, generator)))
        path.append(chosen)
        node = chosen


def accepts(p: torch.Tensor, token: int, q: torch.Tensor | None, generator: torch.Generator | None) -> bool:
    """Accept `token`, drawn from q (None or zeros: a point mass), with probability min(1, p/q)."""
    px = p[token]
    qx = q[token] if q is not None else px.new_ones(())
    qx = torch.where(qx > 0, qx, 1.0)  # a zero q(token) is only ever a point mass's empty row
    if generator is None:
        return bool(px > 0)  # u = 0, as the chain rule's one-hot case
    u = torch.rand((), generator=generator, device=p.device)
    return bool(u * qx < px)  # u < p/q without dividing by a tiny q


def after_rejection(p: torch.Tensor, token: int, q: torch.Tensor | None) -> torch.Tensor:
    """norm(max(p - q, 0)): what the next sibling, or the emitted token, is judged against once
    `token` (drawn from q) was rejected. A function of its own so that tests can swap in a
    wrong one and check that the statistical tests notice."""
    if q is None or not bool(q.sum() > 0):
        out = p.clone()
        out[token] = 0.0
    else:
        out = (p - q).clamp_(min=0.0)
    total = out.sum()
    # Only when p <= q everywhere (p == q) can it vanish, and then rejection had probability 0.
    return out / total if bool(total > 0) else p
