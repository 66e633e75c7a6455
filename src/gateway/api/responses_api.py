"""OpenAI's Responses API (`POST /v1/responses`) for text, over the chat path.

A Responses request is translated into the chat request it means (instructions as a system
message, input items as messages, function calls and their outputs as an assistant's tool_calls
and tool messages, `text.format` as response_format, `max_output_tokens` as
max_completion_tokens) and goes through the chat path's validation, templating, submission and
detokenising (`OpenAIApi.chat_prompt`, `_submit`, `_collect`): speculation, exactness, tracing
and metrics are the chat path's. Only the reply's shape is the Responses API's: output items
(a message with output_text, function_call items), `usage` with input/output tokens, and,
streamed, the Responses event stream (response.created ... response.completed).

specd stores nothing: `store: true`, `previous_response_id` and `conversation` are refused with
a 400 saying to send the whole conversation as input items, as the Agents SDK does by default.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any, Literal, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from gateway.api import tool_calls, tool_parsers
from gateway.api.choices import Outcome, merged
from gateway.api.protocol import ChatCompletionRequest
from gateway.api.replies import invalid, message
from gateway.api.tool_calls import ToolChoice
from gateway.api.validation import InvalidParameter
from gateway.round.scheduler import Delta, Failed, Finished, GenerationParams, Scheduler


class ChatPath(Protocol):
    """What the Responses route uses of the chat API (gateway.api.openai_api.OpenAIApi)."""

    scheduler: Scheduler
    model_name: str
    tool_parser: str

    def _check_model(self, name: str) -> JSONResponse | None: ...

    async def chat_prompt(self, body: ChatCompletionRequest) -> tuple[list[int], GenerationParams, Any]: ...

    def _submit(self, prompt: list[int], group: list[GenerationParams], request: Request) -> Any: ...

    async def _collect(self, seqs: Any, request: Request) -> Any: ...


STORE_REASON = (
    "specd stores no responses: send the whole conversation as input items (and store false, or leave it out)"
)
# Refused unless absent, null or one of the neutral values listed; the reason is in the 400.
REFUSED: dict[str, tuple[str, tuple[Any, ...]]] = {
    "store": (STORE_REASON, (False,)),
    "previous_response_id": (STORE_REASON, ()),
    "conversation": (STORE_REASON, ()),
    "background": ("background responses are not implemented", (False,)),
    "include": ("no extra output data (logprobs, reasoning, tool sources) is implemented", ([],)),
    "truncation": ('specd never drops input: a prompt over the context window is a 400 ("disabled")', ("disabled",)),
    "reasoning": ("the served model has no reasoning mode", ({},)),
    "prompt": ("stored prompt templates are not implemented", ()),
    "max_tool_calls": ("a limit on hosted tool calls is not implemented (only function tools are)", ()),
    "top_logprobs": ("logprobs are not implemented on the Responses API (chat completions has them)", (0,)),
    "context_management": ("server-side context compaction is not implemented", ()),
}
# Accepted and ignored (README says why, as for chat).
IGNORED = (
    "metadata",
    "user",
    "safety_identifier",
    "service_tier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "prompt_cache_options",
)
TOOL_FIELDS = {"type", "name", "description", "parameters", "strict"}
# The Responses field a chat field came from, to name it in a 400.
CHAT_FIELDS = {"messages": "input", "response_format": "text.format", "max_completion_tokens": "max_output_tokens"}
TEXT_PARTS = ("input_text", "output_text")


class ResponsesRequest(BaseModel):
    # Strict and closed, as the chat request: unknown fields are a 400 naming them.
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    # Not in OpenAI's Responses API (its SDK sends it in extra_body): seeded sampling as on chat.
    seed: int | None = None
    # specd's, as on chat: draft tokens per round (0 = target-only) or "auto".
    num_speculative_tokens: int | Literal["auto"] | None = None
    pipeline: str | None = None
    speculative_siblings: int | None = None
    speculative_branches: int | None = None
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    # REFUSED unless neutral.
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    include: list[str] | None = None
    truncation: str | None = None
    reasoning: dict[str, Any] | None = None
    prompt: Any = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None
    context_management: Any = None
    # IGNORED.
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None

    def refused(self) -> InvalidParameter | None:
        for name, (reason, neutral) in REFUSED.items():
            value = getattr(self, name)
            if name == "reasoning" and isinstance(value, Mapping) and all(v is None for v in value.values()):
                continue  # {"effort": null, ...}: no reasoning asked for
            if value is not None and value not in neutral:
                return InvalidParameter(name, f"{name} is not supported: {reason}", "unsupported_parameter")
        return None

    def chat(self) -> ChatCompletionRequest:
        """The chat request this one means; raises InvalidParameter."""
        if (problem := self.refused()) is not None:
            raise problem
        if self.stream_options is not None:
            if not self.stream:
                raise InvalidParameter("stream_options", "stream_options is only allowed with stream: true")
            if set(self.stream_options) - {"include_obfuscation"}:
                raise InvalidParameter("stream_options", "stream_options may hold only include_obfuscation")
        fields: dict[str, Any] = {
            "model": self.model,
            "messages": messages(self.input, self.instructions),
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "num_speculative_tokens": self.num_speculative_tokens,
            "pipeline": self.pipeline,
            "speculative_siblings": self.speculative_siblings,
            "speculative_branches": self.speculative_branches,
            "response_format": response_format(self.text),
            "parallel_tool_calls": self.parallel_tool_calls if self.tools else None,
        }
        if self.tools:
            fields["tools"] = chat_tools(self.tools)
            fields["tool_choice"] = chat_tool_choice(self.tool_choice)
        elif self.tool_choice not in (None, "none", "auto"):
            raise InvalidParameter("tool_choice", "tool_choice needs tools to choose from")
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
        except ValidationError as exc:
            first = exc.errors()[0]
            loc = [str(p) for p in first.get("loc", ())]
            param = CHAT_FIELDS.get(loc[0], loc[0]) if loc else "input"
            raise InvalidParameter(param, f"{param}: {first.get('msg')}") from None


def messages(given: str | list[dict[str, Any]], instructions: str | None) -> list[dict[str, Any]]:
    """Chat messages for the input (a user message, or items) after the instructions."""
    out: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions is not None else []
    if isinstance(given, str):
        return [*out, {"role": "user", "content": given}]
    if not given:
        raise InvalidParameter("input", "input must hold at least one item")
    for i, item in enumerate(given):
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            out.append(_message(item, f"input[{i}]"))
        elif kind == "function_call":
            call = _function_call(item, f"input[{i}]")
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)  # the turn's calls, after its text
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append(_function_output(item, f"input[{i}]"))
        else:
            raise InvalidParameter(
                f"input[{i}]",
                f"input item type {kind!r} is not supported: specd takes messages, function_call and "
                "function_call_output items",
            )
    return out


def _only(item: Mapping[str, Any], allowed: set[str], where: str) -> None:
    if extra := sorted(set(item) - allowed):
        raise InvalidParameter(where, f"{where} has unknown fields: {extra}")


def _message(item: Mapping[str, Any], where: str) -> dict[str, Any]:
    _only(item, {"type", "role", "content", "id", "status"}, where)
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise InvalidParameter(f"{where}.role", f"{where}.role must be user, system, developer or assistant")
    return {"role": role, "content": _text(item.get("content"), f"{where}.content")}


def _text(content: Any, where: str) -> str:
    """A message's text: a string, or text parts (input_text, output_text) joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidParameter(where, f"{where} must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise InvalidParameter(
                f"{where}[{j}]",
                f"content parts of type {kind!r} are not supported: the served model reads text only "
                "(input_text and output_text parts)",
            )
        texts.append(part["text"])
    return "".join(texts)


