"""Replies both HTTP APIs share: OpenAI's error body, and a choice's message with its tool calls."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from gateway.api import tool_parsers
from gateway.api.choices import Outcome
from gateway.api.tool_calls import ToolChoice
from gateway.api.validation import InvalidParameter
from gateway.failures import failure_kind


def error_response(status: int, message: str, code: str | None = None, param: str | None = None) -> JSONResponse:
    kind = failure_kind(status)
    body = {"error": {"message": message, "type": kind.openai_type, "param": param, "code": code}}
    headers = {"Retry-After": "1"} if kind.retry else None
    return JSONResponse(body, status_code=status, headers=headers)


def tool_finish(tools: ToolChoice, reason: str) -> str:
    """OpenAI's finish_reason for whole forced calls: "tool_calls" when the model was made to call
    (required), "stop" for a named function, as OpenAI answers one."""
    return "tool_calls" if tools.mode == "required" and reason == "stop" else reason


def message(tools: ToolChoice | None, outcome: Outcome, parser: str) -> dict[str, Any]:
    """A choice's message and finish_reason: forced calls as tool_calls, text otherwise; a named call
    cut short keeps its partial arguments (as OpenAI's do), required calls cut short are text; with
    "auto", the calls the parser reads in the text and the text around them."""
    if tools is not None and tools.mode == "auto":
        content, calls = tool_parsers.read_calls(parser, tools, outcome.text)
        if calls:
            reason = "tool_calls" if outcome.finished.reason == "stop" else outcome.finished.reason
            return {"message": {"role": "assistant", "content": content, "tool_calls": calls}, "finish_reason": reason}
    if tools is not None and tools.forced and (calls := tools.calls(outcome.text)) is not None:
        return {
            "message": {"role": "assistant", "content": None, "tool_calls": calls},
            "finish_reason": tool_finish(tools, outcome.finished.reason),
        }
    return {"message": {"role": "assistant", "content": outcome.text}, "finish_reason": outcome.finished.reason}


def invalid(exc: InvalidParameter) -> JSONResponse:
    return error_response(exc.status, exc.message, exc.code, exc.param)
