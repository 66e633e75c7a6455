"""gRPC face of a drafter engine: protobuf in, engine call on the worker, protobuf out."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc

from specd.engine.tasks import DraftBranch, DraftProposal, DraftTask, SparseDist
from specd.proto.speculative.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, verifier_pb2
from specd.rpc.delivery import DeliveryStream
from specd.rpc.leases import Leases
from specd.rpc.service_metrics import ServiceMetrics
from specd.rpc.serving import EngineRunner, SequenceRpcs
from specd.rpc.tracing import Tracing

if TYPE_CHECKING:
    from drafter_service.engine import ModelDrafter
    from drafter_service.ngram_engine import NgramDrafter
    from drafter_service.suffix_engine import SuffixDrafter

log = logging.getLogger(__name__)


def _dists_pb(dists: list[SparseDist]) -> list[common_pb2.SparseDistribution]:
    return [common_pb2.SparseDistribution(token_ids=d.token_ids, probs=d.probs) for d in dists]


def _branch_pb(branch: DraftBranch) -> drafter_pb2.DraftBranch:
    return drafter_pb2.DraftBranch(
        num_assumed=branch.num_assumed, token_ids=branch.tokens, distributions=_dists_pb(branch.dists)
    )


KINDS = {
    "model": common_pb2.DRAFTER_KIND_MODEL,
    "ngram": common_pb2.DRAFTER_KIND_NGRAM,
    "suffix": common_pb2.DRAFTER_KIND_SUFFIX,
}


class DrafterServicer(SequenceRpcs, drafter_pb2_grpc.DrafterServiceServicer):
    def __init__(
        self,
        engine: ModelDrafter | NgramDrafter | SuffixDrafter,
        info: common_pb2.ModelInfo,
        runner: EngineRunner,
        tracing: Tracing,
        metrics: ServiceMetrics,
        leases: Leases,
        delivery: DeliveryStream | None = None,
    ) -> None:
        self.engine = engine
        self.delivery = delivery  # to the verifier, for rounds that ask (the one-hop exchange)
        self.info = info
        self.kind = KINDS[engine.kind]
        self.runner = runner
        self.tracing = tracing
        self.metrics = metrics
        self.leases = leases

    async def GetDrafterInfo(self, request, context) -> drafter_pb2.GetDrafterInfoResponse:
        return drafter_pb2.GetDrafterInfoResponse(
            model=self.info,
            kind=self.kind,
            open_sequences=len(self.engine.table),
            kv_cache_bytes=self.engine.kv_bytes(),
            feature_size=getattr(self.engine, "feature_size", 0),
            delivers=self.delivery is not None,
        )

    async def OpenDraftSequences(self, request, context) -> drafter_pb2.OpenDraftSequencesResponse:
        return drafter_pb2.OpenDraftSequencesResponse(
            results=await self.open_sequences(request.sequences, request.lease_owner)
        )

    async def CloseDraftSequences(self, request, context) -> drafter_pb2.CloseDraftSequencesResponse:
        return drafter_pb2.CloseDraftSequencesResponse(
            closed=await self.close_sequences(
                request.sequence_ids,
                request.lease_owner,
                request.missing_ok,
                context,
                {t.sequence_id: (list(t.new_token_ids), t.num_committed) for t in request.tails},
            )
        )

    async def KeepAlive(self, request, context) -> common_pb2.KeepAliveResponse:
        return await self.keep_alive(request.lease_owner, context)

    async def Attach(self, request, context) -> AsyncIterator[common_pb2.AttachResponse]:
        async for reply in self.attach(request.lease_owner, context):
            yield reply

    async def Draft(
        self, request_iterator: AsyncIterator[drafter_pb2.DraftRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[drafter_pb2.DraftResponse]:
        async for request in request_iterator:
            owner = request.lease_owner
            ids = self.round_ids(owner, (t.sequence_id for t in request.tasks))
            tasks = [
                DraftTask(
                    sid,
                    list(t.new_token_ids),
                    t.num_committed,
                    t.num_draft_tokens,
                    tuple(t.assumed_token_ids),
                    t.prefill_tokens,
                    t.hidden_states,
                    t.hidden_start,
                    t.guess_first,
                    t.num_siblings,
                    t.num_branches,
                )
                for sid, t in zip(ids, request.tasks, strict=True)
            ]
            width = getattr(self.engine, "feature_size", 0)
            if width:
                self.metrics.hidden_rows.inc(sum(len(t.hidden_states) for t in request.tasks) // (2 * width))
            proposals, timings = await self.run_round(
                "drafter.draft",
                request.round_id,
                tasks,
                [t.trace_context for t in request.tasks],
                self.engine.draft,
                lambda sequence_id, error: DraftProposal(sequence_id, error=error),
                lambda t, p: {"specd.k": t.num_draft_tokens, "specd.proposed": len(p.tokens)},
            )
            response = drafter_pb2.DraftResponse(
                round_id=request.round_id,
                proposals=[
                    drafter_pb2.DraftProposal(
                        sequence_id=t.sequence_id,
                        token_ids=p.tokens,
                        distributions=_dists_pb(p.dists),
                        error=self.wire_error(p.error, owner),
                        prefill_pending=p.prefill_pending,
                        parents=p.parents,
                        branches=[_branch_pb(b) for b in p.branches],
                    )
                    for t, p in zip(request.tasks, proposals, strict=True)
                ],
                timings=timings,
            )
            if request.deliver_to_verifier:
                await self._deliver(response, owner, context)
            yield response

    async def _deliver(
        self, response: drafter_pb2.DraftResponse, owner: str, context: grpc.aio.ServicerContext
    ) -> None:
        """The round's drafts to the verifier, before its reply to the gateway: they are on the round's path."""
        if self.delivery is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "a round asked this drafter to deliver its drafts to the verifier, but it delivers to none "
                "(start it with --deliver-to)",
            )
        assert self.delivery is not None
        await self.delivery.send(delivery_of(response, owner))


def delivery_of(response: drafter_pb2.DraftResponse, owner: str) -> verifier_pb2.DraftDelivery:
    """What the verifier needs of a round's proposals: each drafted sequence's chain and its q."""
    return verifier_pb2.DraftDelivery(
        lease_owner=owner,
        round_id=response.round_id,
        drafts=[
            verifier_pb2.DeliveredDrafts(
                sequence_id=p.sequence_id, token_ids=p.token_ids, distributions=p.distributions
            )
            for p in response.proposals
            if p.token_ids and not p.error.code and not p.parents
        ],
    )