def _function_call(item: Mapping[str, Any], where: str) -> dict[str, Any]:
    _only(item, {"type", "call_id", "name", "arguments", "id", "status"}, where)
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str):
            raise InvalidParameter(f"{where}.{key}", f"{where}.{key} must be a string")
    return {
        "id": item["call_id"],
        "type": "function",
        "function": {"name": item["name"], "arguments": item["arguments"]},
    }


def _function_output(item: Mapping[str, Any], where: str) -> dict[str, Any]:
    _only(item, {"type", "call_id", "output", "id", "status"}, where)
    if not isinstance(item.get("call_id"), str):
        raise InvalidParameter(f"{where}.call_id", f"{where}.call_id must be a string")
    return {"role": "tool", "tool_call_id": item["call_id"], "content": _text(item.get("output"), f"{where}.output")}


def chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise InvalidParameter(
                "tools", f"tools[{i}] is of type {tool.get('type')!r}: only function tools are supported"
            )
        _only(tool, TOOL_FIELDS, f"tools[{i}]")
        out.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type" and v is not None}})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if set(choice) == {"type", "name"} and choice["type"] == "function":
        return {"type": "function", "function": {"name": choice["name"]}}
    raise InvalidParameter(
        "tool_choice", 'tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}'
    )


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """text.format as chat's response_format (checked there)."""
    if text is None:
        return None
    _only(text, {"format", "verbosity"}, "text")
    if text.get("verbosity") is not None:
        raise InvalidParameter("text.verbosity", "text.verbosity is not supported: the model has no verbosity control")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, Mapping) or fmt.get("type") != "json_schema":
        return fmt  # {"type": "text"} or {"type": "json_object"}, checked as chat's
    spec = {k: v for k, v in fmt.items() if k != "type"}
    return {"type": "json_schema", "json_schema": spec}


