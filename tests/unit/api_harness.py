"""The gateway's HTTP and gRPC API layers in-process, over a scheduler that only records
what reaches it: for tests of what the APIs accept and refuse."""

from __future__ import annotations

import asyncio
import copy
import json
import types
from pathlib import Path
from typing import Any

import grpc
import httpx
from fake_backends import EOS, FakeDrafter, FakeVerifier

from gateway.api.grpc_api import GatewayServicer
from gateway.api.openai_api import OpenAIApi
from gateway.round.scheduler import Delta, Finished, GenerationParams, Scheduler
from specd.proto.speculative.v1 import gateway_pb2

MODEL = "target"
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


class RefusingScheduler:
    """Stands for the scheduler: a request that reaches it passed validation."""

    max_context = 4096
    k_limit = 4  # the most drafts per step, as the gateway's scheduler reports it

    def __init__(self) -> None:
        self.submitted: list[GenerationParams] = []
        self.prompts: list[list[int]] = []  # the prompt of each submission
        self.tenants: list[str] = []  # the tenant of each submission (SequenceSpec.tenant)

    def submit(self, prompt: list[int], params: GenerationParams, carrier: Any = None) -> Any:
        self.submitted.append(params)
        self.prompts.append(list(prompt))
        return types.SimpleNamespace(prompt_logprobs=[])

    def submit_group(
        self,
        prompt: list[int],
        group: list[GenerationParams],
        carrier: Any = None,
        client: str = "",
        tenant: str = "",
    ) -> list[Any]:
        self.tenants.append(tenant)
        return [self.submit(prompt, params, carrier) for params in group]

    def cancel(self, seq: Any) -> None:
        pass

    async def events(self, seq: Any):
        yield Finished("length", 1, 0)


class ScriptedScheduler(RefusingScheduler):
    """Also answers every sequence with the same text, in the pieces given, then `reason`."""

    def __init__(self, pieces: list[str], reason: str = "stop", spec_steps: tuple[tuple[int, int], ...] = ()) -> None:
        super().__init__()
        self.pieces, self.reason, self.spec_steps = pieces, reason, spec_steps

    async def events(self, seq: Any):
        for piece in self.pieces:
            yield Delta(piece, [0])
        yield Finished(self.reason, 1, len(self.pieces), self.spec_steps)


class GatewayScheduler(Scheduler):
    """The gateway's own scheduler, with its flags, over in-process fake services, never started:
    what it refuses at submission (what the gateway's flags decide) is refused as the gateway
    refuses it; what it takes finishes at once. `drafter` False: a gateway without one."""

    def __init__(self, tok: Any, k: int = 4, drafter: bool = True, **flags: Any) -> None:
        super().__init__(tok, FakeVerifier(), FakeDrafter() if drafter else None, k, 16, [EOS], **flags)
        self.submitted: list[GenerationParams] = []

    def submit_group(
        self, prompt: list[int], group: Any, trace_parent: Any = None, client: str = "", tenant: str = ""
    ) -> list[Any]:
        seqs = super().submit_group(prompt, group, trace_parent, client, tenant)
        self.submitted.extend(group)
        return seqs

    async def events(self, seq: Any):
        yield Finished("length", 1, 0)


def body_for(endpoint: str, fields: dict[str, Any]) -> dict[str, Any]:
    base: dict[str, Any] = {"model": MODEL, "max_tokens": 4}
    base |= {"prompt": "Hello"} if endpoint == COMPLETIONS else {"messages": [{"role": "user", "content": "Hi"}]}
    return base | fields


TOOLS_TEMPLATE = Path(__file__).resolve().parents[1] / "tools_chat_template.jinja"


def with_tools_template(tok: Any) -> Any:
    """The tokenizer serving a chat template that renders tools (as --chat-template does)."""
    served = copy.copy(tok)
    served.chat_template = TOOLS_TEMPLATE.read_text()
    return served


def http_post(
    tok,
    path: str,
    body: dict[str, Any],
    scheduler: RefusingScheduler | GatewayScheduler | None = None,
    tool_parser: str = "",
    spec_metrics: str = "off",
) -> tuple[httpx.Response, Any]:
    """With a tool_parser, the tokenizer serves a template that renders tools (auto needs both)."""
    scheduler = scheduler or RefusingScheduler()
    tok = with_tools_template(tok) if tool_parser else tok
    api = OpenAIApi(scheduler, tok, MODEL, health=None, tool_parser=tool_parser, spec_metrics=spec_metrics)  # type: ignore[arg-type]
    app = api.app()

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            # httpx's JSON encoder refuses NaN/inf; a client can send them, so send the bytes.
            return await client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})

    return asyncio.run(go()), scheduler


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class FakeContext:
    def invocation_metadata(self) -> tuple:
        return ()

    def peer(self) -> str:
        return "ipv4:127.0.0.1:40000"

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)


def grpc_generate(
    tok, fields: dict[str, Any], scheduler: RefusingScheduler | GatewayScheduler | None = None
) -> tuple[Aborted | None, Any]:
    scheduler = scheduler or RefusingScheduler()
    servicer = GatewayServicer(scheduler, tok, MODEL, max_n=8)  # type: ignore[arg-type]
    request = gateway_pb2.GenerateRequest(prompt="Hello", params=gateway_pb2.GenerationParams(**fields))
    try:
        asyncio.run(servicer.Generate(request, FakeContext()))
    except Aborted as exc:
        return exc, scheduler
    return None, scheduler


def grpc_generate_stream(tok, fields: dict[str, Any]) -> tuple[Aborted | None, RefusingScheduler]:
    scheduler = RefusingScheduler()
    servicer = GatewayServicer(scheduler, tok, MODEL, max_n=8)  # type: ignore[arg-type]
    request = gateway_pb2.GenerateStreamRequest(prompt="Hello", params=gateway_pb2.GenerationParams(**fields))

    async def drain() -> None:
        async for _ in servicer.GenerateStream(request, FakeContext()):
            pass

    try:
        asyncio.run(drain())
    except Aborted as exc:
        return exc, scheduler
    return None, scheduler
