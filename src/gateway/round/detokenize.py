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
        # Per stop string: its prefix function, and how much of it the text's tail matches now
        # (Knuth-Morris-Pratt), so the hold-back costs the new characters only, not the text again.
        self._failure = [_prefix_function(s) for s in self.stop]
        self._matched = [0] * len(self.stop)

    def add(self, token_id: int) -> None:
        """Append one token; sets `stopped` when a stop string completes."""
        self.ids.append(token_id)
        skip = self.skip_special_tokens
        prefix = self.tokenizer.decode(self.ids[self._prefix_offset : self._read_offset], skip_special_tokens=skip)
        full = self.tokenizer.decode(self.ids[self._prefix_offset :], skip_special_tokens=skip)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return  # an incomplete character: wait for the next token
        before = len(self.text)
        piece = full[len(prefix) :]
        self.text += piece
        for i, (stop, failure) in enumerate(zip(self.stop, self._failure, strict=True)):
            self._matched[i] = _advance(stop, failure, self._matched[i], piece)
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
        return max((m for m, s in zip(self._matched, self.stop, strict=True) if m < len(s)), default=0)


def _prefix_function(s: str) -> list[int]:
    """failure[i]: length of the longest proper prefix of s[: i + 1] that is also its suffix."""
    failure = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = failure[k - 1]
        if s[i] == s[k]:
            k += 1
        failure[i] = k
    return failure


def _advance(stop: str, failure: list[int], matched: int, text: str) -> int:
    """How much of `stop` the tail matches after `text` follows a tail that matched `matched`."""
    for ch in text:
        if matched == len(stop):
            matched = failure[matched - 1]
        while matched and stop[matched] != ch:
            matched = failure[matched - 1]
        if stop[matched] == ch:
            matched += 1
    return matched
