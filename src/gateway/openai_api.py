"""OpenAI-compatible HTTP API over the scheduler (FastAPI)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway import prompt_text
from gateway.limits import RateLimiter, api_key
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.scheduler import Delta, Failed, Finished, GenerationError, GenerationParams, Scheduler, _Sequence

ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 429: "rate_limit_error"}


def error_response(status: int, message: str, code: str | None = None, param: str | None = None) -> JSONResponse:
    body = {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }
    headers = {"Retry-After": "1"} if status in (429, 503) else None
    return JSONResponse(body, status_code=status, headers=headers)


class OpenAIApi:
    """Routes and handlers; `health` reports backend readiness."""

    def __init__(
        self, scheduler: Scheduler, tokenizer: Any, model_name: str, health: Any, limiter: RateLimiter | None = None
    ) -> None:
        self.scheduler = scheduler
        self.limiter = limiter or RateLimiter(0)
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.health = health
        self.created = int(time.time())

    def app(self) -> FastAPI:
        app = FastAPI(title="specd gateway", version="0.1.0")
        app.add_exception_handler(RequestValidationError, self._invalid)
        app.add_exception_handler(StarletteHTTPException, self._http_error)
        if self.limiter.enabled:
            app.middleware("http")(self._rate_limit)
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        app.add_api_route("/health", self.health_check, methods=["GET"])
        app.add_api_route("/metrics", self.metrics, methods=["GET"])
        return app

    # -- errors ----------------------------------------------------------
    async def _invalid(self, request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":
            return error_response(400, "the request body is not valid JSON", "invalid_json")
        message = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}" for e in errors
        )
        return error_response(400, message, "invalid_value", ".".join(loc) or None)

    async def _http_error(self, request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    async def _rate_limit(self, request: Request, call_next: Any) -> Response:
        limited = request.method == "POST" and request.url.path.startswith("/v1/")
        if limited and not await self.limiter.allow(api_key(request.headers.get("authorization"))):
            return error_response(
                429, f"rate limit of {self.limiter.rate:g} requests/s for this API key", "rate_limit_exceeded"
            )
        return await call_next(request)

    # -- routes ----------------------------------------------------------
    async def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": self.model_name, "object": "model", "created": self.created, "owned_by": "specd"}],
        }

    async def metrics(self) -> Response:
        return Response(self.scheduler.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def health_check(self) -> Response:
        status = await self.health()
        return JSONResponse(status, status_code=200 if status.get("status") == "ok" else 503)

    def _check_model(self, name: str) -> JSONResponse | None:
        if name != self.model_name:
            return error_response(
                404,
                f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                "model_not_found",
                "model",
            )
        return None

    def _submit(self, prompt: list[int], params: GenerationParams, request: Request) -> _Sequence | JSONResponse:
        # A client's own W3C trace context makes the request span a child of its span.
        carrier = {k: v for k in ("traceparent", "tracestate") if (v := request.headers.get(k))}
        try:
            return self.scheduler.submit(prompt, params, carrier)
        except GenerationError as exc:
            return error_response(exc.status, exc.message, exc.code)

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        if (bad := self._check_model(body.model)) is not None:
            return bad
        if isinstance(body.prompt, str) or (body.prompt and isinstance(body.prompt[0], str)):
            text = body.prompt if isinstance(body.prompt, str) else body.prompt[0]
            try:
                prompt = prompt_text.encode(self.tokenizer, text, "prompt")
            except prompt_text.UnencodableText as exc:
                return error_response(400, exc.message, "invalid_value", exc.param)
        else:
            prompt = list(body.prompt)  # token ids
            vocab = len(self.tokenizer)
            if any(not 0 <= t < vocab for t in prompt):
                return error_response(400, f"prompt token ids must be in [0, {vocab})", "invalid_value", "prompt")
        seq = self._submit(prompt, body.generation_params(), request)
        if isinstance(seq, JSONResponse):
            return seq
        ident, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        echo = body.prompt if (body.echo and isinstance(body.prompt, str)) else ""

        def chunk(text: str, finish: str | None) -> dict[str, Any]:
            return {
                "id": ident,
                "object": "text_completion",
                "created": created,
                "model": self.model_name,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
            }

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return self._sse(seq, request, chunk, lambda: chunk(echo, None) if echo else None, include_usage, ident)
        result = await self._collect(seq, request)
        if isinstance(result, JSONResponse):
            return result
        text, finished = result
        body_out = chunk(echo + text, finished.reason)
        body_out["usage"] = usage(finished)
        return JSONResponse(body_out)

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        if (bad := self._check_model(body.model)) is not None:
            return bad
        messages = [{"role": m.role if m.role != "developer" else "system", "content": m.text()} for m in body.messages]
        try:
            rendered = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # a template may reject some role orders
            return error_response(400, f"cannot apply the chat template: {exc}", "invalid_value", "messages")
        try:
            # The template already wrote the special tokens.
            prompt = prompt_text.encode(self.tokenizer, rendered, "messages", add_special_tokens=False)
        except prompt_text.UnencodableText as exc:
            return error_response(400, exc.message, "invalid_value", exc.param)
        seq = self._submit(prompt, body.generation_params(), request)
        if isinstance(seq, JSONResponse):
            return seq
        ident, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(text: str | None, finish: str | None, first: bool = False) -> dict[str, Any]:
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            return {
                "id": ident,
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.model_name,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
            }

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            def stream_chunk(text: str, finish: str | None) -> dict[str, Any]:
                return chunk(text if text or finish is None else None, finish)

            return self._sse(seq, request, stream_chunk, lambda: chunk("", None, first=True), include_usage, ident)
        result = await self._collect(seq, request)
        if isinstance(result, JSONResponse):
            return result
        text, finished = result
        return JSONResponse(
            {
                "id": ident,
                "object": "chat.completion",
                "created": created,
                "model": self.model_name,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "logprobs": None,
                        "finish_reason": finished.reason,
                    }
                ],
                "usage": usage(finished),
            }
        )

    # -- plumbing --------------------------------------------------------
    async def _collect(self, seq: _Sequence, request: Request) -> tuple[str, Finished] | JSONResponse:
        """Gather a whole completion, cancelling it if the client disconnects."""
        parts: list[str] = []
        events = self.scheduler.events(seq)
        watcher = asyncio.create_task(_watch_disconnect(request))
        try:
            async for event in events:
                if isinstance(event, Delta):
                    parts.append(event.text)
                elif isinstance(event, Finished):
                    return "".join(parts), event
                elif isinstance(event, Failed):
                    return error_response(event.error.status, event.error.message, event.error.code)
                if watcher.done():
                    break
            return error_response(499, "client closed the request")
        finally:
            watcher.cancel()
            await events.aclose()

    def _sse(self, seq, request, chunk, first_chunk, include_usage: bool, ident: str) -> StreamingResponse:
        async def body() -> AsyncIterator[bytes]:
            events = self.scheduler.events(seq)
            try:
                first = first_chunk()
                if first is not None:
                    yield sse(first)
                async for event in events:
                    if isinstance(event, Delta):
                        if event.text:
                            yield sse(chunk(event.text, None))
                    elif isinstance(event, Finished):
                        yield sse(chunk("", event.reason))
                        if include_usage:
                            last = chunk("", None)
                            last["choices"] = []
                            last["usage"] = usage(event)
                            yield sse(last)
                    elif isinstance(event, Failed):
                        err = event.error
                        yield sse({"error": {"message": err.message, "type": "server_error", "code": err.code}})
                yield b"data: [DONE]\n\n"
            finally:
                # Runs when the client disconnects too: the sequence is freed on both services.
                await events.aclose()

        return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _watch_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.5)


def sse(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()


def usage(finished: Finished) -> dict[str, int]:
    return {
        "prompt_tokens": finished.prompt_tokens,
        "completion_tokens": finished.completion_tokens,
        "total_tokens": finished.prompt_tokens + finished.completion_tokens,
    }
