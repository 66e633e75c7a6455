"""The gateway's gRPC API (speculative.v1.GatewayService) over the scheduler.

A request's choices (GenerationParams.n) run as the HTTP API runs them (gateway.api.choices): one
sequence each, submitted together so that they share the prompt's prefill, with per-choice
seeds, validated by the same code.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any, NoReturn

import grpc

from gateway.api.choices import Gathered, Outcome, choice_params, merged, request_usage
from gateway.api.grammar_check import check_constraint
from gateway.api.limits import api_key, tenant
from gateway.api.logprob_format import TokenTexts, grpc_logprobs
from gateway.api.prompts import off_loop, prompts_for
from gateway.api.validation import InvalidParameter, RequestedParams, choices, generation_params
from gateway.failures import GenerationError, internal
from gateway.round.scheduler import Delta, Failed, Finished, Scheduler, _Sequence
from specd.engine.params import TokenLogprob
from specd.proto.speculative.v1 import gateway_pb2, gateway_pb2_grpc

FINISH = {"stop": gateway_pb2.FINISH_REASON_STOP, "length": gateway_pb2.FINISH_REASON_LENGTH}


class GatewayServicer(gateway_pb2_grpc.GatewayServiceServicer):
    def __init__(
        self,
        scheduler: Scheduler,
        tokenizer: Any,
        model_name: str,
        max_n: int,
        undeclared_keys: bool = False,
        keyed: bool = False,
    ) -> None:
        self.scheduler = scheduler
        # --json-undeclared-keys, as on the HTTP API.
        self.undeclared_keys = undeclared_keys
        self.keyed = keyed  # whether clients are told apart by API key (else by address): gateway.round.shares
        self.tokenizer = tokenizer
        self.model_name = model_name
        # The most choices one request may ask for (--max-n), the HTTP API's limit too.
        self.max_n = max_n
        self.texts = TokenTexts(tokenizer)

    async def _start(
        self,
        model: str,
        prompt: str,
        params: gateway_pb2.GenerationParams,
        context: grpc.aio.ServicerContext,
        stream: bool,
    ) -> list[_Sequence]:
        """Validate the request and submit its choices, choice 0 first; raises GenerationError."""
        if model and model != self.model_name:
            raise GenerationError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}")
        raw = dataclasses.replace(requested(params), undeclared_keys=self.undeclared_keys)
        generation = generation_params(raw, len(self.tokenizer))
        await off_loop(check_constraint, self.tokenizer, generation, raw)
        wanted = choices(raw, self.max_n, stream)
        sent = dict(context.invocation_metadata() or ())
        metadata = {k: v for k, v in sent.items() if k in ("traceparent", "tracestate")}
        # The peer is "ipv4:HOST:PORT" or "ipv6:[HOST]:PORT": the client is its host.
        key = api_key(sent.get("authorization"))
        client = key if self.keyed else context.peer().rpartition(":")[0]
        ids = await off_loop(prompts_for(self.tokenizer, self.scheduler.max_context).text_ids, prompt)
        group = choice_params(generation, wanted)
        return self.scheduler.submit_group(ids, group, metadata, client, tenant(key) if self.keyed else "")

    async def _abort(self, context: grpc.aio.ServicerContext, error: GenerationError) -> NoReturn:
        await context.abort(error.kind.grpc_status, error.message)
        raise AssertionError("context.abort() returned instead of raising")

    async def Generate(self, request, context) -> gateway_pb2.GenerateResponse:
        try:
            seqs = await self._start(request.model, request.prompt, request.params, context, stream=False)
        except GenerationError as exc:
            await self._abort(context, exc)
        gathered = Gathered(len(seqs))
        events = merged(self.scheduler, seqs)
        try:
            async for i, event in events:
                if isinstance(event, Failed):
                    await self._abort(context, event.error)
                gathered.add(i, event)
        finally:
            # Also when the call is cancelled: every choice's sequence is freed on both services.
            await events.aclose()
        if not gathered.complete:
            await self._abort(context, internal("generation ended without a result"))
        return unary_response(gathered.outcomes(), seqs[0].prompt_logprobs, request.params.HasField("n"), self.texts)

    async def GenerateStream(self, request, context) -> AsyncIterator[gateway_pb2.GenerateStreamResponse]:
        try:
            seqs = await self._start(request.model, request.prompt, request.params, context, stream=True)
        except GenerationError as exc:
            await self._abort(context, exc)
        # Leaving this generator early (client cancelled) closes merged(), which cancels every
        # choice's sequence on both services.
        events = merged(self.scheduler, seqs)
        first = True
        try:
            async for i, event in events:
                if isinstance(event, Failed):
                    await self._abort(context, event.error)
                # Choice 0 asked the verifier for the prompt's logprobs; it was opened no later than
                # any other choice, so they are in by the stream's first event, whichever choice's.
                prompt_logprobs = seqs[0].prompt_logprobs if first else []
                first = False
                yield stream_chunk(i, event, prompt_logprobs, self.texts)
        finally:
            await events.aclose()


def unary_response(
    outcomes: Sequence[Outcome], prompt_logprobs: Sequence[TokenLogprob], with_choices: bool, texts: TokenTexts
) -> gateway_pb2.GenerateResponse:
    """Generate's reply: choice 0 in the top-level fields, which a client that predates n reads,
    and every choice in `choices` when the client asked for them by setting n."""
    listed = [choice_message(i, outcome, texts) for i, outcome in enumerate(outcomes)]
    first = listed[0]
    prompt_tokens, completion_tokens = request_usage([o.finished for o in outcomes])
    return gateway_pb2.GenerateResponse(
        text=first.text,
        token_ids=first.token_ids,
        finish_reason=first.finish_reason,
        usage=gateway_pb2.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens),
        logprobs=first.logprobs,
        prompt_logprobs=grpc_logprobs(prompt_logprobs, texts),
        choices=listed if with_choices else [],
    )


def choice_message(index: int, outcome: Outcome, texts: TokenTexts) -> gateway_pb2.GenerateChoice:
    return gateway_pb2.GenerateChoice(
        index=index,
        text=outcome.text,
        token_ids=outcome.token_ids,
        finish_reason=FINISH[outcome.finished.reason],
        logprobs=grpc_logprobs(outcome.logprobs, texts),
    )


def stream_chunk(
    index: int, event: Delta | Finished, prompt_logprobs: Sequence[TokenLogprob], texts: TokenTexts
) -> gateway_pb2.GenerateStreamResponse:
    """One chunk of choice `index`: its new tokens, or its end with its own usage."""
    if isinstance(event, Delta):
        return gateway_pb2.GenerateStreamResponse(
            index=index,
            text=event.text,
            token_ids=event.token_ids,
            logprobs=grpc_logprobs(event.logprobs, texts),
            prompt_logprobs=grpc_logprobs(prompt_logprobs, texts),
        )
    return gateway_pb2.GenerateStreamResponse(
        index=index,
        prompt_logprobs=grpc_logprobs(prompt_logprobs, texts),
        finish_reason=FINISH[event.reason],
        usage=gateway_pb2.Usage(prompt_tokens=event.prompt_tokens, completion_tokens=event.completion_tokens),
    )


def requested(params: gateway_pb2.GenerationParams) -> RequestedParams:
    """The request's parameters as the validator takes them; unset optional fields stay None."""

    def opt(name: str) -> Any:
        return getattr(params, name) if params.HasField(name) else None

    return RequestedParams(
        n=opt("n"),
        max_tokens=opt("max_tokens"),
        temperature=opt("temperature"),
        top_p=opt("top_p"),
        top_k=params.top_k,
        min_p=opt("min_p"),
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
        siblings=params.speculative_siblings if params.HasField("speculative_siblings") else None,
        branches=params.speculative_branches if params.HasField("speculative_branches") else None,
        response_format=response_format(params.json_schema),
        guided_regex=params.guided_regex or None,
        guided_choice=list(params.guided_choice) or None,
        min_tokens=params.min_tokens,
        skip_special_tokens=params.skip_special_tokens if params.HasField("skip_special_tokens") else True,
        include_stop_str_in_output=params.include_stop_str_in_output,
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
