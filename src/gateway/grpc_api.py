"""The gateway's gRPC API (speculative.v1.GatewayService) over the scheduler."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from typing import Any

import grpc

from gateway import prompt_text
from gateway.scheduler import Delta, Failed, Finished, GenerationError, GenerationParams, Scheduler, _Sequence
from specd.proto.speculative.v1 import gateway_pb2, gateway_pb2_grpc
from specd.sampling import SamplingParams, validate_sampling

FINISH = {"stop": gateway_pb2.FINISH_REASON_STOP, "length": gateway_pb2.FINISH_REASON_LENGTH}
HTTP_TO_GRPC = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    404: grpc.StatusCode.NOT_FOUND,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


class GatewayServicer(gateway_pb2_grpc.GatewayServiceServicer):
    def __init__(self, scheduler: Scheduler, tokenizer: Any, model_name: str) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.model_name = model_name

    def _start(
        self, model: str, prompt: str, params: gateway_pb2.GenerationParams, context: grpc.aio.ServicerContext
    ) -> _Sequence:
        if model and model != self.model_name:
            raise GenerationError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}")
        sampling = SamplingParams(
            temperature=params.temperature if params.HasField("temperature") else 1.0,
            top_p=params.top_p if params.HasField("top_p") else 1.0,
            top_k=max(0, params.top_k),
            seed=params.seed if params.HasField("seed") else None,
        )
        reason = validate_sampling(sampling)
        if reason or math.isinf(sampling.temperature):
            raise GenerationError(400, reason or "temperature must be finite")
        if len(params.stop) > 4:
            raise GenerationError(400, "at most 4 stop sequences are allowed")
        generation = GenerationParams(
            max_tokens=params.max_tokens or None,
            sampling=sampling,
            stop=tuple(params.stop),
            ignore_eos=params.ignore_eos,
            speculation=(
                params.num_speculative_tokens
                if params.HasField("num_speculative_tokens")
                else ("auto" if params.adaptive_speculation else None)
            ),
        )
        metadata = {k: v for k, v in (context.invocation_metadata() or ()) if k in ("traceparent", "tracestate")}
        try:
            prompt_ids = prompt_text.encode(self.tokenizer, prompt, "prompt")
        except prompt_text.UnencodableText as exc:
            raise GenerationError(400, exc.message) from None
        return self.scheduler.submit(prompt_ids, generation, metadata)

    async def _abort(self, context: grpc.aio.ServicerContext, error: GenerationError) -> None:
        await context.abort(HTTP_TO_GRPC.get(error.status, grpc.StatusCode.INTERNAL), error.message)

    async def Generate(self, request, context) -> gateway_pb2.GenerateResponse:
        try:
            seq = self._start(request.model, request.prompt, request.params, context)
        except GenerationError as exc:
            await self._abort(context, exc)
        text: list[str] = []
        ids: list[int] = []
        async for event in self.scheduler.events(seq):
            if isinstance(event, Delta):
                text.append(event.text)
                ids.extend(event.token_ids)
            elif isinstance(event, Finished):
                return gateway_pb2.GenerateResponse(
                    text="".join(text),
                    token_ids=ids,
                    finish_reason=FINISH[event.reason],
                    usage=gateway_pb2.Usage(
                        prompt_tokens=event.prompt_tokens, completion_tokens=event.completion_tokens
                    ),
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
        async for event in self.scheduler.events(seq):
            if isinstance(event, Delta):
                yield gateway_pb2.GenerateStreamResponse(text=event.text, token_ids=event.token_ids)
            elif isinstance(event, Finished):
                yield gateway_pb2.GenerateStreamResponse(
                    finish_reason=FINISH[event.reason],
                    usage=gateway_pb2.Usage(
                        prompt_tokens=event.prompt_tokens, completion_tokens=event.completion_tokens
                    ),
                )
            elif isinstance(event, Failed):
                await self._abort(context, event.error)
