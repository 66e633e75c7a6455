"""gRPC face of a drafter engine: protobuf in, engine call on the worker, protobuf out."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

import grpc

from drafter_service.engine import ModelDrafter, NgramDrafter
from specd.errors import EngineError, ErrorKind
from specd.proto.speculative.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc
from specd.serving import EngineRunner, SequenceRpcs, ServiceMetrics, sequence_error, trace_round
from specd.tasks import DraftProposal, DraftTask
from specd.tracing import Tracing

log = logging.getLogger(__name__)


class DrafterServicer(SequenceRpcs, drafter_pb2_grpc.DrafterServiceServicer):
    def __init__(
        self,
        engine: ModelDrafter | NgramDrafter,
        info: common_pb2.ModelInfo,
        runner: EngineRunner,
        tracing: Tracing,
        metrics: ServiceMetrics,
    ) -> None:
        self.engine = engine
        self.info = info
        self.kind = common_pb2.DRAFTER_KIND_NGRAM if engine.kind == "ngram" else common_pb2.DRAFTER_KIND_MODEL
        self.runner = runner
        self.tracing = tracing
        self.metrics = metrics

    async def GetDrafterInfo(self, request, context) -> drafter_pb2.GetDrafterInfoResponse:
        return drafter_pb2.GetDrafterInfoResponse(
            model=self.info,
            kind=self.kind,
            open_sequences=len(self.engine.table),
            kv_cache_bytes=self.engine.kv_bytes(),
        )

    async def OpenDraftSequences(self, request, context) -> drafter_pb2.OpenDraftSequencesResponse:
        return drafter_pb2.OpenDraftSequencesResponse(results=await self.open_sequences(request.sequences))

    async def CloseDraftSequences(self, request, context) -> drafter_pb2.CloseDraftSequencesResponse:
        return drafter_pb2.CloseDraftSequencesResponse(closed=await self.close_sequences(request.sequence_ids, context))

    async def Draft(
        self, request_iterator: AsyncIterator[drafter_pb2.DraftRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[drafter_pb2.DraftResponse]:
        async for request in request_iterator:
            arrived = time.perf_counter_ns()
            arrived_wall = time.time_ns()
            tasks = [
                DraftTask(t.sequence_id, list(t.new_token_ids), t.num_committed, t.num_draft_tokens)
                for t in request.tasks
            ]
            try:
                (proposals, timing), queue_ns = await self.runner.run(self.engine.draft, tasks)
                forward_ns = timing.forward_ns
            except Exception as exc:  # one bad round must not end the stream for every sequence
                log.exception("draft round %d failed", request.round_id)
                error = EngineError(ErrorKind.INTERNAL, f"draft failed: {exc}")
                proposals = [DraftProposal(t.sequence_id, error=error) for t in tasks]
                queue_ns = forward_ns = 0
                timing = None
            self.metrics.observe(timing)
            if self.tracing.enabled:
                trace_round(
                    self.tracing,
                    "drafter.draft",
                    [t.trace_context for t in request.tasks],
                    [
                        {
                            "specd.round_id": request.round_id,
                            "specd.batch_size": len(tasks),
                            "specd.k": t.num_draft_tokens,
                            "specd.proposed": len(p.tokens),
                            "specd.queue_ms": queue_ns / 1e6,
                        }
                        for t, p in zip(tasks, proposals, strict=True)
                    ],
                    arrived_wall,
                    time.time_ns(),
                    timing,
                )
            yield drafter_pb2.DraftResponse(
                round_id=request.round_id,
                proposals=[
                    drafter_pb2.DraftProposal(
                        sequence_id=p.sequence_id,
                        token_ids=p.tokens,
                        distributions=[
                            common_pb2.SparseDistribution(token_ids=d.token_ids, probs=d.probs) for d in p.dists
                        ],
                        error=sequence_error(p.error),
                    )
                    for p in proposals
                ],
                timings=common_pb2.ServiceTimings(
                    queue_ns=queue_ns, forward_ns=forward_ns, total_ns=time.perf_counter_ns() - arrived
                ),
            )
