"""A long-lived Deliver stream to one verifier: the one-hop exchange's drafts (docs/architecture.md).

The drafter writes each round's drafts on it, and the gateway a release of a round whose drafter
failed. A write is all a round waits for: the verifier answers only a delivery it refuses (a round
it does not await: late, or never asked), read beside and logged with its reason.
A broken stream is dropped and reopened on the next write; the round it failed goes without drafts
at the verifier, whose wait for them is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import grpc

from specd.proto.speculative.v1 import verifier_pb2, verifier_pb2_grpc

log = logging.getLogger(__name__)

WRITE_ERRORS = (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError, TimeoutError)


class DeliveryStream:
    def __init__(
        self,
        channel: grpc.aio.Channel,
        metadata: tuple[tuple[str, str], ...],
        timeout_s: float,
        on_refused: Callable[[str], None] = lambda reason: None,
    ) -> None:
        self._stub = verifier_pb2_grpc.VerifierServiceStub(channel)
        self._metadata = metadata
        self._timeout_s = timeout_s
        self._on_refused = on_refused
        self._call: grpc.aio.StreamStreamCall | None = None
        self._reader: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

    async def send(self, delivery: verifier_pb2.DraftDelivery) -> bool:
        """Write one delivery; False where the stream failed (it is reopened on the next)."""
        async with self._lock:
            if self._call is None:
                self._call = self._stub.Deliver(metadata=self._metadata)
                self._reader = asyncio.create_task(self._read(self._call), name="specd-delivery-acks")
            try:
                async with asyncio.timeout(self._timeout_s):
                    await self._call.write(delivery)
            except WRITE_ERRORS as exc:
                log.warning("delivering round %d's drafts to the verifier failed: %s", delivery.round_id, exc)
                self.reset()
                return False
            return True

    async def _read(self, call: grpc.aio.StreamStreamCall) -> None:
        try:
            while (ack := await call.read()) is not grpc.aio.EOF:
                log.warning("the verifier refused round %d's drafts: %s", ack.round_id, ack.error)
                self._on_refused(ack.error)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                log.warning("the verifier's delivery stream ended: %s: %s", exc.code().name, exc.details())

    def reset(self) -> None:
        if self._call is not None:
            self._call.cancel()
        self._call = None

    async def close(self) -> None:
        self.reset()
        if self._reader is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
