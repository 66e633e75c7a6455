"""The chunks of one streamed chat completion: content as it comes, or tool calls as tool_choice asks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gateway.api import tool_calls, tool_parsers
from gateway.api.replies import tool_finish
from gateway.api.tool_calls import ToolChoice
from specd.engine.params import TokenLogprob

Payload = dict[str, Any] | list[dict[str, Any]] | None


class ChatChunks:
    """Called with each piece of a choice's output, returns the chunks to send for it (None: hold it back).

    One per streamed request: it remembers, per choice, the logprobs no chunk has carried yet and the
    state of the tool calls being read out of the text."""

    def __init__(
        self,
        ident: str,
        created: int,
        model: str,
        tools: ToolChoice | None,
        tool_parser: str,
        logprobs: Callable[[list[TokenLogprob] | None], dict[str, Any] | None],
    ) -> None:
        self.ident, self.created, self.model = ident, created, model
        self.tools, self.tool_parser, self.logprobs = tools, tool_parser, logprobs
        self.unsent: dict[int, list[TokenLogprob]] = {}  # a choice's logprobs that no chunk has carried yet
        self.arrays: dict[int, tool_calls.CallArrayStream] = {}
        self.calls_begun: set[int] = set()  # choices whose call's id and name were sent
        self.streams: dict[int, tool_parsers.CallStream] = {}

    def chunk(
        self,
        index: int,
        text: str | None,
        finish: str | None,
        lps: list[TokenLogprob] | None = None,
        first: bool = False,
    ) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if first:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        return {
            "id": self.ident,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": index, "delta": delta, "logprobs": self.logprobs(lps), "finish_reason": finish}],
        }

    def role(self, index: int) -> dict[str, Any]:
        return self.chunk(index, "", None, first=True)

    def __call__(self, index: int, text: str, finish: str | None, lps: list[TokenLogprob] | None = None) -> Payload:
        tools = self.tools
        if tools is not None and tools.mode == "auto":
            return self._written_calls(index, text, finish, lps)
        if tools is None or not tools.forced:
            return self.chunk(index, text if text or finish is None else None, finish, lps)
        if not text and finish is None and not lps:
            return self.chunk(index, None, None)  # nothing to hold (the usage chunk's envelope)
        if tools.mode == "named":
            return self._named_call(index, text, finish, lps)
        return self._required_calls(index, text, finish, lps)

    def _required_calls(
        self, index: int, text: str, finish: str | None, lps: list[TokenLogprob] | None
    ) -> list[dict[str, Any]] | None:
        """Required calls as they are generated: each call's id and name once its name is
        whole, then its arguments piece by piece; the output as text if it never named one."""
        assert self.tools is not None
        stream = self.arrays.setdefault(index, tool_calls.CallArrayStream())
        kept = self.unsent.setdefault(index, [])
        kept.extend(lps or [])
        parts = []
        for piece in stream.feed(text):
            delta = self.chunk(index, None, None, kept)
            delta["choices"][0]["delta"]["tool_calls"] = [piece]
            parts.append(delta)
            kept = self.unsent[index] = []
        if finish is not None:
            if stream.index < 0:  # cut short before a call was named: what was written, as text
                parts.append(self.chunk(index, stream.text, None, kept))
                kept = []
            parts.append(self.chunk(index, None, tool_finish(self.tools, finish), kept or None))
        return parts or None

    def _named_call(
        self, index: int, text: str, finish: str | None, lps: list[TokenLogprob] | None
    ) -> list[dict[str, Any]]:
        """A named call's output is its arguments, streamed as they come, as OpenAI streams them:
        the call's id and name with the first piece, then pieces of the arguments alone."""
        assert self.tools is not None
        parts = []
        if text or index not in self.calls_begun:
            delta = self.chunk(index, None, None, lps)
            if index in self.calls_begun:
                piece: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
            else:
                piece = {"index": 0, **tool_calls.call(self.tools.name, text)}
                self.calls_begun.add(index)
            delta["choices"][0]["delta"]["tool_calls"] = [piece]
            parts.append(delta)
        if finish is not None:
            parts.append(self.chunk(index, None, finish))
        return parts

    def _written_calls(self, index: int, text: str, finish: str | None, lps: list[TokenLogprob] | None) -> Payload:
        """tool_choice "auto": content as soon as it cannot begin a call, each call when its
        block closes (its id, name and whole arguments in one delta)."""
        assert self.tools is not None
        if not text and finish is None and not lps:
            return self.chunk(index, None, None)  # nothing to hold (the usage chunk's envelope)
        stream = self.streams.get(index)
        if stream is None:
            stream = self.streams[index] = tool_parsers.call_stream(self.tool_parser, self.tools)
        kept = self.unsent.setdefault(index, [])
        kept.extend(lps or [])
        pieces = stream.feed(text) + (stream.finish() if finish is not None else [])
        parts = []
        n = stream.calls - sum(p.call is not None for p in pieces)  # the calls sent before these
        for piece in pieces:
            if piece.call is None:
                parts.append(self.chunk(index, piece.text, None, kept))
            else:
                delta = self.chunk(index, None, None, kept)
                delta["choices"][0]["delta"]["tool_calls"] = [{"index": n, **piece.call}]
                n += 1
                parts.append(delta)
            kept = self.unsent[index] = []
        if finish is not None:
            reason = "tool_calls" if stream.calls and finish == "stop" else finish
            parts.append(self.chunk(index, None, reason, kept or None))
        return parts or None
