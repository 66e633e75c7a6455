"""Prompts from clients' text, made off the event loop and bounded before the work starts.

Content is text: in a chat prompt only the chat template's own markup becomes control (special)
tokens. A client's message text, names, tool calls, tool results and tool descriptions that spell
out a special token (`<|im_end|>`) get that string's ordinary text tokens, so a message cannot
close its turn and forge another. A completions (and gRPC) prompt is different: its client writes
the whole prompt, template markup included, so its special tokens are parsed, as vLLM does; an
application that puts untrusted text into such a prompt should send chat messages or token ids.

The event loop stays free: text that could never fit the context window (more bytes than
`max_context` tokens of the tokenizer's longest token) is refused before tokenising, and
template rendering and tokenising run on one worker thread, not on the loop.
"""

from __future__ import annotations

import asyncio
import functools
import re
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from gateway.api.validation import InvalidParameter, encode_prompt

T = TypeVar("T")
# Private-use characters mark where a client's special-token text stood while the template renders.
_OPEN, _CLOSE = "\ue000", "\ue001"
_MARK = re.compile(f"{_OPEN}(\\d+){_CLOSE}")
# One thread: the tokenizer is shared, and prompts are bounded before they reach it.
_WORKER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specd-prompts")


async def off_loop(work: Callable[..., T], *args: Any) -> T:
    """Run `work(*args)` on the prompt worker: tokenising a long text must not stall other requests."""
    return await asyncio.get_running_loop().run_in_executor(_WORKER, work, *args)


def strings(value: Any) -> Iterable[str]:
    """Every string inside a JSON-like value (keys included)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from strings(k)
            yield from strings(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from strings(v)


def size_problem(param: str, texts: Iterable[str], limit: int, max_context: int) -> InvalidParameter | None:
    """The refusal for texts of more than `limit` bytes (max_context tokens of the longest token)."""
    size = 0
    for text in texts:
        size += len(text.encode("utf-8", "surrogatepass"))
        if size > limit:
            return InvalidParameter(
                param,
                f"{param} is longer than this model's context window of {max_context} tokens could hold "
                f"(over {limit} bytes)",
                "context_length_exceeded",
            )
    return None


@functools.lru_cache(maxsize=4)
def prompts_for(tokenizer: Any, max_context: int) -> Prompts:
    """One Prompts per tokenizer and context window."""
    return Prompts(tokenizer, max_context)


@functools.lru_cache(maxsize=4)
def vocabulary_facts(tokenizer: Any) -> tuple[int, dict[str, list[int]]]:
    """What Prompts needs of a tokenizer's whole vocabulary, one pass per tokenizer: the most bytes
    one token covers, and each special token's text as ordinary tokens. The gateway computes them
    while it waits for its backends, so they do not delay its start once they answer."""
    vocab = tokenizer.get_vocab()
    max_token_bytes = max(len(tokenizer.decode([i]).encode()) for i in vocab.values()) or 1
    specials = {a.content for a in tokenizer.added_tokens_decoder.values() if a.special}
    specials |= set(tokenizer.all_special_tokens)
    as_text = {
        s: list(tokenizer.encode(s, add_special_tokens=False, split_special_tokens=True))
        for s in (*specials, _OPEN, _CLOSE)
    }
    return max_token_bytes, as_text


class Prompts:
    """A tokenizer's prompt making: bounds computed once, chat templating with content kept as text."""

    def __init__(self, tokenizer: Any, max_context: int) -> None:
        self.tokenizer = tokenizer
        self.max_context = max_context
        # No token covers more bytes than max_token_bytes: a text of more than max_context times it
        # cannot fit. Each special token's text as ordinary tokens is encoded once: at request time
        # no tokenizer setting changes, so encodes on the worker never race decodes on the loop.
        self.max_token_bytes, as_text = vocabulary_facts(tokenizer)
        self._as_text = dict(as_text)
        alternatives = sorted(self._as_text, key=len, reverse=True)
        self._special = re.compile("|".join(re.escape(s) for s in alternatives))

    @property
    def text_limit(self) -> tuple[int, int]:
        """(bytes, max_context): no text of more bytes than max_context tokens of the longest token fits."""
        return self.max_context * self.max_token_bytes, self.max_context

    def check_size(self, param: str, texts: Iterable[str]) -> None:
        """Refuse, before any tokenising, text too long for the context window whatever its tokens."""
        problem = size_problem(param, texts, *self.text_limit)
        if problem is not None:
            raise problem

    def text_ids(self, text: str, param: str = "prompt") -> list[int]:
        """A completions or gRPC prompt's ids (special tokens parsed: see the module's docstring)."""
        self.check_size(param, (text,))
        return encode_prompt(self.tokenizer, text, param)

    def chat_ids(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        options: dict[str, Any] | None = None,
    ) -> list[int]:
        """The chat template applied to `messages` (with `options`: add_generation_prompt,
        continue_final_message, chat_template_kwargs); only the template's markup becomes special tokens."""
        if len(messages) > self.max_context:  # every message costs a token at least
            raise InvalidParameter(
                "messages", f"{len(messages)} messages cannot fit a context window of {self.max_context} tokens"
            )
        self.check_size("messages", strings([messages, tools]))
        hidden: list[str] = []

        def hide(match: re.Match[str]) -> str:
            hidden.append(match.group())
            return f"{_OPEN}{len(hidden) - 1}{_CLOSE}"

        def masked(value: Any) -> Any:
            if isinstance(value, str):
                return self._special.sub(hide, value)
            if isinstance(value, dict):
                return {k: v if k == "role" else masked(v) for k, v in value.items()}
            if isinstance(value, list):
                return [masked(v) for v in value]
            return value

        try:
            rendered = self.tokenizer.apply_chat_template(
                masked(messages), tools=masked(tools), tokenize=False, **(options or {"add_generation_prompt": True})
            )
        except Exception as exc:  # a template may reject some role orders
            raise InvalidParameter("messages", f"cannot apply the chat template: {exc}") from None
        pieces = _MARK.split(rendered)
        marks, template = pieces[1::2], pieces[0::2]
        if any(int(m) >= len(hidden) for m in marks) or any(_OPEN in p or _CLOSE in p for p in template):
            # The template escaped or cut a mark: the text it stood for cannot be placed as text.
            raise InvalidParameter(
                "messages",
                "the messages spell out the tokenizer's control tokens where this chat template cannot "
                "carry them as text",
            )
        ids: list[int] = []
        for i, piece in enumerate(pieces):
            if i % 2:
                ids += self._as_text[hidden[int(piece)]]
            elif piece:
                # The template already wrote the special tokens.
                ids += encode_prompt(self.tokenizer, piece, "messages", add_special_tokens=False)
        return ids
