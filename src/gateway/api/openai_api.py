"""OpenAI-compatible HTTP API over the scheduler (FastAPI)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.api import chat_templates
from gateway.api.chat_stream import ChatChunks
from gateway.api.choices import Choices, Gathered, Outcome, best, choice_params, merged, request_usage
from gateway.api.grammar_check import check_constraint
from gateway.api.limits import RateLimiter, api_key, tenant
from gateway.api.logprob_format import TokenTexts, chat_content, completion_logprobs
from gateway.api.prompts import Prompts, off_loop, prompts_for
from gateway.api.protocol import ChatCompletionRequest, CompletionRequest, _Request
from gateway.api.replies import error_response, invalid, message
from gateway.api.responses_api import ResponsesApi
from gateway.api.spec_metrics import speculative_decoding
from gateway.api.validation import InvalidParameter, choices, generation_params, validation_refusal
from gateway.failures import GenerationError
from gateway.round.scheduler import Delta, Failed, Finished, GenerationParams, Scheduler, _Sequence
from specd.engine.params import TokenLogprob


class OpenAIApi:
    """Routes and handlers; `health` reports backend readiness."""

    def __init__(
        self,
        scheduler: Scheduler,
        tokenizer: Any,
        model_name: str,
        health: Any,
        limiter: RateLimiter | None = None,
        max_n: int = 8,
        tool_parser: str = "",
        undeclared_keys: bool = False,
        chat_template: str = "",
        spec_metrics: str = "off",
    ) -> None:
        self.scheduler = scheduler
        # --per-request-spec-decode-metrics: "off", "summary" or "detailed" (gateway.api.spec_metrics).
        self.spec_metrics = spec_metrics
        # Why tool_choice "auto" cannot work with the served chat template ("" when it can), and
        # the template's name for that 400 (--chat-template's file, or the tokenizer's).
        self.template_tools_problem = chat_templates.tools_problem(tokenizer)
        source = getattr(tokenizer, "name_or_path", "") or model_name
        self.template_name = f"the chat template {chat_template}" if chat_template else f"{source}'s chat template"
        # --json-undeclared-keys (gateway.api.validation.RequestedParams.undeclared_keys).
        self.undeclared_keys = undeclared_keys
        # Reads the calls of tool_choice "auto" out of the model's text; "" refuses "auto".
        self.tool_parser = tool_parser
        # The most choices (n, best_of) one request may ask for: each is a sequence of its own.
        self.max_n = max_n
        self.limiter = limiter or RateLimiter(0)
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.health = health
        self.created = int(time.time())
        self.texts = TokenTexts(tokenizer)
        self.routes: list[str] = []  # "METHOD /path" of every route served, for the 404 of any other
        self.keyed = False  # whether clients are told apart by API key (else by address): gateway.round.shares
        # How the backends' weights were made where they are no checkpoint's (gateway.server.made_weights).
        self.weights = ""
        # The target's int8 activations ("int8"), where its outputs are not its dtype's own products.
        self.activations = ""

    @property
    def prompts(self) -> Prompts:
        return prompts_for(self.tokenizer, self.scheduler.max_context)

    def app(self) -> FastAPI:
        app = FastAPI(title="specd gateway", version="0.1.0")
        app.add_exception_handler(RequestValidationError, self._invalid)
        app.add_exception_handler(StarletteHTTPException, self._http_error)
        if self.limiter.enabled:
            app.middleware("http")(self._rate_limit)
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        # A served name may hold "/" (one derived from a Hugging Face id).
        app.add_api_route("/v1/models/{model_id:path}", self.model, methods=["GET"])
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        app.add_api_route("/v1/responses", ResponsesApi(self).create, methods=["POST"])
        app.add_api_route("/health", self.health_check, methods=["GET"])
        app.add_api_route("/metrics", self.metrics, methods=["GET"])
        self.routes = [
            f"{method} {r.path}" for r in app.routes if isinstance(r, APIRoute) for method in sorted(r.methods)
        ]
        return app

    # -- errors ----------------------------------------------------------
    async def _invalid(self, request: Request, exc: RequestValidationError) -> JSONResponse:
        message, code, param = validation_refusal(exc.errors())
        return error_response(400, message, code, param)

    async def _http_error(self, request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code in (404, 405) and exc.detail in ("Not Found", "Method Not Allowed"):
            # A wrong base URL or an API specd lacks: say which, rather than a bare "Not Found".
            what = "no route" if exc.status_code == 404 else "the method is not allowed on"
            return error_response(
                exc.status_code,
                f"{what} {request.method} {request.url.path}: this server serves {', '.join(self.routes)}",
                "unknown_route",
            )
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
        return {"object": "list", "data": [self._model_card()]}

    async def model(self, model_id: str) -> Response:
        """OpenAI's models.retrieve."""
        if (bad := self._check_model(model_id)) is not None:
            return bad
        return JSONResponse(self._model_card())

    def _model_card(self) -> dict[str, Any]:
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "specd"}
        if self.weights:
            card["weights"] = self.weights  # made, not loaded: the text is meaningless
        if self.activations:
            card["activations"] = self.activations
        return card

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

    def _submit(
        self, prompt: list[int], group: list[GenerationParams], request: Request
    ) -> list[_Sequence] | JSONResponse:
        # A client's own W3C trace context makes the request span a child of its span.
        carrier = {k: v for k in ("traceparent", "tracestate") if (v := request.headers.get(k))}
        address = request.client.host if request.client else ""
        key = api_key(request.headers.get("authorization"))
        client = key if self.keyed else address
        try:
            return self.scheduler.submit_group(prompt, group, carrier, client, tenant(key) if self.keyed else "")
        except GenerationError as exc:
            # The scheduler's refusals of a parameter (one the gateway's flags decide) name it.
            return error_response(exc.status, exc.message, exc.code, getattr(exc, "param", None))

    def _params(self, body: _Request) -> tuple[GenerationParams, Choices]:
        """The body's generation parameters and choices; raises InvalidParameter for anything refused."""
        refused = body.refused()
        if refused is not None:
            raise refused
        if body.stream_options is not None and not body.stream:
            raise InvalidParameter("stream_options", "stream_options is only allowed when stream is true")
        raw = dataclasses.replace(body.requested(), undeclared_keys=self.undeclared_keys)
        params = generation_params(raw, len(self.tokenizer))
        check_constraint(self.tokenizer, params, raw)
        return params, choices(raw, self.max_n, bool(body.stream))

    def _completion_prompt(self, body: CompletionRequest) -> list[int]:
        if (problem := body.prompt_problem()) is not None:
            raise problem
        if isinstance(body.prompt, str):
            return self.prompts.text_ids(body.prompt)
        if isinstance(body.prompt[0], str):
            return self.prompts.text_ids(body.prompt[0])
        prompt = [t for t in body.prompt if isinstance(t, int)]  # token ids
        vocab = len(self.tokenizer)
        if any(not 0 <= t < vocab for t in prompt):
            raise InvalidParameter("prompt", f"prompt token ids must be in [0, {vocab})")
        return prompt

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        if (bad := self._check_model(body.model)) is not None:
            return bad
        try:
            prompt = await off_loop(self._completion_prompt, body)
            params, wanted = await off_loop(self._params, body)
        except InvalidParameter as exc:
            return invalid(exc)
        seqs = self._submit(prompt, choice_params(params, wanted), request)
        if isinstance(seqs, JSONResponse):
            return seqs
        ident, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        echo = ""
        if body.echo:
            echo = body.prompt if isinstance(body.prompt, str) else self.tokenizer.decode(prompt)
        # Characters of each choice's text so far, for logprobs' text_offset.
        offsets = [0] * len(seqs)

        def chunk(index: int, text: str, finish: str | None, lps: list[TokenLogprob] | None = None) -> dict[str, Any]:
            logprobs = None
            if params.logprobs is not None:
                logprobs = completion_logprobs(lps or [], self.texts, offsets[index])
            offsets[index] += len(text)
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
            return {
                "id": ident,
                "object": "text_completion",
                "created": created,
                "model": self.model_name,
                "choices": [choice],
            }

        def echoed(index: int) -> dict[str, Any]:
            """The prompt as the choice's first text, with its logprobs when asked for."""
            out = chunk(index, echo, None)
            if params.logprobs is not None and params.logprobs.prompt:
                # Choice 0 asked the verifier for them; the prompt is every choice's.
                out["choices"][0]["logprobs"] = completion_logprobs(
                    seqs[0].prompt_logprobs, self.texts, 0, unscored_first=prompt[0]
                )
            return out

        if body.stream:
            return self._sse(seqs, request, chunk, echoed if echo else None, body.include_usage)
        outcomes = await self._collect(seqs, request)
        if isinstance(outcomes, JSONResponse):
            return outcomes
        out: list[dict[str, Any]] = []
        for index, outcome in enumerate(best(outcomes, wanted)):
            offsets[index] = 0
            head = echoed(index)["choices"][0] if echo else None
            choice = chunk(index, outcome.text, outcome.finished.reason, outcome.logprobs)["choices"][0]
            if head is not None:
                choice["text"] = head["text"] + outcome.text
                if choice["logprobs"] is not None:
                    choice["logprobs"] = {k: head["logprobs"][k] + v for k, v in choice["logprobs"].items()}
            out.append(choice)
        return JSONResponse(
            {
                "id": ident,
                "object": "text_completion",
                "created": created,
                "model": self.model_name,
                "choices": out,
                "usage": usage(outcomes),
                **self._metrics(outcomes),
            }
        )

    async def chat_prompt(self, body: ChatCompletionRequest) -> tuple[list[int], GenerationParams, Choices]:
        """A chat request's prompt tokens, parameters and choices (its tools: body.tool_choice_spec),
        checked, made off the event loop; raises InvalidParameter. The Responses API
        (gateway.api.responses_api) goes this way too."""
        if (problem := body.messages_problem()) is not None:
            raise problem
        params, wanted = await off_loop(self._params, body)
        tools = body.tool_choice_spec  # checked with the other parameters above
        if tools is not None and tools.mode == "auto" and self.template_tools_problem:
            raise InvalidParameter(
                "tool_choice",
                f'tool_choice "auto" (the default when tools are given) leaves the call to the model, and '
                f"{self.template_name} cannot show it its tools: {self.template_tools_problem}. Send tool_choice "
                '"required" or {"type": "function", "function": {"name": ...}}, whose calls are forced by grammar, '
                'or "none"; or start the gateway with --chat-template, a template that renders tools',
            )
        if tools is not None and tools.mode == "auto" and not self.tool_parser:
            raise InvalidParameter(
                "tool_choice",
                'tool_choice "auto" (the default when tools are given) reads calls out of the text the '
                "model writes, and this gateway was started without --tool-call-parser (hermes: "
                '<tool_call> blocks, as Qwen2.5, Qwen3 and Hermes 2 Pro write them): send tool_choice "required" '
                'or {"type": "function", "function": {"name": ...}}, whose calls are forced by grammar, or "none"',
            )
        messages = [m.for_template() for m in body.messages]
        options = body.template_options()
        prompt = await off_loop(self.prompts.chat_ids, messages, body.template_tools(), options)
        return prompt, params, wanted

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        if (bad := self._check_model(body.model)) is not None:
            return bad
        try:
            prompt, params, wanted = await self.chat_prompt(body)
        except InvalidParameter as exc:
            return invalid(exc)
        tools = body.tool_choice_spec
        seqs = self._submit(prompt, choice_params(params, wanted), request)
        if isinstance(seqs, JSONResponse):
            return seqs
        ident, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def logprobs(lps: list[TokenLogprob] | None) -> dict[str, Any] | None:
            if params.logprobs is None:
                return None
            return {"content": chat_content(lps or [], self.texts), "refusal": None}

        if body.stream:
            chunks = ChatChunks(ident, created, self.model_name, tools, self.tool_parser, logprobs)
            return self._sse(seqs, request, chunks, chunks.role, body.include_usage)
        outcomes = await self._collect(seqs, request)
        if isinstance(outcomes, JSONResponse):
            return outcomes
        return JSONResponse(
            {
                "id": ident,
                "object": "chat.completion",
                "created": created,
                "model": self.model_name,
                "choices": [
                    {
                        "index": index,
                        **message(tools, outcome, self.tool_parser),
                        "logprobs": logprobs(outcome.logprobs),
                    }
                    for index, outcome in enumerate(best(outcomes, wanted))
                ],
                "usage": usage(outcomes),
                **self._metrics(outcomes),
            }
        )

    def _metrics(self, finished: Sequence[Finished | Outcome]) -> dict[str, Any]:
        """The response's `metrics` member when per-request speculation statistics are on, else nothing."""
        if self.spec_metrics == "off":
            return {}
        steps = [(f.finished if isinstance(f, Outcome) else f).spec_steps for f in finished]
        k = self.scheduler.k_limit
        return {"metrics": {"speculative_decoding": speculative_decoding(steps, k, self.spec_metrics)}}

    # -- plumbing --------------------------------------------------------
    async def _collect(self, seqs: list[_Sequence], request: Request) -> list[Outcome] | JSONResponse:
        """Gather every sequence's whole output, cancelling them all if the client disconnects
        or one of them fails."""
        gathered = Gathered(len(seqs))
        events = merged(self.scheduler, seqs)
        watcher = asyncio.create_task(_watch_disconnect(request))
        try:
            async for i, event in events:
                if isinstance(event, Failed):
                    return error_response(event.error.status, event.error.message, event.error.code)
                gathered.add(i, event)
                if gathered.complete:
                    return gathered.outcomes()
                if watcher.done():
                    break
            return error_response(499, "client closed the request")
        finally:
            watcher.cancel()
            await events.aclose()

    def _sse(
        self,
        seqs: list[_Sequence],
        request: Request,
        chunk: Callable[..., dict[str, Any] | list[dict[str, Any]] | None],
        first_chunk: Callable[[int], dict[str, Any]] | None,
        include_usage: bool,
    ) -> StreamingResponse:
        """Every choice's chunks as they come, interleaved, each tagged with its index."""

        def sent(payload: dict[str, Any] | list[dict[str, Any]] | None) -> bytes:
            """A chunk callable may hold a choice's text back (None) or send several chunks at once."""
            if payload is None:
                return b""
            return b"".join(sse(p) for p in (payload if isinstance(payload, list) else [payload]))

        async def body() -> AsyncIterator[bytes]:
            events = merged(self.scheduler, seqs)
            pending_first = [first_chunk is not None] * len(seqs)
            done: dict[int, Finished] = {}
            try:
                async for i, event in events:
                    if pending_first[i] and first_chunk is not None:
                        # Sent with the choice's first event: by then the verifier has opened
                        # the sequence, and an echo's prompt logprobs are in.
                        yield sse(first_chunk(i))
                        pending_first[i] = False
                    if isinstance(event, Delta):
                        # Tokens whose text is held back (a partial character, a possible
                        # stop string) still bring their logprobs.
                        if (event.text or event.logprobs) and (
                            data := sent(chunk(i, event.text, None, event.logprobs))
                        ):
                            yield data
                    elif isinstance(event, Finished):
                        done[i] = event
                        yield sent(chunk(i, "", event.reason))
                        metrics = self._metrics(list(done.values())) if len(done) == len(seqs) else {}
                        if len(done) == len(seqs) and (include_usage or metrics):
                            last = chunk(0, "", None)
                            assert isinstance(last, dict)  # an empty delta is never held back
                            last["choices"] = []
                            if include_usage:
                                last["usage"] = usage([done[j] for j in range(len(seqs))])
                            yield sse(last | metrics)
                    elif isinstance(event, Failed):
                        err = event.error
                        yield sse({"error": {"message": err.message, "type": err.kind.openai_type, "code": err.code}})
                yield b"data: [DONE]\n\n"
            finally:
                # Runs when the client disconnects too: every choice's sequence is freed on both services.
                await events.aclose()

        return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _watch_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.5)


def sse(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()


def usage(finished: Sequence[Finished | Outcome]) -> dict[str, int]:
    """The request's usage in OpenAI's shape (gateway.api.choices.request_usage counts it)."""
    prompt, completion = request_usage([f.finished if isinstance(f, Outcome) else f for f in finished])
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
