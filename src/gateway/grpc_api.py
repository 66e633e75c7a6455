"""The gateway's gRPC API (speculative.v1.GatewayService) over the scheduler."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import grpc

from gateway.failures import GenerationError
from gateway.logprob_format import TokenTexts, grpc_logprobs
from gateway.scheduler import Delta, Failed, Finished, Scheduler, _Sequence
from gateway.validation import InvalidParameter, RequestedParams, encode_prompt, generation_params
from specd.proto.speculative.v1 import gateway_pb2, gateway_pb2_grpc

FINISH = {"stop": gateway_pb2.FINISH_REASON_STOP, "length": gateway_pb2.FINISH_REASON_LENGTH}


class GatewayServicer(gateway_pb2_grpc.GatewayServiceServicer):
    def __init__(self, scheduler: Scheduler, tokenizer: Any, model_name: str) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.texts = TokenTexts(tokenizer)

    def _start(
        self, model: str, prompt: str, params: gateway_pb2.GenerationParams, context: grpc.aio.ServicerContext
    ) -> _Sequence:
        if model and model != self.model_name:
            raise GenerationError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}")
        generation = generation_params(requested(params), len(self.tokenizer))
        metadata = {k: v for k, v in (context.invocation_metadata() or ()) if k in ("traceparent", "tracestate")}
        return self.scheduler.submit(encode_prompt(self.tokenizer, prompt), generation, metadata)

    def _prompt_logprobs(self, seq: _Sequence) -> list[gateway_pb2.GeneratedTokenLogprob]:
        return grpc_logprobs(seq.prompt_logprobs, self.texts)

    async def _abort(self, context: grpc.aio.ServicerContext, error: GenerationError) -> None:
        await context.abort(error.kind.grpc_status, error.message)

    async def Generate(self, request, context) -> gateway_pb2.GenerateResponse:
        try:
            seq = self._start(request.model, request.prompt, request.params, context)
        except GenerationError as exc:
            await self._abort(context, exc)
        text: list[str] = []
        ids: list[int] = []
        logprobs: list[gateway_pb2.GeneratedTokenLogprob] = []
        async for event in self.scheduler.events(seq):
            if isinstance(event, Delta):
                text.append(event.text)
                ids.extend(event.token_ids)
                logprobs.extend(grpc_logprobs(event.logprobs, self.texts))
            elif isinstance(event, Finished):
                return gateway_pb2.GenerateResponse(
                    text="".join(text),
                    token_ids=ids,
                    finish_reason=FINISH[event.reason],
                    usage=gateway_pb2.Usage(
                        prompt_tokens=event.prompt_tokens, completion_tokens=event.completion_tokens
                    ),
                    logprobs=logprobs,
                    prompt_logprobs=self._prompt_logprobs(seq),
                )
            elif isinstance(event, Failed):
                await self._abort(context, event.error)
        await context.abort(grpc.StatusCode.INTERNAL, "generation ended without a result")

    async def GenerateStream(self, request, context) -> AsyncIterator[gateway_pb2.GenerateStreamResponse]:
        try:
            seq = self._start(request.model, request.prompt, request.params, context)
        except GenerationError as exc:
            await self._abort(context, exc)
        # Leaving this generator early (client cancelled) closes events(), which
        # cancels the sequence on both services.
        first = True
        async for event in self.scheduler.events(seq):
            # The prompt's logprobs exist once the verifier opened the sequence, before any event.
            prompt_logprobs = self._prompt_logprobs(seq) if first else []
            first = False
            if isinstance(event, Delta):
                yield gateway_pb2.GenerateStreamResponse(
                    text=event.text,
                    token_ids=event.token_ids,
                    logprobs=grpc_logprobs(event.logprobs, self.texts),
                    prompt_logprobs=prompt_logprobs,
                )
            elif isinstance(event, Finished):
                yield gateway_pb2.GenerateStreamResponse(
                    prompt_logprobs=prompt_logprobs,
                    finish_reason=FINISH[event.reason],
                    usage=gateway_pb2.Usage(
                        prompt_tokens=event.prompt_tokens, completion_tokens=event.completion_tokens
                    ),
                )
            elif isinstance(event, Failed):
                await self._abort(context, event.error)


def requested(params: gateway_pb2.GenerationParams) -> RequestedParams:
    """The request's parameters as the validator takes them; unset optional fields stay None."""

    def opt(name: str) -> Any:
        return getattr(params, name) if params.HasField(name) else None

    return RequestedParams(
        max_tokens=opt("max_tokens"),
        temperature=opt("temperature"),
        top_p=opt("top_p"),
        top_k=params.top_k,
        seed=opt("seed"),
        stop=list(params.stop),
        ignore_eos=params.ignore_eos,
        speculation=(
            params.num_speculative_tokens
            if params.HasField("num_speculative_tokens")
            else ("auto" if params.adaptive_speculation else None)
        ),
        presence_penalty=opt("presence_penalty"),
        frequency_penalty=opt("frequency_penalty"),
        repetition_penalty=opt("repetition_penalty"),
        logit_bias=dict(params.logit_bias),
        logprobs=params.logprobs,
        top_logprobs=params.top_logprobs,
        prompt_logprobs=params.prompt_logprobs,
        pipeline=params.pipeline or None,
        response_format=response_format(params.json_schema),
        guided_regex=params.guided_regex or None,
        guided_choice=list(params.guided_choice) or None,
    )


def response_format(schema_text: str) -> dict[str, Any] | None:
    """GenerationParams.json_schema as the OpenAI response_format the validator checks."""
    if not schema_text:
        return None
    try:
        schema = json.loads(schema_text)
    except ValueError as exc:
        raise InvalidParameter("json_schema", f"json_schema is not JSON text: {exc}") from None
    return {"type": "json_schema", "json_schema": {"name": "json_schema", "schema": schema}}