class ResponsesApi:
    """`POST /v1/responses` over an OpenAIApi's chat path."""

    def __init__(self, api: ChatPath) -> None:
        self.api = api

    async def create(self, body: ResponsesRequest, request: Request) -> Response:
        api = self.api
        if (bad := api._check_model(body.model)) is not None:
            return bad
        try:
            chat = body.chat()
            prompt, params, _ = await api.chat_prompt(chat)
        except InvalidParameter as exc:
            return invalid(exc)
        seqs = api._submit(prompt, [params], request)
        if isinstance(seqs, JSONResponse):
            return seqs
        reply = Reply(body, chat.tool_choice_spec, api.model_name, api.tool_parser)
        if body.stream:
            return StreamingResponse(
                reply.events(merged(api.scheduler, seqs)),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        outcomes = await api._collect(seqs, request)
        if isinstance(outcomes, JSONResponse):
            return outcomes
        (outcome,) = outcomes
        return JSONResponse(reply.whole(outcome))


def _usage(finished: Finished) -> dict[str, Any]:
    prompt, completion = finished.prompt_tokens, finished.completion_tokens
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


class Reply:
    """One response's body, whole or as its event stream."""

    def __init__(self, body: ResponsesRequest, tools: ToolChoice | None, model: str, parser: str) -> None:
        self.body, self.tools, self.model, self.parser = body, tools, model, parser
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.output: list[dict[str, Any]] = []
        self.sequence = 0

    def response(self, status: str, finished: Finished | None = None, error: Any = None) -> dict[str, Any]:
        body = self.body
        incomplete = finished is not None and finished.reason == "length"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": "incomplete" if incomplete else status,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": self.model,
            "output": self.output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": None,
            "reasoning": None,
            "store": False,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "text": body.text or {"format": {"type": "text"}},
            "tool_choice": body.tool_choice or ("auto" if body.tools else "none"),
            "tools": body.tools or [],
            "truncation": "disabled",
            "usage": _usage(finished) if finished is not None else None,
            "metadata": body.metadata or {},
        }

    def whole(self, outcome: Outcome) -> dict[str, Any]:
        status = "incomplete" if outcome.finished.reason == "length" else "completed"
        chat = message(self.tools, outcome, self.parser)["message"]
        if chat.get("content") is not None or not chat.get("tool_calls"):
            self.output.append(_message_item(chat.get("content") or "", status))
        for call in chat.get("tool_calls") or []:
            self.output.append(_call_item(call["id"], call["function"]["name"], call["function"]["arguments"], status))
        return self.response("completed", outcome.finished)

    # -- the event stream ------------------------------------------------
    def event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()

    async def events(self, events: AsyncIterator[tuple[int, Any]]) -> AsyncIterator[bytes]:
        items = StreamedItems(self, self.tools, self.parser)
        try:
            yield self.event("response.created", response=self.response("in_progress"))
            yield self.event("response.in_progress", response=self.response("in_progress"))
            async for _, event in events:
                if isinstance(event, Delta):
                    for data in items.feed(event.text):
                        yield data
                elif isinstance(event, Finished):
                    status = "incomplete" if event.reason == "length" else "completed"
                    for data in items.finish(status):
                        yield data
                    done = self.response("completed", event)
                    yield self.event(f"response.{done['status']}", response=done)
                elif isinstance(event, Failed):
                    error = {"code": event.error.code or "server_error", "message": event.error.message}
                    yield self.event("response.failed", response=self.response("failed", error=error))
        finally:
            # Runs when the client disconnects too: the sequence is freed on both services.
            await events.aclose()  # type: ignore[attr-defined]


