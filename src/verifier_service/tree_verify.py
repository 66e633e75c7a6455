"""What verifying a token tree (VerifyTask.draft_parents) adds to a round of the VerifierEngine:
its checks, its row, its seeded noise keys, and committing the accepted path, whose keys and
values the forward wrote at the nodes' indices and which must end up contiguous."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specd.engine.errors import invalid
from specd.engine.kvcache import BatchedCausalLM, Row
from specd.engine.logprobs import token_logprobs
from specd.engine.sequences import SequenceState
from specd.engine.tasks import VerifyResult, VerifyTask
from specd.engine.trees import check_parents, row_depths, with_prefix


def check_tree(state: SequenceState, task: VerifyTask) -> None:
    """A task's tree, where it has one: well formed, and for a sequence whose rows depend only on
    their path (a grammar's mask and penalties follow the drafts before a row, as a chain has them)."""
    if not task.draft_parents:
        return
    if len(task.draft_parents) != len(task.draft_tokens):
        raise invalid(f"{len(task.draft_parents)} draft parents for {len(task.draft_tokens)} draft tokens")
    if problem := check_parents(task.draft_parents):
        raise invalid(f"draft parents: {problem}")
    if state.grammar is not None:
        raise invalid("a sequence with a grammar (structured output) verifies a chain of drafts, not a tree")
    if state.penalties.active:
        raise invalid("a sequence with penalties, logit bias or min_tokens verifies a chain of drafts, not a tree")


def verify_row(state: SequenceState, task: VerifyTask) -> Row:
    """The sequence's row: its committed tokens not cached yet, then the drafts (a chain, or the
    task's tree under the last committed token); logits from the last committed token on."""
    prefix = state.committed[len(state.cached) :]
    fed = prefix + list(task.draft_tokens)
    parents = with_prefix(len(prefix), task.draft_parents) if task.draft_parents else None
    return Row(state.slot, len(state.cached), fed, len(prefix) - 1, parents=parents)


def noise_spans(seed: int, committed: int, task: VerifyTask) -> list[tuple[int, int, int]]:
    """(seed, position, count) spans of a seeded sequence's rows (`specd.engine.sampling.spans_keys`):
    each row's noise is keyed by the position of the token it decides, committed + its depth."""
    if not task.draft_parents:
        return [(seed, committed, len(task.draft_tokens) + 1)]
    return [(seed, committed + d, 1) for d in row_depths(task.draft_parents)]


def commit_path(
    lm: BatchedCausalLM,
    state: SequenceState,
    task: VerifyTask,
    row: Row,
    path: Sequence[int],
    next_token: int,
    raw: torch.Tensor,
    hidden: torch.Tensor | None,
    result: VerifyResult,
) -> None:
    """Commit the accepted drafts `path` (node indices, root's child first; a chain's 0, 1, ...)
    and the next token into the sequence and `result`. `raw`: the forward's logits of the row
    [k + 1, V] (the root's row, then each node's); `hidden`: its hidden states of every fed token."""
    prefix = len(row.tokens) - len(task.draft_tokens)
    accepted = [task.draft_tokens[i] for i in path]
    # The token after the root is scored at row 0, the token after node i at row 1 + i.
    scored = raw if not task.draft_parents else raw[[0, *(1 + i for i in path)]]
    if state.logprobs is not None:
        result.logprobs = token_logprobs(scored, [*accepted, next_token], state.logprobs.top)
    kept = list(range(prefix)) + [prefix + i for i in path]
    if task.return_hidden and hidden is not None:
        # What this forward fed and keeps: the committed tokens not cached yet and the accepted drafts.
        rows = hidden[: len(kept)] if not task.draft_parents else hidden[kept]
        result.hidden = rows.to(torch.bfloat16).cpu()
        result.hidden_start = row.start
    if task.draft_parents:
        lm.cache.compact(row.slot, row.start, kept)
        result.accepted_path = list(path)
    state.committed.extend(accepted)
    state.cached = state.committed[:]
    state.committed.append(next_token)
    result.num_accepted = len(path)
    result.next_token = next_token
