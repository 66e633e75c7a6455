"""The one-hop exchange (`--exchange direct`): a round's drafts go from the drafter to the verifier.

In the gateway exchange a sequential round crosses the network four times on its critical path:
the gateway asks the drafter, the drafts come back, the gateway sends them to the verifier, the
verdicts come back. Here the gateway sends both services their part of the round at once: the
drafter its draft tasks, marked to be delivered (`DraftRequest.deliver_to_verifier`), and the
verifier its verify tasks without their drafts, each saying how many it awaits
(`VerifyTask.direct_drafts`). The drafter sends its drafts to the verifier itself, which joins the
two by round id and answers the gateway: three crossings (docs/architecture.md, "One hop per round").

The drafter answers the gateway too, beside the verify, so its side of each sequence (synced
tokens, lost or refused sequences) is kept as in the gateway exchange. The verdicts are read
against what the verifier verified (`VerifyResult.direct_draft_token_ids`), never against what the
gateway was told: the two differ where the drafts came late. A drafter that fails mid-round is
marked down as ever and the gateway releases the round at the verifier, which then verifies at
once without drafts; one that is only late costs the round its drafts after the verifier's wait,
and is marked down unless it has answered the gateway by then.

Only the plain sequential round goes this way: drafts of a chain continuing the committed tokens,
before the verify, and no draft-ahead beside it. Token trees, fan-outs and draft-ahead rounds take
the gateway exchange, round by round.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from gateway.backends import BackendError
from gateway.metrics import RoundTimes
from gateway.round.decide import ready_block
from gateway.round.exchange import DraftExchange, Exchange, RoundResult, settle
from gateway.round.messages import Block, DraftItem, ProtocolError, RoundPlan, draft_request, verify_request
from specd.proto.speculative.v1 import verifier_pb2

log = logging.getLogger(__name__)


def qualifies(plan: RoundPlan) -> bool:
    """Whether this round's drafts can go straight to the verifier: drafts made before the verify,
    each a chain continuing the committed tokens, and nothing drafted beside the verify."""
    return (
        bool(plan.pre_draft)
        and not plan.ahead
        and all(
            item.assumed is None and not item.prefill and not item.siblings and not item.branches
            for item in plan.pre_draft
        )
    )


def await_drafts(request: verifier_pb2.VerifyRequest, items: list[DraftItem], ks: dict[str, int]) -> int:
    """Mark the verify tasks whose drafts the drafter delivers (at most the round's k of each);
    returns how many tasks await them."""
    drafting = {item.seq.id for item in items}
    awaiting = 0
    for task in request.tasks:
        k = ks.get(task.sequence_id, 0)
        if task.sequence_id in drafting and k > 0 and not task.prefill_tokens and not task.draft_token_ids:
            task.direct_drafts = k
            awaiting += 1
    return awaiting


def take_delivered(request: verifier_pb2.VerifyRequest, reply: verifier_pb2.VerifyResponse) -> dict[str, int]:
    """Write into the request the delivered drafts the verifier verified, so that the round reads
    as if they had been sent with it; returns how many each sequence carried."""
    if len(reply.results) != len(request.tasks):
        raise ProtocolError("the verifier answered a round out of protocol")
    carried = {}
    for task, result in zip(request.tasks, reply.results, strict=True):
        got = result.direct_draft_token_ids
        if len(got) > task.direct_drafts:
            raise ProtocolError(f"the verifier verified {len(got)} delivered drafts of {task.direct_drafts} awaited")
        if task.direct_drafts:
            task.draft_token_ids.extend(got)
            carried[task.sequence_id] = len(got)
    return carried


class DirectRound:
    """Runs the rounds that qualify over the one-hop exchange; `Exchange.run` calls it first."""

    def __init__(
        self,
        exchange: Exchange,
        release: Callable[[int], Awaitable[Any]],
        wait_s: float,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.exchange = exchange
        self.release = release  # tells the verifier a round gets no drafts (its drafter failed)
        self.wait_ms = max(1, round(wait_s * 1000))  # the verifier's wait for a round's drafts
        self.rounds = Counter("specd_one_hop_rounds", "Rounds run over the one-hop exchange", registry=registry)
        self.missed = Counter(
            "specd_one_hop_missed_rounds",
            "One-hop rounds verified without their drafts: the drafter's missed the verifier's wait, or it failed",
            registry=registry,
        )

    async def __call__(self, plan: RoundPlan, round_id: int, contexts: dict[str, dict[str, str]]) -> RoundResult | None:
        """The round over the one-hop exchange; None where it does not qualify (the gateway exchange runs it)."""
        link = self.exchange.drafter_link
        if not qualifies(plan) or self.exchange.drafter is None or (link is not None and not link.up):
            return None
        started = time.perf_counter_ns()
        blocks = {s.id: b for s in plan.verify if (b := ready_block(s)) is not None}
        ks = {s.id: min(plan.ks.get(s.id, 0), blocks[s.id].chain) if s.id in blocks else 0 for s in plan.verify}
        request = verify_request(round_id, plan.verify, blocks, ks, contexts, plan.prefill)
        if not await_drafts(request, plan.pre_draft, plan.ks):
            return None
        self.rounds.inc()
        request.drafts_wait_ms = self.wait_ms
        asked = draft_request(round_id, plan.pre_draft, contexts)
        asked.deliver_to_verifier = True
        drafting = asyncio.create_task(self._draft(round_id, plan.pre_draft, asked))
        # The drafts are on the round's path and the verify waits for them: the draft request goes first.
        await asyncio.sleep(0)
        reply: verifier_pb2.VerifyResponse | None = None
        try:
            reply, ahead, joined_tokens, marks = await self.exchange._verify(plan, round_id, request, [], contexts)
        finally:
            # Settled whatever the verify did, so that no draft exchange outlives its round.
            pre = await self._settle(drafting, reply)
        replied, verified, joined = marks
        for sid, k in take_delivered(request, reply).items():
            ks[sid] = k
        blocks.update(delivered_blocks(plan.pre_draft, pre))
        # The drafting the round waited for: the verifier's wait for its delivery.
        exchange_ns = verified - started
        draft_ns = min(reply.drafts_wait_ns, exchange_ns)
        times = RoundTimes(
            round_ns=time.perf_counter_ns() - started,
            draft_ns=draft_ns,
            verify_ns=exchange_ns - draft_ns,
            verify_reply_ns=replied - started - draft_ns,
            join_ns=joined - verified,
            drafter_ns=pre.timings.total_ns if pre else 0,
            verifier_ns=reply.timings.total_ns,
            drafter_forward_ns=pre.timings.forward_ns if pre else 0,
            verifier_forward_ns=reply.timings.forward_ns,
        )
        return RoundResult(request, reply, blocks, ks, pre, [], ahead, joined_tokens, times)

    async def _draft(self, round_id: int, items: list[DraftItem], asked: Any) -> DraftExchange | None:
        exchange = await self.exchange.draft(round_id, items, {}, asked)
        if exchange is None:  # the drafter failed (and is marked down): the verifier need not wait
            await self.release(round_id)
        return exchange

    async def _settle(
        self, drafting: asyncio.Task[DraftExchange | None], reply: verifier_pb2.VerifyResponse | None
    ) -> DraftExchange | None:
        """The drafter's answer to the gateway. Where its drafts missed the verifier's wait and it has
        not answered yet, it is late: the round does not wait for it, and it is marked down."""
        if reply is not None and reply.drafts_missing:
            self.missed.inc()
            if not drafting.done():
                drafting.cancel()
                await settle(drafting)
                self.exchange.drafter_failed(f"its drafts missed the verifier's wait of {self.wait_ms} ms")
                return None
        failure = await settle(drafting)
        if failure is not None:
            log.warning("the drafter's side of a one-hop round failed: %s", failure)
            return None
        return drafting.result()


def delivered_blocks(items: list[DraftItem], pre: DraftExchange | None) -> dict[str, Block]:
    """The blocks the drafter proposed this round, as it answered the gateway."""
    if pre is None:
        return {}
    blocks = {}
    for item in items:
        proposal = pre.verdicts.proposals.get(item.seq.id)
        if proposal is not None:
            blocks[item.seq.id] = Block(list(proposal.token_ids), list(proposal.distributions), len(item.seq.tokens))
    return blocks


def one_hop(
    exchange: Exchange, verifier: Any, drafter: Any, wait_s: float, registry: CollectorRegistry | None = None
) -> DirectRound:
    """Switch `exchange` to the one-hop exchange, against pools of one replica each (as the gateway's
    configuration requires); refused where the drafter delivers to no verifier."""
    (drafter_replica,) = drafter.replicas.values()
    if not drafter_replica.client.delivers:
        raise BackendError(
            f"--exchange direct: the drafter at {drafter_replica.address} delivers to no verifier; start it with "
            f"--deliver-to {next(iter(verifier.replicas.values())).address}"
        )
    (verifier_replica,) = verifier.replicas.values()
    direct = DirectRound(exchange, verifier_replica.client.release, wait_s, registry)
    exchange.direct = direct
    return direct
