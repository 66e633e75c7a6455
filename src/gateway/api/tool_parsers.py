"""Tool calls written as text: the parsers behind tool_choice "auto".

With "auto" the model chooses between answering and calling, so nothing is forced by grammar:
the calls are whatever the model writes in the syntax it was trained on, and a parser reads
them out of its text, as vLLM's `--tool-call-parser` does. specd has one:

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, the syntax of
  Hermes 2 Pro and of the Qwen2.5 and Qwen3 chat templates. A block may also hold a JSON array
  of such objects, and `parameters` is taken for `arguments` (Llama-style templates write it).

Text outside the blocks is the reply's content. A block that is not such JSON, or that names
a function the request did not declare, stays in the content as written: the client sees what
the model wrote rather than a call to a tool it never offered. So does a call to a function
declared `strict: true` whose arguments do not match its `parameters` (validated, not
grammar-forced: under "auto" the model may answer in text, so nothing is constrained until a
call has begun, and vLLM's parsers constrain nothing), and so do calls beyond the first
when the request sets `parallel_tool_calls: false`. The same stream reads a whole
reply and a streamed one, so both agree.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gateway.api.tool_calls import ToolChoice, arguments_match, call

_TAGS = {"hermes": ("<tool_call>", "</tool_call>")}
PARSERS = tuple(_TAGS)


@dataclass(frozen=True)
class Piece:
    """What the stream lets out: content text, or one call (`call` set)."""

    text: str = ""
    call: dict[str, Any] | None = None


class CallStream:
    """Reads one choice's text as it is generated: content is let out as soon as it cannot be the
    start of a call block, a call as soon as its block closes."""

    def __init__(
        self,
        functions: Iterable[str],
        most: int | None = None,
        open_tag: str = "<tool_call>",
        close_tag: str = "</tool_call>",
        strict: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        self.functions = frozenset(functions)
        # The parameters schema of each function declared strict: its calls must match it.
        self.strict = dict(strict or {})
        self.most = most  # calls beyond it stay text (parallel_tool_calls: false allows one)
        self.open_tag, self.close_tag = open_tag, close_tag
        self.held = ""  # text not yet let out
        self.inside = False  # `held` is the body of an open block
        self.calls = 0  # calls let out so far
        # Whitespace is held until text follows it: what separates the model's text from a call,
        # or one call from the next, is not content.
        self.space = ""
        self.after_call = False

    def feed(self, text: str) -> list[Piece]:
        self.held += text
        out: list[Piece] = []
        while True:
            if not self.inside:
                start = self.held.find(self.open_tag)
                if start < 0:
                    cut = len(self.held) - _partial_tag(self.held, self.open_tag)
                    self._content(self.held[:cut], out)
                    self.held = self.held[cut:]
                    return out
                self._content(self.held[:start], out)
                self.held, self.inside = self.held[start + len(self.open_tag) :], True
            else:
                end = self.held.find(self.close_tag)
                if end < 0:
                    return out
                body, self.held, self.inside = self.held[:end], self.held[end + len(self.close_tag) :], False
                calls = self._calls(body)
                if calls is None or (self.most is not None and self.calls + len(calls) > self.most):
                    self._content(self.open_tag + body + self.close_tag, out)
                else:
                    out.extend(Piece(call=c) for c in calls)
                    self.calls += len(calls)
                    self.space, self.after_call = "", True

    def finish(self) -> list[Piece]:
        """What is still held when the output ends: a block cut short, or what might have begun one."""
        held = (self.open_tag if self.inside else "") + self.held
        self.held, self.inside = "", False
        out: list[Piece] = []
        self._content(held, out)
        if self.space and not self.calls:  # a reply without calls keeps its text exactly
            out.append(Piece(text=self.space))
        self.space = ""
        return out

    def _content(self, text: str, out: list[Piece]) -> None:
        if self.after_call:
            text = text.lstrip()
        body = text.rstrip()
        if not body:
            self.space += text
            return
        out.append(Piece(text=self.space + body))
        self.space, self.after_call = text[len(body) :], False

    def _calls(self, body: str) -> list[dict[str, Any]] | None:
        try:
            value = json.loads(body)
        except ValueError:
            return None
        items = value if isinstance(value, list) else [value]
        calls = []
        for item in items:
            if not isinstance(item, Mapping) or not isinstance(item.get("name"), str):
                return None
            if item["name"] not in self.functions:
                return None
            arguments = item.get("arguments", item.get("parameters", {}))
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments)
                except ValueError:
                    return None
            if not isinstance(arguments, Mapping):
                return None
            if item["name"] in self.strict and not arguments_match(self.strict[item["name"]], arguments):
                return None
            calls.append((item["name"], json.dumps(arguments, ensure_ascii=False)))
        if not calls:
            return None
        return [call(name, arguments) for name, arguments in calls]


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ParserUnusable(Exception):
    """The served tokenizer cannot carry a parser's syntax through the gateway's text."""


def check_tokenizer(parser: str, tokenizer: Any) -> None:
    """Raise ParserUnusable if the parser's tags do not survive encoding and decoding: the gateway
    decodes without special tokens, so a tag that is one would never reach the parser."""
    for tag in _TAGS[parser]:
        ids = tokenizer.encode(tag, add_special_tokens=False)
        if tokenizer.decode(ids, skip_special_tokens=True) != tag:
            raise ParserUnusable(
                f"--tool-call-parser {parser}: this tokenizer does not give back {tag!r} as text (a special token, "
                "which the gateway's decoding leaves out), so no call could be read"
            )


def call_stream(parser: str, choice: ToolChoice) -> CallStream:
    """A stream for one choice of a request with tool_choice "auto", read by `parser`."""
    if parser not in PARSERS:
        raise ValueError(f"no tool-call parser {parser!r} (there is {', '.join(PARSERS)})")
    strict = {t.name: t.parameters for t in choice.tools if t.strict}
    return CallStream((t.name for t in choice.tools), choice.most_calls, *_TAGS[parser], strict=strict)


def read_calls(parser: str, choice: ToolChoice, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole reply's content (None when only calls) and calls."""
    stream = call_stream(parser, choice)
    pieces = stream.feed(text) + stream.finish()
    content = "".join(p.text for p in pieces)
    calls = [p.call for p in pieces if p.call is not None]
    return (content or None) if calls else content, calls
