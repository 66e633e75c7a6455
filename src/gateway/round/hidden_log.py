"""The target's hidden states of one sequence, kept by the gateway for a drafter that reads them.

The verifier returns, with each verdict, its last hidden state at every position the
round committed (`VerifyResult.hidden_states`); the gateway keeps them in order and
sends a feature drafter those it has not sent it yet (`DraftTask.hidden_states`),
all of them again when the sequence re-joins the drafter. The bytes stay as the
verifier encoded them (specd.engine.hidden_states): the gateway never decodes them.
"""

from __future__ import annotations


class HiddenLog:
    """Rows of `row_bytes` bytes for consecutive positions from `start`."""

    def __init__(self, row_bytes: int) -> None:
        if row_bytes <= 0:
            raise ValueError("row_bytes must be positive")
        self.row_bytes = row_bytes
        self.start = 0
        self.data = bytearray()

    @property
    def end(self) -> int:
        """The position after the last row held."""
        return self.start + len(self.data) // self.row_bytes

    def add(self, start: int, data: bytes) -> None:
        """Rows from position `start`; they replace any held from there on. A gap, or rows from
        before what is held, start the log afresh: positions it cannot hold in order are
        simply missing, and the drafter drafts from less there."""
        if not data or len(data) % self.row_bytes:
            return
        if start < self.start or start > self.end:
            self.start, self.data = start, bytearray(data)
            return
        del self.data[(start - self.start) * self.row_bytes :]
        self.data += data

    def since(self, position: int) -> tuple[int, bytes]:
        """(first position, rows) of what is held from `position` on."""
        first = max(position, self.start)
        return first, bytes(self.data[(first - self.start) * self.row_bytes :])