def _message_item(text: str, status: str, ident: str = "") -> dict[str, Any]:
    return {
        "type": "message",
        "id": ident or f"msg_{uuid.uuid4().hex}",
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def _call_item(call_id: str, name: str, arguments: str, status: str, ident: str = "") -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": ident or f"fc_{uuid.uuid4().hex}",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


class StreamedItems:
    """Output items as the text comes: text opens a message item, a call a function_call item;
    each item is closed (its .done events) before the next one opens."""

    def __init__(self, reply: Reply, tools: ToolChoice | None, parser: str) -> None:
        self.reply, self.tools = reply, tools
        self.item: dict[str, Any] | None = None  # the open item
        self.array = tool_calls.CallArrayStream() if tools is not None and tools.mode == "required" else None
        self.written = tool_parsers.call_stream(parser, tools) if tools is not None and tools.mode == "auto" else None

    def feed(self, text: str) -> list[bytes]:
        if not text:
            return []
        if self.tools is not None and self.tools.mode == "named":
            if self.item is None:
                return self._open_call(tool_calls.call(self.tools.name, "")["id"], self.tools.name) + self._args(text)
            return self._args(text)
        if self.array is not None:
            return self._array(self.array.feed(text))
        if self.written is not None:
            return self._written(self.written.feed(text))
        return self._text(text)

    def finish(self, status: str) -> list[bytes]:
        out: list[bytes] = []
        if self.written is not None:
            out += self._written(self.written.finish())
        if self.array is not None and self.array.index < 0 and self.array.text:
            out += self._text(self.array.text)  # cut short before a call was named: the text as it is
        if self.tools is not None and self.tools.mode == "named" and self.item is None:
            out += self._open_call(tool_calls.call(self.tools.name, "")["id"], self.tools.name)
        if not self.reply.output and self.item is None:
            out += self._text("")  # an empty reply is an empty message, as whole
        return out + self._close(status)

    def _array(self, pieces: list[dict[str, Any]]) -> list[bytes]:
        out: list[bytes] = []
        for piece in pieces:
            if "id" in piece:
                out += self._open_call(piece["id"], piece["function"]["name"])
            else:
                out += self._args(piece["function"]["arguments"])
        return out

    def _written(self, pieces: list[tool_parsers.Piece]) -> list[bytes]:
        out: list[bytes] = []
        for piece in pieces:
            if piece.call is None:
                out += self._text(piece.text)
            else:
                function = piece.call["function"]
                out += self._open_call(piece.call["id"], function["name"]) + self._args(function["arguments"])
        return out

    def _text(self, text: str) -> list[bytes]:
        reply, out = self.reply, []
        if self.item is None or self.item["type"] != "message":
            out += self._close("completed")
            self.item = _message_item("", "in_progress")
            index = len(reply.output)
            out.append(reply.event("response.output_item.added", output_index=index, item=_copy(self.item)))
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out.append(reply.event(**self._where(), kind="response.content_part.added", part=part))
        if text:
            self.item["content"][0]["text"] += text
            out.append(reply.event(**self._where(), kind="response.output_text.delta", delta=text, logprobs=[]))
        return out

    def _open_call(self, call_id: str, name: str) -> list[bytes]:
        out = self._close("completed")
        self.item = _call_item(call_id, name, "", "in_progress")
        index = len(self.reply.output)
        return [*out, self.reply.event("response.output_item.added", output_index=index, item=_copy(self.item))]

    def _args(self, text: str) -> list[bytes]:
        assert self.item is not None
        self.item["arguments"] += text
        where = {"item_id": self.item["id"], "output_index": len(self.reply.output)}
        return [self.reply.event("response.function_call_arguments.delta", **where, delta=text)]

    def _where(self) -> dict[str, Any]:
        assert self.item is not None
        return {"item_id": self.item["id"], "output_index": len(self.reply.output), "content_index": 0}

    def _close(self, status: str) -> list[bytes]:
        item, reply = self.item, self.reply
        if item is None:
            return []
        item["status"] = status
        out: list[bytes] = []
        if item["type"] == "message":
            part = item["content"][0]
            where = self._where()
            out.append(reply.event(**where, kind="response.output_text.done", text=part["text"], logprobs=[]))
            out.append(reply.event(**where, kind="response.content_part.done", part=part))
        else:
            where = {"item_id": item["id"], "output_index": len(reply.output)}
            out.append(
                reply.event(
                    "response.function_call_arguments.done", **where, name=item["name"], arguments=item["arguments"]
                )
            )
        out.append(reply.event("response.output_item.done", output_index=len(reply.output), item=item))
        reply.output.append(item)
        self.item = None
        return out


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(item))
