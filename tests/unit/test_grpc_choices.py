"""The gRPC API's several choices (GenerationParams.n) over a scheduler that scripts each
choice's events: what Generate and GenerateStream return for them, and that a client that
does not set n gets the reply it got before n existed."""

from __future__ import annotations

import asyncio
import types
from typing import Any

import grpc
import pytest
from api_harness import MODEL, Aborted, FakeContext

from gateway.api.choices import choice_seed
from gateway.api.grpc_api import GatewayServicer
from gateway.failures import GenerationError
from gateway.round.scheduler import Delta, Failed, Finished, GenerationParams
from specd.engine.params import TokenLogprob
from specd.proto.speculative.v1 import gateway_pb2

PROMPT_TOKENS = 3
PROMPT_LOGPROBS = [TokenLogprob(7, -1.5)]


class ScriptedScheduler:
    """Choice i says "c{i}:{its seed}" in two deltas, as tokens [i] then [100 + i], and stops;
    `failing` names a choice that fails after its first delta instead."""

    max_context = 4096

    def __init__(self, failing: int | None = None) -> None:
        self.failing = failing
        self.submitted: list[GenerationParams] = []
        self.cancelled: list[int] = []

    def submit_group(
        self,
        prompt: list[int],
        group: list[GenerationParams],
        carrier: Any = None,
        client: str = "",
        tenant: str = "",
    ) -> list[Any]:
        self.submitted.extend(group)
        return [
            types.SimpleNamespace(index=i, params=p, prompt_logprobs=PROMPT_LOGPROBS if asks_prompt(p) else [])
            for i, p in enumerate(group)
        ]

    def cancel(self, seq: Any) -> None:
        self.cancelled.append(seq.index)

    async def events(self, seq: Any):
        i = seq.index
        lps = seq.params.logprobs is not None
        yield Delta(f"c{i}:", [i], [TokenLogprob(i, -0.25)] if lps else [])
        await asyncio.sleep(0)  # let the other choices' events in between
        if i == self.failing:
            yield Failed(GenerationError(503, f"choice {i} lost its verifier", "service_unavailable"))
            return
        yield Delta(str(seq.params.sampling.seed), [100 + i], [TokenLogprob(100 + i, -0.5)] if lps else [])
        yield Finished("stop", PROMPT_TOKENS, 2)


def asks_prompt(params: GenerationParams) -> bool:
    return params.logprobs is not None and params.logprobs.prompt


def servicer(tok, scheduler: ScriptedScheduler) -> GatewayServicer:
    return GatewayServicer(scheduler, tok, MODEL, max_n=8)  # type: ignore[arg-type]


def generate(tok, scheduler: ScriptedScheduler, **fields: Any) -> gateway_pb2.GenerateResponse:
    request = gateway_pb2.GenerateRequest(prompt="Hello", params=gateway_pb2.GenerationParams(**fields))
    return asyncio.run(servicer(tok, scheduler).Generate(request, FakeContext()))


def stream(tok, scheduler: ScriptedScheduler, **fields: Any) -> list[gateway_pb2.GenerateStreamResponse]:
    request = gateway_pb2.GenerateStreamRequest(prompt="Hello", params=gateway_pb2.GenerationParams(**fields))

    async def collect() -> list[gateway_pb2.GenerateStreamResponse]:
        return [chunk async for chunk in servicer(tok, scheduler).GenerateStream(request, FakeContext())]

    return asyncio.run(collect())


def test_unary_reply_lists_every_choice_in_index_order(tok):
    reply = generate(tok, ScriptedScheduler(), n=3, seed=9, temperature=1.0, logprobs=True)
    want = [f"c{i}:{choice_seed(9, i)}" for i in range(3)]
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [c.text for c in reply.choices] == want
    assert [list(c.token_ids) for c in reply.choices] == [[i, 100 + i] for i in range(3)]
    assert [[lp.token_id for lp in c.logprobs] for c in reply.choices] == [[i, 100 + i] for i in range(3)]
    assert all(c.finish_reason == gateway_pb2.FINISH_REASON_STOP for c in reply.choices)
    # The top-level fields are choice 0's; usage counts the prompt once and every choice's tokens.
    assert reply.text == want[0] and list(reply.token_ids) == [0, 100] and reply.logprobs == reply.choices[0].logprobs
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (PROMPT_TOKENS, 3 * 2)


