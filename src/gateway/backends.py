"""Clients of the drafter and verifier services, as the scheduler uses them.

Each backend keeps one long-lived bidirectional round stream; a round is one
write and one read on it. A broken stream is dropped and reopened on next use.

The round streams run on a channel of their own without the token interceptor,
and carry the token as the call's metadata instead: an intercepted stream-stream
call proxies every write through a queue, a put task and a consumer task, and
every read through another task, which is a handful of event-loop hops on each
round's critical path for what one header at the call's start does as well.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine, Iterator, Mapping
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specd.engine.fingerprint import TokenizerFingerprint
from specd.proto.speculative.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from specd.rpc.backend_auth import client_interceptors, token_metadata
from specd.rpc.delivery import DeliveryStream
from specd.rpc.serving import channel_options, fingerprint_from_pb
from specd.rpc.tls import server_name_option

log = logging.getLogger(__name__)

# Tokens a drafter's open may prefill per drafter deadline before it counts as stalled.
PREFILL_TOKENS_PER_DEADLINE = 4096


class BackendError(Exception):
    """A backend could not be reached or answered out of protocol."""


class RoundStream:
    """One bidirectional stream used strictly request -> response."""

    def __init__(self, opener: Any, name: str, timeout_s: float) -> None:
        self._opener = opener
        self._name = name
        self._timeout_s = timeout_s
        self._call: Any = None
        self._lock = asyncio.Lock()

    async def exchange(self, request: Any) -> Any:
        async with self._lock:
            if self._call is None:
                self._call = self._opener()
            try:
                response = await within(self._timeout_s, self._write_read(request))
            except (grpc.aio.AioRpcError, asyncio.TimeoutError, grpc.aio.UsageError, asyncio.InvalidStateError) as exc:
                # InvalidStateError: the call ended (its peer died) since the last round.
                self._reset()
                raise BackendError(f"{self._name} round failed: {describe(exc)}") from exc
            except BaseException:
                # Cancelled mid-exchange: the stream's request/response pairing is lost.
                self._reset()
                raise
            if response is grpc.aio.EOF:
                self._reset()
                raise BackendError(f"{self._name} closed its round stream")
            if response.round_id != request.round_id:
                self._reset()
                raise BackendError(f"{self._name} answered round {response.round_id} to round {request.round_id}")
            return response

    async def _write_read(self, request: Any) -> Any:
        await self._call.write(request)
        return await self._call.read()

    def _reset(self) -> None:
        if self._call is not None:
            self._call.cancel()
        self._call = None

    def close(self) -> None:
        self._reset()


async def within(timeout_s: float, exchange: Coroutine[Any, Any, Any]) -> Any:
    """`exchange`'s result, or TimeoutError once `timeout_s` has passed.

    Where asyncio has `timeout` (3.11), the exchange runs in the caller's task; `wait_for`
    makes a task of it there, a hop through the event loop each way.
    """
    timeout = getattr(asyncio, "timeout", None)
    if timeout is None:
        return await asyncio.wait_for(exchange, timeout_s)
    async with timeout(timeout_s):
        return await exchange


def round_header(request: Any) -> Any:
    """A round's request without its tasks: a part of it, for a pool that splits it by replica."""
    return type(request)(**{f.name: v for f, v in request.ListFields() if f.name != "tasks"})


def not_found_error(exc: BaseException) -> bool:
    # A service closes the ids it knows and then refuses the rest with NOT_FOUND.
    code = getattr(exc, "code", None)
    return callable(code) and getattr(code(), "name", "") == "NOT_FOUND"


def describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    if isinstance(exc, asyncio.TimeoutError):
        return "deadline exceeded"
    return str(exc) or type(exc).__name__


