"""A drafter's structured output: each constrained row's grammar follows its committed, assumed
and drafted tokens, and masks its logits."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specd.engine.grammar import GrammarError, apply_mask
from specd.engine.sequences import SequenceState


def sync_grammars(active: Sequence[tuple[int, SequenceState, int]], contexts: dict[int, list[int]]) -> set[int]:
    """Bring each constrained sequence's grammar to its committed + assumed output; the ones that follow."""
    out = set()
    for i, state, _ in active:
        if state.grammar is None:
            continue
        try:
            state.grammar.sync(contexts[i][state.prompt_len :])
        except GrammarError:
            # Only if the verifier committed what this grammar refuses: the sequence
            # then drafts unconstrained, and the verifier's mask still holds.
            state.grammar = None
            continue
        out.add(i)
    return out


def mask_rows(
    active: Sequence[tuple[int, SequenceState, int]], logits: list[torch.Tensor], constrained: set[int]
) -> set[int]:
    """Mask each constrained row's logits in place in the list; returns the rows that must stop drafting."""
    ended = set()
    for row_i, (i, state, _) in enumerate(active):
        if i not in constrained:
            continue
        assert state.grammar is not None
        try:
            logits[row_i] = apply_mask(logits[row_i], state.grammar.allowed()[None])
        except GrammarError:
            ended.add(row_i)
    return ended


def push_token(state: SequenceState, token: int) -> bool:
    """Advance the sequence's grammar by a drafted token; False where the grammar refuses it."""
    assert state.grammar is not None
    try:
        state.grammar.push([token])
    except GrammarError:
        return False
    return True
