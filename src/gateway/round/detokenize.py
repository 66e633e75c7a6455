"""Incremental detokenization with stop strings, for streaming text safely.

Decoding a growing token list piece by piece would split multi-byte characters
and re-decode the whole output every token; this follows the usual
prefix/read-offset scheme (as TGI and vLLM do) and holds back any tail that could
still become a stop string, so a stop string is never streamed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class TextStream:
    def __init__(
        self, tokenizer: Any, stop: Sequence[str], skip_special_tokens: bool = True, include_stop: bool = False
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        # vLLM's skip_special_tokens and include_stop_str_in_output.
        self.skip_special_tokens = skip_special_tokens
        self.include_stop = include_stop
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0
        self.stopped = False
        self._prefix_offset = 0
        self._read_offset = 0

    def add(self, token_id: int) -> None:
        """Append one token; sets `stopped` when a stop string completes."""
        self.ids.append(token_id)
        skip = self.skip_special_tokens
        prefix = self.tokenizer.decode(self.ids[self._prefix_offset : self._read_offset], skip_special_tokens=skip)
        full = self.tokenizer.decode(self.ids[self._prefix_offset :], skip_special_tokens=skip)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return  # an incomplete character: wait for the next token
        before = len(self.text)
        self.text += full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        if self.stop:
            longest = max(len(s) for s in self.stop)
            start = max(0, before - longest + 1)
            hits = [(i, -len(s)) for s in self.stop if (i := self.text.find(s, start)) >= 0]
            if hits:
                at, minus_length = min(hits)  # the first stop string, the longest of those starting there
                self.text = self.text[: at - minus_length if self.include_stop else at]
                self.stopped = True

    def take(self, final: bool = False) -> str:
        """Text that is safe to send now (all of it when `final`)."""
        end = len(self.text)
        if not final and not self.stopped:
            end -= self._held_back()
        piece = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        return piece

    def _held_back(self) -> int:
        """Length of the longest text suffix that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best