class _Backend:
    rounds: RoundStream  # each kind's round stream, set by the subclass

    def __init__(
        self,
        address: str,
        name: str,
        timeout_s: float,
        max_message_bytes: int,
        credentials: grpc.ChannelCredentials | None = None,
        server_name: str = "",
        lease_owner: str = "",
        token: str = "",
    ) -> None:
        self.address = address
        # This gateway instance: every open, round and close names it, so the service knows whose
        # sequences they are and frees them if this gateway stops renewing its lease.
        self.lease_owner = lease_owner
        self.name = name
        self.timeout_s = timeout_s
        options = channel_options(max_message_bytes)
        if credentials is not None:
            options += server_name_option(server_name)

        def channel(interceptors: list[grpc.aio.ClientInterceptor]) -> grpc.aio.Channel:
            if credentials is None:
                return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
            return grpc.aio.secure_channel(address, credentials, options=options, interceptors=interceptors)

        self.channel = channel(client_interceptors(token))
        # The round streams' channel: the token goes as each stream's metadata (see the module's doc).
        self.round_channel = channel([])
        self.round_metadata = token_metadata(token)
        self._health = health_pb2_grpc.HealthStub(self.channel)
        self.info: common_pb2.ModelInfo | None = None
        self._presence: asyncio.Task[None] | None = None

    async def healthy(self, timeout_s: float = 2.0) -> bool:
        try:
            reply = await self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def wait_ready(self, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not await self.healthy():
            if loop.time() > deadline:
                raise BackendError(f"{self.name} at {self.address} not ready after {timeout_s:.0f}s")
            await asyncio.sleep(0.5)

    @contextlib.contextmanager
    def _refused_credentials(self) -> Iterator[None]:
        """A backend that refuses the gateway's token is a configuration error: say which one, and why."""
        try:
            yield
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNAUTHENTICATED:
                raise
            raise BackendError(
                f"the {self.name} at {self.address} refused the gateway ({exc.details()}): give both the same "
                "backend token (SPECD_BACKEND_TOKEN or --backend-token-file)"
            ) from None

    @property
    def fingerprint(self) -> TokenizerFingerprint | None:
        return fingerprint_from_pb(self.info.tokenizer) if self.info is not None else None

    async def keep_alive(self) -> common_pb2.KeepAliveResponse:
        """Renew this gateway's lease on its sequences there (rounds renew it too)."""
        return await self.stub.KeepAlive(
            common_pb2.KeepAliveRequest(lease_owner=self.lease_owner), timeout=min(self.timeout_s, 5.0)
        )

    def hold_presence(self) -> None:
        """Keep a presence stream open to the service while this gateway instance lives: killed, its
        sequences there are freed about a second after its connections close, not a lease later."""
        if self.lease_owner and (self._presence is None or self._presence.done()):
            self._presence = asyncio.create_task(self._present(), name=f"specd-{self.name}-presence")

    async def _present(self) -> None:
        request = common_pb2.AttachRequest(lease_owner=self.lease_owner)
        while True:
            try:
                async for _ in self.stub.Attach(request, wait_for_ready=True):
                    pass
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    log.info("the %s at %s predates presence streams: its lease alone frees", self.name, self.address)
                    return
            # Re-attach at once: the service frees this instance's sequences if it stays away.
            await asyncio.sleep(0.1)

    def reset_rounds(self) -> None:
        """Drop the round stream (it may be dead or mid-exchange); the next round opens a fresh one."""
        self.rounds.close()

    async def close(self) -> None:
        if self._presence is not None:
            self._presence.cancel()
        await self.round_channel.close()
        await self.channel.close()


class VerifierClient(_Backend):
    def __init__(
        self,
        address: str,
        timeout_s: float,
        max_message_bytes: int,
        credentials: grpc.ChannelCredentials | None = None,
        server_name: str = "",
        lease_owner: str = "",
        token: str = "",
    ) -> None:
        super().__init__(
            address, "verifier", timeout_s, max_message_bytes, credentials, server_name, lease_owner, token
        )
        self.stub = verifier_pb2_grpc.VerifierServiceStub(self.channel)
        rounds = verifier_pb2_grpc.VerifierServiceStub(self.round_channel)
        self.rounds = RoundStream(lambda: rounds.Verify(metadata=self.round_metadata), "verifier", timeout_s)
        self._deliveries: DeliveryStream | None = None  # the one-hop exchange's releases of rounds

    async def load_info(self) -> common_pb2.ModelInfo:
        with self._refused_credentials():
            reply = await self.stub.GetVerifierInfo(verifier_pb2.GetVerifierInfoRequest(), timeout=self.timeout_s)
        self.info = reply.model
        self.hold_presence()
        return reply.model

    async def open(self, specs: list[common_pb2.SequenceSpec]) -> list[common_pb2.OpenResult]:
        reply = await self.stub.OpenVerifySequences(
            verifier_pb2.OpenVerifySequencesRequest(sequences=specs, lease_owner=self.lease_owner),
            timeout=self.timeout_s,
        )
        return list(reply.results)

    async def close_sequences(self, ids: list[str], missing_ok: bool = True) -> None:
        # The gateway closes what it believes is open; an id the service no longer
        # has (it restarted, or never got the open) is already free, and must not
        # keep the others open.
        request = verifier_pb2.CloseVerifySequencesRequest(
            sequence_ids=ids, lease_owner=self.lease_owner, missing_ok=missing_ok
        )
        await self.stub.CloseVerifySequences(request, timeout=self.timeout_s)

    async def verify(self, request: verifier_pb2.VerifyRequest) -> verifier_pb2.VerifyResponse:
        request.lease_owner = self.lease_owner
        return await self.rounds.exchange(request)

    async def release(self, round_id: int) -> None:
        """The one-hop exchange: this round's drafter failed, so its verify need not wait for drafts."""
        if self._deliveries is None:
            self._deliveries = DeliveryStream(self.round_channel, self.round_metadata, self.timeout_s)
        released = verifier_pb2.DraftDelivery(lease_owner=self.lease_owner, round_id=round_id, released=True)
        await self._deliveries.send(released)

    async def close(self) -> None:
        if self._deliveries is not None:
            await self._deliveries.close()
        await super().close()


class DrafterClient(_Backend):
    def __init__(
        self,
        address: str,
        timeout_s: float,
        max_message_bytes: int,
        credentials: grpc.ChannelCredentials | None = None,
        server_name: str = "",
        lease_owner: str = "",
        token: str = "",
    ) -> None:
        super().__init__(address, "drafter", timeout_s, max_message_bytes, credentials, server_name, lease_owner, token)
        self.stub = drafter_pb2_grpc.DrafterServiceStub(self.channel)
        rounds = drafter_pb2_grpc.DrafterServiceStub(self.round_channel)
        self.rounds = RoundStream(lambda: rounds.Draft(metadata=self.round_metadata), "drafter", timeout_s)
        self.kind = common_pb2.DRAFTER_KIND_UNSPECIFIED
        self.feature_size = 0
        self.delivers = False  # it can send its drafts to the verifier itself (the one-hop exchange)

    async def load_info(self) -> common_pb2.ModelInfo:
        with self._refused_credentials():
            reply = await self.stub.GetDrafterInfo(drafter_pb2.GetDrafterInfoRequest(), timeout=self.timeout_s)
        self.info = reply.model
        self.kind = reply.kind
        self.feature_size = reply.feature_size
        self.delivers = reply.delivers
        self.hold_presence()
        return reply.model

    async def open(self, specs: list[common_pb2.SequenceSpec]) -> list[common_pb2.OpenResult]:
        # Opening prefills every committed token, which takes longer than a draft
        # round: the short drafter deadline grows with the tokens to prefill.
        tokens = sum(len(s.prompt_token_ids) for s in specs)
        reply = await self.stub.OpenDraftSequences(
            drafter_pb2.OpenDraftSequencesRequest(sequences=specs, lease_owner=self.lease_owner),
            timeout=self.timeout_s * (1 + tokens / PREFILL_TOKENS_PER_DEADLINE),
        )
        return list(reply.results)

    async def close_sequences(
        self, ids: list[str], missing_ok: bool = True, tails: Mapping[str, tuple[list[int], int]] | None = None
    ) -> None:
        # The gateway closes what it believes is open; an id the service no longer
        # has (it restarted, or never got the open) is already free, and must not
        # keep the others open.
        request = drafter_pb2.CloseDraftSequencesRequest(
            sequence_ids=ids,
            lease_owner=self.lease_owner,
            missing_ok=missing_ok,
            tails=[
                drafter_pb2.DraftTail(sequence_id=sid, new_token_ids=tokens, num_committed=committed)
                for sid, (tokens, committed) in (tails or {}).items()
                if sid in ids
            ],
        )
        await self.stub.CloseDraftSequences(request, timeout=self.timeout_s)

    async def draft(self, request: drafter_pb2.DraftRequest) -> drafter_pb2.DraftResponse:
        request.lease_owner = self.lease_owner
        return await self.rounds.exchange(request)


def check_compatible(gateway: TokenizerFingerprint, verifier: VerifierClient, drafter: DrafterClient | None) -> None:
    """Refuse to serve with a tokenizer anywhere that differs from the verifier's."""
    target = verifier.fingerprint
    if target is None:
        raise BackendError("the verifier reports no tokenizer fingerprint")
    diffs = gateway.differences(target)
    if diffs:
        raise BackendError("the gateway's tokenizer differs from the verifier's: " + "; ".join(diffs))
    if drafter is not None and drafter.kind == common_pb2.DRAFTER_KIND_MODEL:
        draft = drafter.fingerprint
        if draft is None:
            raise BackendError("the drafter reports no tokenizer fingerprint")
        diffs = draft.vocabulary_differences(target)
        if diffs:
            raise BackendError(
                f"refusing drafter at {drafter.address}: its tokenizer differs from the verifier's ("
                + "; ".join(diffs)
                + "); a draft model must share the target's vocabulary exactly"
            )
        if notes := draft.config_differences(target):
            # An instruct target over a base drafter: the target's end ids go with each sequence.
            log.info(
                "the drafter at %s is configured apart from the target (%s); the target's end ids count, "
                "and each sequence carries them to the drafter",
                drafter.address,
                "; ".join(notes),
            )
    feature_size = getattr(drafter, "feature_size", 0) if drafter is not None else 0
    if drafter is not None and feature_size and verifier.info is not None and feature_size != verifier.info.hidden_size:
        raise BackendError(
            f"refusing drafter at {drafter.address}: it reads hidden states of width {feature_size}, "
            f"the verifier's are {verifier.info.hidden_size or 'not reported'}; a feature drafter must be "
            "trained for this target (specd distill)"
        )
