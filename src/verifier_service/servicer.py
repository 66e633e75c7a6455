"""gRPC face of the VerifierEngine: protobuf in, engine call on the worker, protobuf out."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

import grpc

from specd.errors import EngineError, ErrorKind
from specd.proto.speculative.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from specd.serving import EngineRunner, SequenceRpcs, ServiceMetrics, dist_from_pb, sequence_error, trace_round
from specd.tasks import VerifyResult, VerifyTask
from specd.tracing import Tracing
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
    ) -> None:
        self.engine = engine
        self.info = info
        self.runner = runner
        self.tracing = tracing
        self.metrics = metrics

    async def GetVerifierInfo(self, request, context) -> verifier_pb2.GetVerifierInfoResponse:
        return verifier_pb2.GetVerifierInfoResponse(
            model=self.info, open_sequences=len(self.engine.table), kv_cache_bytes=self.engine.kv_bytes()
        )

    async def OpenVerifySequences(self, request, context) -> verifier_pb2.OpenVerifySequencesResponse:
        return verifier_pb2.OpenVerifySequencesResponse(results=await self.open_sequences(request.sequences))

    async def CloseVerifySequences(self, request, context) -> verifier_pb2.CloseVerifySequencesResponse:
        return verifier_pb2.CloseVerifySequencesResponse(
            closed=await self.close_sequences(request.sequence_ids, context)
        )

    async def Verify(
        self, request_iterator: AsyncIterator[verifier_pb2.VerifyRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[verifier_pb2.VerifyResponse]:
        async for request in request_iterator:
            arrived = time.perf_counter_ns()
            arrived_wall = time.time_ns()
            tasks = [
                VerifyTask(
                    t.sequence_id,
                    t.num_committed,
                    list(t.draft_token_ids),
                    [dist_from_pb(d) for d in t.draft_distributions],
                )
                for t in request.tasks
            ]
            try:
                (results, timing), queue_ns = await self.runner.run(self.engine.verify, tasks)
                forward_ns = timing.forward_ns
            except Exception as exc:  # one bad round must not end the stream for every sequence
                log.exception("verify round %d failed", request.round_id)
                error = EngineError(ErrorKind.INTERNAL, f"verify failed: {exc}")
                results = [VerifyResult(t.sequence_id, error=error) for t in tasks]
                queue_ns = forward_ns = 0
                timing = None
            self.metrics.observe(timing)
            if self.tracing.enabled:
                trace_round(
                    self.tracing,
                    "verifier.verify",
                    [t.trace_context for t in request.tasks],
                    [
                        {
                            "specd.round_id": request.round_id,
                            "specd.batch_size": len(tasks),
                            "specd.k": len(t.draft_tokens),
                            "specd.accepted": r.num_accepted,
                            "specd.queue_ms": queue_ns / 1e6,
                        }
                        for t, r in zip(tasks, results, strict=True)
                    ],
                    arrived_wall,
                    time.time_ns(),
                    timing,
                )
            yield verifier_pb2.VerifyResponse(
                round_id=request.round_id,
                results=[
                    verifier_pb2.VerifyResult(
                        sequence_id=r.sequence_id,
                        num_accepted=r.num_accepted,
                        next_token_id=r.next_token,
                        error=sequence_error(r.error),
                    )
                    for r in results
                ],
                timings=common_pb2.ServiceTimings(
                    queue_ns=queue_ns, forward_ns=forward_ns, total_ns=time.perf_counter_ns() - arrived
                ),
            )
