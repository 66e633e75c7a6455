"""The real drafter and verifier engines as the gateway's backends, in process.

Each request goes through the services' own servicers (protobuf in, engine call on the
engine thread, protobuf out), as over gRPC, without a socket: the scheduler's rounds reach
the engines exactly as they would across the network, q included.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from drafter_service.engine import ModelDrafter
from drafter_service.servicer import DrafterServicer
from specd.engine.fingerprint import TokenizerFingerprint
from specd.proto.speculative.v1 import common_pb2, drafter_pb2, verifier_pb2
from specd.rpc.leases import Leases
from specd.rpc.service_metrics import ServiceMetrics
from specd.rpc.serving import EngineRunner, fingerprint_from_pb, fingerprint_pb
from specd.rpc.tracing import Tracing
from verifier_service.engine import VerifierEngine
from verifier_service.servicer import VerifierServicer

OWNER = "in-process-gateway"


class _NoContext:
    """The servicers abort through their context only on a bad owner or a failed close."""

    async def abort(self, code: Any, details: str) -> None:
        raise AssertionError(f"{code}: {details}")


async def _one(request: Any) -> AsyncIterator[Any]:
    yield request


def _info(engine: Any, max_sequences: int) -> common_pb2.ModelInfo:
    return common_pb2.ModelInfo(
        model_id="in-process",
        tokenizer=fingerprint_pb(engine.fingerprint),
        max_context=engine.max_context,
        model_vocab_size=engine.lm.vocab_size,
        max_sequences=max_sequences,
        max_draft_tokens=engine.max_draft_tokens,
    )


class _Backend:
    servicer: Any

    def __init__(self, name: str) -> None:
        self.address = f"in-process:{name}"
        self.timeout_s = 60.0
        self.runner = EngineRunner(name)

    async def healthy(self, timeout_s: float = 2.0) -> bool:
        return True

    @property
    def fingerprint(self) -> TokenizerFingerprint | None:
        """What the gateway's pair check reads, as a service reports it in its ModelInfo."""
        return fingerprint_from_pb(self.info.tokenizer)

    def reset_rounds(self) -> None:
        pass

    async def _round(self, method: Any, request: Any) -> Any:
        request.lease_owner = OWNER
        async for reply in method(_one(request), _NoContext()):
            return reply
        raise AssertionError("no reply")


class EngineVerifier(_Backend):
    def __init__(self, engine: VerifierEngine, max_sequences: int) -> None:
        super().__init__("verifier")
        self.info = _info(engine, max_sequences)
        metrics = ServiceMetrics("verifier", engine)
        self.servicer = VerifierServicer(engine, self.info, self.runner, Tracing("v"), metrics, Leases(0))

    async def open(self, specs: list[Any]) -> list[Any]:
        request = verifier_pb2.OpenVerifySequencesRequest(sequences=specs, lease_owner=OWNER)
        return list((await self.servicer.OpenVerifySequences(request, _NoContext())).results)

    async def close_sequences(self, ids: list[str], missing_ok: bool = True) -> None:
        await self.servicer.close_sequences(ids, OWNER, missing_ok, _NoContext())

    async def verify(self, request: verifier_pb2.VerifyRequest) -> verifier_pb2.VerifyResponse:
        return await self._round(self.servicer.Verify, request)


class EngineDrafter(_Backend):
    kind = common_pb2.DRAFTER_KIND_MODEL
    feature_size = 0

    def __init__(self, engine: ModelDrafter, max_sequences: int) -> None:
        super().__init__("drafter")
        self.info = _info(engine, max_sequences)
        metrics = ServiceMetrics("drafter", engine)
        self.servicer = DrafterServicer(engine, self.info, self.runner, Tracing("d"), metrics, Leases(0))

    async def open(self, specs: list[Any]) -> list[Any]:
        request = drafter_pb2.OpenDraftSequencesRequest(sequences=specs, lease_owner=OWNER)
        return list((await self.servicer.OpenDraftSequences(request, _NoContext())).results)

    async def close_sequences(self, ids: list[str], missing_ok: bool = True, tails=None) -> None:
        await self.servicer.close_sequences(ids, OWNER, missing_ok, _NoContext(), tails)

    async def draft(self, request: drafter_pb2.DraftRequest) -> drafter_pb2.DraftResponse:
        return await self._round(self.servicer.Draft, request)
