"""What one sequence feeds a batched forward (`specd.engine.kvcache.BatchedCausalLM`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Row:
    """One sequence's part of a batched forward."""

    slot: int
    start: int  # tokens already in the cache for this slot
    tokens: list[int]  # new tokens to feed, written at start, start+1, ...
    logits_from: int  # index into `tokens` of the first position whose logits are wanted
    # For a model that reads features (a feature drafter, specd.engine.featurehead): [len(tokens), feature_size],
    # the feature fed beside each token; None feeds zeros.
    features: torch.Tensor | None = None
    # A token tree (specd.engine.trees): each token's parent among them, or -1 for the last cached token;
    # a node sits at position start + its depth and sees only its ancestors among them. None: a chain.
    parents: list[int] | None = None