def test_prompt_logprobs_come_once_from_choice_zero(tok):
    scheduler = ScriptedScheduler()
    reply = generate(tok, scheduler, n=2, logprobs=True, prompt_logprobs=True)
    assert [lp.token_id for lp in reply.prompt_logprobs] == [7]
    assert [asks_prompt(p) for p in scheduler.submitted] == [True, False]


def test_n_one_lists_its_one_choice(tok):
    reply = generate(tok, ScriptedScheduler(), n=1, seed=4)
    assert [(c.index, c.text) for c in reply.choices] == [(0, "c0:4")] and reply.text == "c0:4"


def test_without_n_the_reply_is_the_one_choice_reply_as_before(tok):
    reply = generate(tok, ScriptedScheduler(), seed=4, logprobs=True)
    before = gateway_pb2.GenerateResponse(
        text="c0:4",
        token_ids=[0, 100],
        finish_reason=gateway_pb2.FINISH_REASON_STOP,
        usage=gateway_pb2.Usage(prompt_tokens=PROMPT_TOKENS, completion_tokens=2),
        logprobs=[
            gateway_pb2.GeneratedTokenLogprob(token_id=0, token=tok.decode([0]), logprob=-0.25),
            gateway_pb2.GeneratedTokenLogprob(token_id=100, token=tok.decode([100]), logprob=-0.5),
        ],
    )
    assert reply.SerializeToString(deterministic=True) == before.SerializeToString(deterministic=True)


def test_streamed_choices_are_tagged_with_their_index(tok):
    chunks = stream(tok, ScriptedScheduler(), n=3, seed=9, logprobs=True, prompt_logprobs=True)
    by_choice: dict[int, list[gateway_pb2.GenerateStreamResponse]] = {}
    for chunk in chunks:
        by_choice.setdefault(chunk.index, []).append(chunk)
    assert sorted(by_choice) == [0, 1, 2]
    assert [c.index for c in chunks] != sorted(c.index for c in chunks)  # interleaved, not one after another
    for i, mine in by_choice.items():
        assert "".join(c.text for c in mine) == f"c{i}:{choice_seed(9, i)}"
        assert [t for c in mine for t in c.token_ids] == [i, 100 + i]
        # Each choice's last chunk ends it, with its own usage; no other chunk does.
        assert [c.finish_reason for c in mine] == [0, 0, gateway_pb2.FINISH_REASON_STOP]
        assert [c.HasField("usage") for c in mine] == [False, False, True]
        assert (mine[-1].usage.prompt_tokens, mine[-1].usage.completion_tokens) == (PROMPT_TOKENS, 2)
    assert [len(c.prompt_logprobs) for c in chunks] == [1] + [0] * (len(chunks) - 1)


def test_stream_without_n_is_index_zero_throughout(tok):
    chunks = stream(tok, ScriptedScheduler(), seed=4)
    assert "".join(c.text for c in chunks) == "c0:4" and chunks[-1].finish_reason == gateway_pb2.FINISH_REASON_STOP
    # index 0 is proto3's default: not on the wire, so the bytes are those of a reply without the field.
    assert all("index" not in {f.name for f, _ in c.ListFields()} for c in chunks)


@pytest.mark.parametrize("streamed", [False, True])
def test_one_failed_choice_fails_the_call_and_cancels_every_choice(tok, streamed):
    scheduler = ScriptedScheduler(failing=1)
    with pytest.raises(Aborted) as info:
        stream(tok, scheduler, n=3) if streamed else generate(tok, scheduler, n=3)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE and "choice 1" in info.value.details
    assert sorted(set(scheduler.cancelled)) == [0, 1, 2]
