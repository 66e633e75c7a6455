"""The n-gram drafter (no gRPC, no torch here): prompt lookup, model-free."""

from __future__ import annotations

from collections.abc import Sequence

from drafter_service.base import DrafterBase
from specd.engine import ngram
from specd.engine.sequences import SequenceTable
from specd.engine.tasks import DraftProposal, DraftTask, RoundTiming


class NgramDrafter(DrafterBase):
    """Prompt lookup: proposes what followed the latest earlier match of the suffix.

    Deterministic, so every proposed token has probability 1 under the proposer
    and no distributions go on the wire.
    """

    kind = "ngram"

    def __init__(
        self, vocab_size: int, max_sequences: int, max_context: int, max_draft_tokens: int, min_n: int, max_n: int
    ) -> None:
        table = SequenceTable(None, vocab_size, max_sequences, max_context, None)
        super().__init__(table, None, max_draft_tokens)
        self.min_n, self.max_n = min_n, max_n

    def draft(self, tasks: Sequence[DraftTask]) -> tuple[list[DraftProposal], RoundTiming]:
        proposals, live = self._accept_tasks(tasks)
        for i, _, k, context in live:
            proposals[i].tokens = ngram.propose(context, k, self.min_n, self.max_n)
        return proposals, RoundTiming(batch_size=len(live))
