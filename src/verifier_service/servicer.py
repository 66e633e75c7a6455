"""gRPC face of the VerifierEngine: protobuf in, engine call on the worker, protobuf out."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

import grpc

from specd.engine import hidden_states
from specd.engine.tasks import VerifyResult, VerifyTask
from specd.proto.speculative.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from specd.rpc.leases import Leases
from specd.rpc.service_metrics import ServiceMetrics
from specd.rpc.serving import EngineRunner, SequenceRpcs, dist_from_pb, token_logprob_pb
from specd.rpc.tracing import Tracing
from verifier_service.draft_join import Delivery, DraftJoin, Drafts, drafts_for
from verifier_service.engine import VerifierEngine

log = logging.getLogger(__name__)


class VerifierServicer(SequenceRpcs, verifier_pb2_grpc.VerifierServiceServicer):
    def __init__(
        self,
        engine: VerifierEngine,
        info: common_pb2.ModelInfo,
        runner: EngineRunner,
        tracing: Tracing,
        metrics: ServiceMetrics,
        leases: Leases,
    ) -> None:
        self.engine = engine
        self.info = info
        self.runner = runner
        self.tracing = tracing
        self.metrics = metrics
        self.leases = leases
        self.drafts = DraftJoin()  # the one-hop exchange's deliveries, joined with their verifies

    async def GetVerifierInfo(self, request, context) -> verifier_pb2.GetVerifierInfoResponse:
        return verifier_pb2.GetVerifierInfoResponse(
            model=self.info, open_sequences=len(self.engine.table), kv_cache_bytes=self.engine.kv_bytes()
        )

    async def OpenVerifySequences(self, request, context) -> verifier_pb2.OpenVerifySequencesResponse:
        return verifier_pb2.OpenVerifySequencesResponse(
            results=await self.open_sequences(request.sequences, request.lease_owner)
        )

    async def CloseVerifySequences(self, request, context) -> verifier_pb2.CloseVerifySequencesResponse:
        return verifier_pb2.CloseVerifySequencesResponse(
            closed=await self.close_sequences(request.sequence_ids, request.lease_owner, request.missing_ok, context)
        )

    async def KeepAlive(self, request, context) -> common_pb2.KeepAliveResponse:
        return await self.keep_alive(request.lease_owner, context)

    async def Attach(self, request, context) -> AsyncIterator[common_pb2.AttachResponse]:
        async for reply in self.attach(request.lease_owner, context):
            yield reply

    async def Deliver(
        self, request_iterator: AsyncIterator[verifier_pb2.DraftDelivery], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[verifier_pb2.DeliveryAck]:
        async for delivery in request_iterator:
            drafts = None if delivery.released else {d.sequence_id: _drafts(d) for d in delivery.drafts}
            error = self.drafts.deliver(delivery.lease_owner, delivery.round_id, drafts)
            if error:
                # Only refusals are answered: an answer to every delivery would be one more write
                # on the round's path, between the drafts' arrival and the verify they start.
                log.warning("refused drafts delivered for a round: %s", error)
                yield verifier_pb2.DeliveryAck(round_id=delivery.round_id, error=error)

    async def _delivered(
        self, request: verifier_pb2.VerifyRequest, context: grpc.aio.ServicerContext
    ) -> tuple[Delivery, int]:
        """The round's delivered drafts where a task awaits them ({} where none does), and the wait."""
        direct = [t for t in request.tasks if t.direct_drafts]
        if not direct:
            return {}, 0
        if not request.drafts_wait_ms or any(t.draft_token_ids for t in direct):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "a task that awaits its drafts (direct_drafts) carries none itself, and its round a drafts_wait_ms",
            )
        started = time.perf_counter_ns()
        delivery = await self.drafts.wait(request.lease_owner, request.round_id, request.drafts_wait_ms / 1000)
        return delivery, time.perf_counter_ns() - started

    async def Verify(
        self, request_iterator: AsyncIterator[verifier_pb2.VerifyRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[verifier_pb2.VerifyResponse]:
        async for request in request_iterator:
            owner = request.lease_owner
            ids = self.round_ids(owner, (t.sequence_id for t in request.tasks))
            delivery, waited_ns = await self._delivered(request, context)
            drafts = [
                drafts_for(t.direct_drafts, (delivery or {}).get(t.sequence_id))
                if t.direct_drafts
                else (list(t.draft_token_ids), [dist_from_pb(d) for d in t.draft_distributions])
                for t in request.tasks
            ]
            tasks = [
                VerifyTask(
                    sid,
                    t.num_committed,
                    tokens,
                    dists,
                    t.prefill_tokens,
                    t.return_hidden_states,
                    list(t.draft_parents),
                )
                for sid, t, (tokens, dists) in zip(ids, request.tasks, drafts, strict=True)
            ]
            results, timings = await self.run_round(
                "verifier.verify",
                request.round_id,
                tasks,
                [t.trace_context for t in request.tasks],
                self.engine.verify,
                lambda sequence_id, error: VerifyResult(sequence_id, error=error),
                lambda t, r: {"specd.k": len(t.draft_tokens), "specd.accepted": r.num_accepted},
            )
            self.metrics.hidden_rows.inc(sum(r.hidden.shape[0] for r in results if r.hidden is not None))
            yield verifier_pb2.VerifyResponse(
                round_id=request.round_id,
                results=[
                    verifier_pb2.VerifyResult(
                        sequence_id=t.sequence_id,
                        num_accepted=r.num_accepted,
                        next_token_id=r.next_token,
                        error=self.wire_error(r.error, owner),
                        logprobs=[token_logprob_pb(lp) for lp in r.logprobs],
                        prefill_pending=r.prefill_pending,
                        hidden_states=hidden_states.encode(r.hidden) if r.hidden is not None else b"",
                        hidden_start=r.hidden_start,
                        accepted_path=r.accepted_path,
                        direct_draft_token_ids=task.draft_tokens if t.direct_drafts else (),
                    )
                    for t, task, r in zip(request.tasks, tasks, results, strict=True)
                ],
                timings=timings,
                drafts_missing=delivery is None,
                drafts_wait_ns=waited_ns,
            )


def _drafts(delivered: verifier_pb2.DeliveredDrafts) -> Drafts:
    return Drafts(list(delivered.token_ids), [dist_from_pb(d) for d in delivered.distributions])
