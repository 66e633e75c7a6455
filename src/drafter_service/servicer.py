"""gRPC face of a drafter engine: protobuf in, engine call on the worker, protobuf out."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc

from drafter_service.engine import ModelDrafter, NgramDrafter
from specd.proto.speculative.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc
from specd.serving import EngineRunner, SequenceRpcs, ServiceMetrics, sequence_error
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
        return drafter_pb2.CloseDraftSequencesResponse(
            closed=await self.close_sequences(request.sequence_ids, request.ignore_unknown, context)
        )

    async def Draft(
        self, request_iterator: AsyncIterator[drafter_pb2.DraftRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[drafter_pb2.DraftResponse]:
        async for request in request_iterator:
            tasks = [
                DraftTask(t.sequence_id, list(t.new_token_ids), t.num_committed, t.num_draft_tokens)
                for t in request.tasks
            ]
            proposals, timings = await self.run_round(
                "drafter.draft",
                request.round_id,
                tasks,
                [t.trace_context for t in request.tasks],
                self.engine.draft,
                lambda sequence_id, error: DraftProposal(sequence_id, error=error),
                lambda t, p: {"specd.k": t.num_draft_tokens, "specd.proposed": len(p.tokens)},
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
                timings=timings,
            )
