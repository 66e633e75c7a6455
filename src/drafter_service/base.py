"""What every drafter does with its tasks (no gRPC, no torch here): the checks of a round's tasks,
and the sequences' committed tokens. The model-free drafters build on it alone, so their process
imports no torch (`specd up`'s suffix drafter on the CPU)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from specd.engine.errors import EngineError, invalid, precondition
from specd.engine.fingerprint import TokenizerFingerprint
from specd.engine.sequences import SequenceState, SequenceTable
from specd.engine.tasks import DraftProposal, DraftTask, SequenceSpec

if TYPE_CHECKING:
    import torch


class DrafterBase:
    kind = "model"

    def __init__(self, table: SequenceTable, fingerprint: TokenizerFingerprint | None, max_draft_tokens: int):
        self.table = table
        self.fingerprint = fingerprint
        self.max_draft_tokens = max_draft_tokens

    @property
    def max_context(self) -> int:
        return self.table.max_context

    def open(self, specs: Sequence[SequenceSpec]) -> tuple[list[EngineError | None], int]:
        return self.table.open(specs)

    def close(
        self, ids: Sequence[str], ignore_unknown: bool = False, tails: Mapping[str, tuple[list[int], int]] | None = None
    ) -> int:
        """Close `ids`. `tails` (the tokens committed since a sequence's last task) serve a drafter
        that learns from finished responses (the suffix drafter); a model's cache has no use for them."""
        return self.table.close(ids, ignore_unknown)

    def kv_bytes(self) -> int:
        return self.table.kv_bytes()

    def _decode_features(self, task: DraftTask, committed: int) -> torch.Tensor | None:
        """The task's hidden states, checked; this drafter reads none, so sending any is an error."""
        if task.hidden_states:
            raise invalid("this drafter reads no hidden states (its feature_size is 0)")
        return None

    def _accept_tasks(
        self, tasks: Sequence[DraftTask]
    ) -> tuple[list[DraftProposal], list[tuple[int, SequenceState, int, list[int]]]]:
        """Validate tasks and append their committed tokens.

        Returns the proposals and, per live task, (index, state, k, context): the
        context is the committed tokens plus any assumed ones, which drafting
        continues from.
        """
        proposals = [DraftProposal(t.sequence_id) for t in tasks]
        live: list[tuple[int, SequenceState, int, list[int]]] = []
        seen: set[str] = set()
        for i, task in enumerate(tasks):
            try:
                if task.sequence_id in seen:
                    raise invalid(f"sequence {task.sequence_id!r} appears twice in one round")
                seen.add(task.sequence_id)
                state = self.table.get(task.sequence_id)
                if task.num_draft_tokens < 0:
                    raise invalid(f"num_draft_tokens must be >= 0, got {task.num_draft_tokens}")
                if task.num_draft_tokens > self.max_draft_tokens:
                    raise invalid(f"{task.num_draft_tokens} draft tokens exceed the limit of {self.max_draft_tokens}")
                if task.prefill_tokens > 0 and (task.num_draft_tokens or task.assumed or task.guess_first):
                    raise invalid("a prefill task drafts nothing, assumes nothing and guesses nothing")
                check_siblings(task)
                check_branches(task, state)
                self.table.check_tokens(task.new_tokens, "new tokens")
                self.table.check_tokens(task.assumed, "assumed tokens")
                total = len(state.committed) + len(task.new_tokens)
                if total != task.num_committed:
                    raise precondition(
                        f"sequence {task.sequence_id!r} would have {total} committed tokens, "
                        f"the caller says {task.num_committed}"
                    )
                if total + len(task.assumed) + task.num_draft_tokens > self.table.max_context:
                    raise invalid(
                        f"{total} committed + {len(task.assumed)} assumed + {task.num_draft_tokens} draft "
                        f"tokens exceed the context window {self.table.max_context}"
                    )
                features = self._decode_features(task, total)
            except EngineError as exc:
                proposals[i].error = exc
                continue
            if features is not None:
                assert state.features is not None
                state.features.add_real(task.hidden_start, features)
            state.committed.extend(task.new_tokens)
            context = state.committed + list(task.assumed) if task.assumed else state.committed
            live.append((i, state, task.num_draft_tokens, context))
        return proposals, live


def check_siblings(task: DraftTask) -> None:
    """Siblings go beside chain drafts, at most one a depth, and never beside a guess."""
    if task.num_siblings == 0:
        return
    if task.num_siblings < 0:
        raise invalid(f"num_siblings must be >= 0, got {task.num_siblings}")
    if task.prefill_tokens > 0:
        raise invalid("a prefill task proposes no siblings")
    if task.guess_first:
        raise invalid("num_siblings must be 0 with guess_first")
    if task.num_siblings > task.num_draft_tokens:
        raise invalid(f"{task.num_siblings} siblings exceed the {task.num_draft_tokens} draft tokens beside them")


def check_branches(task: DraftTask, state: SequenceState) -> None:
    """Branches follow a guess at the verifier's token after assumed ones, and need no mask."""
    if task.num_branches == 0:
        return
    if task.num_branches < 0:
        raise invalid(f"num_branches must be >= 0, got {task.num_branches}")
    if task.prefill_tokens > 0:
        raise invalid("a prefill task drafts no branches")
    if not task.guess_first:
        # Without assumed tokens (a target-only verify meanwhile) the other verdict is another guess.
        raise invalid("num_branches needs guess_first")
    if task.num_siblings > 0:
        raise invalid("num_branches must be 0 with num_siblings")
    if state.grammar is not None or state.penalties.active:
        raise invalid("num_branches must be 0 for a sequence with structured output or penalties")
