"""Step two of a round: the only I/O, where the drafter's and the verifier's work overlap.

`Exchange.run` carries out a `RoundPlan`: the drafts the verify needs now, then the verify,
and beside it (or after it, where the two services share cores) the drafts of the next round
and the drafter's opens and prefill chunks. It returns what the services answered
(`RoundResult`) and commits nothing; `apply` does.

The drafter's answers change the sequences' standing with the drafter as they arrive
(through the membership state machine): an open running beside a draft exchange must see
that exchange's failure, or it would open sequences on a drafter that is down.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from gateway.backends import BackendError, DrafterClient, VerifierClient
from gateway.metrics import RoundTimes
from gateway.round.decide import open_chunks, ready_block
from gateway.round.drafter_link import DrafterLink, not_found_error
from gateway.round.messages import (
    Block,
    DraftItem,
    DraftVerdicts,
    RoundPlan,
    draft_request,
    read_drafts,
    verify_request,
)
from gateway.round.prefill_budget import DrafterPrefillBudget
from specd.proto.speculative.v1 import common_pb2, drafter_pb2, verifier_pb2
from specd.rpc.serving import add_penalties_pb, logprobs_request_pb, sampling_pb
from specd.rpc.tracing import Tracing

log = logging.getLogger(__name__)


@dataclass
class DraftExchange:
    verdicts: DraftVerdicts
    timings: common_pb2.ServiceTimings
    elapsed_ns: int


@dataclass
class RoundResult:
    """What the services answered to one round's plan."""

    request: verifier_pb2.VerifyRequest
    reply: verifier_pb2.VerifyResponse
    blocks: dict[str, Block]  # the drafts each verified sequence's task was built from
    ks: dict[str, int]  # how many of them it carried
    pre: DraftExchange | None  # the drafts made before the verify (None: none, or the drafter failed)
    ahead_items: list[DraftItem]  # what was drafted, or prefilled, on the drafter beside the verify
    ahead: DraftExchange | None
    joined_tokens: int  # prompt tokens the drafter is sent to open joining sequences (beside the rounds)
    times: RoundTimes

    def ahead_drafted(self) -> list[int]:
        """Drafts asked per row of the exchange beside the verify, none if it failed: a fan-out's
        branches are rows of its forwards, one each the drafter proposed."""
        if self.ahead is None:
            return []
        rows = []
        for item in self.ahead_items:
            if not item.prefill:
                proposal = self.ahead.verdicts.proposals.get(item.seq.id)
                rows += [item.num_draft_tokens] * (1 + (len(proposal.branches) if proposal is not None else 0))
        return rows


async def settle(task: asyncio.Task[Any] | None) -> BaseException | None:
    """Wait for a task beside the verify; its exception, if it failed."""
    if task is None:
        return None
    try:
        await task
    except BaseException as exc:
        return exc
    return None


def spec(seq: Any, prefill_tokens: int | None = None, ends: Sequence[int] = ()) -> common_pb2.SequenceSpec:
    """The sequence as committed so far (prompt plus any output), for opening it on a service.

    `prefill_tokens`: prefill that many tokens at the open and the rest in rounds (None: all).
    `ends`: the ids the gateway stops it on (the target's), so a drafter stops there too; none
    are sent for an ignore_eos sequence, which goes on past them.
    """
    return common_pb2.SequenceSpec(
        sequence_id=seq.id,
        prompt_token_ids=seq.tokens,
        sampling=add_penalties_pb(sampling_pb(seq.params.sampling), seq.params.penalties),
        num_generated=len(seq.output),
        logprobs=logprobs_request_pb(seq.params.logprobs),
        json_schema=seq.params.json_schema,
        grammar=seq.params.grammar,
        prefill_tokens=prefill_tokens,
        tenant=seq.tenant,
        end_token_ids=() if seq.params.ignore_eos else ends,
        # The service's open span joins the request's trace.
        trace_context=Tracing.inject(seq.span) if getattr(seq, "span", None) is not None else None,
    )


def assume_block(item: DraftItem, blocks: dict[str, Block], ks: dict[str, int]) -> DraftItem:
    """A draft-ahead item assumes the block now being verified is accepted whole (its branches
    assume the likeliest other verdicts on it)."""
    if item.assumed is None:  # not verified this round (cohort): nothing to assume
        return item
    block = blocks.get(item.seq.id)
    k = ks.get(item.seq.id, 0)
    assumed = tuple(block.tokens[:k]) if block is not None else ()
    return replace(item, assumed=assumed)


async def close_quietly(backend: Any, ids: list[str]) -> None:
    try:
        await backend.close_sequences(ids)
    except Exception as exc:  # a backend that lost them already freed them
        log.debug("close on %s failed: %s", getattr(backend, "name", backend), exc)


class Exchange:
    """The round's RPCs to the two services, and the drafter's side of a sequence's membership."""

    def __init__(
        self,
        verifier: VerifierClient,
        drafter: DrafterClient | None,
        drafter_link: DrafterLink | None,
        drafter_prefill: DrafterPrefillBudget,
        overlap: bool,
        active: Callable[[], list[Any]],
        ends: Sequence[int] = (),
    ) -> None:
        self.verifier = verifier
        self.ends = tuple(sorted(ends))  # the end ids every open carries
        self.drafter = drafter
        self.drafter_link = drafter_link
        self.drafter_prefill = drafter_prefill
        # Whether the drafter's work runs while the verifier works, or after it (see Scheduler).
        self.overlap = overlap
        self._active = active  # the running sequences, which a drafter failure affects
        # The drafter's prefill (joins' opens, chunks) started by a round and run beside the later
        # ones: a round never waits for it, so a joining prompt never stalls the running streams.
        self.fill_task: asyncio.Task[int] | None = None
        self.fill_ids: set[str] = set()  # the sequences it prefills
        self._closers: set[asyncio.Task[None]] = set()  # closes of finished sequences waiting for it
        # The one-hop exchange (gateway/round/direct.py), which runs the rounds it takes; None: off.
        self.direct: Callable[[RoundPlan, int, dict[str, dict[str, str]]], Awaitable[RoundResult | None]] | None = None

    async def run(self, plan: RoundPlan, round_id: int, contexts: dict[str, dict[str, str]]) -> RoundResult:
        if self.direct is not None and (result := await self.direct(plan, round_id, contexts)) is not None:
            return result
        started = time.perf_counter_ns()
        # 1. Drafts the verify needs now.
        blocks = {s.id: b for s in plan.verify if (b := ready_block(s)) is not None}
        pre = await self.draft(round_id, plan.pre_draft, contexts) if plan.pre_draft else None
        for item in plan.pre_draft if pre is not None else ():
            proposal = pre.verdicts.proposals.get(item.seq.id)
            if proposal is not None:
                blocks[item.seq.id] = Block(
                    list(proposal.token_ids),
                    list(proposal.distributions),
                    len(item.seq.tokens),
                    parents=tuple(proposal.parents),
                )
        ks = {s.id: min(plan.ks.get(s.id, 0), blocks[s.id].chain) if s.id in blocks else 0 for s in plan.verify}
        draft_done = time.perf_counter_ns()
        # 2. The verify, and meanwhile the drafts of the next round.
        ahead_items = [
            assume_block(item, blocks, ks) for item in plan.ahead if item.seq.drafter.drafting and not item.seq.done
        ]
        request = verify_request(round_id, plan.verify, blocks, ks, contexts, plan.prefill)
        reply, ahead, joined_tokens, marks = await self._verify(plan, round_id, request, ahead_items, contexts)
        replied, verified, joined = marks
        times = RoundTimes(
            round_ns=time.perf_counter_ns() - started,
            draft_ns=draft_done - started,
            verify_ns=verified - draft_done,
            verify_reply_ns=replied - draft_done,
            join_ns=joined - verified,
            drafter_ns=pre.timings.total_ns if pre else 0,
            verifier_ns=reply.timings.total_ns,
            drafter_forward_ns=pre.timings.forward_ns if pre else 0,
            verifier_forward_ns=reply.timings.forward_ns,
            overlap_ns=ahead.elapsed_ns if ahead else 0,
            overlap_forward_ns=ahead.timings.forward_ns if ahead else 0,
        )
        return RoundResult(request, reply, blocks, ks, pre, ahead_items, ahead, joined_tokens, times)

    async def _verify(
        self,
        plan: RoundPlan,
        round_id: int,
        request: verifier_pb2.VerifyRequest,
        ahead_items: list[DraftItem],
        contexts: dict[str, dict[str, str]],
    ) -> tuple[verifier_pb2.VerifyResponse, DraftExchange | None, int, tuple[int, int, int]]:
        """The verify, with the drafts ahead beside it (or after it), and the drafter's prefill
        started beside the rounds; the reply, the ahead drafts, the tokens the prefill started
        this round was sent, and when the verify replied and each side settled."""
        ahead_task: asyncio.Task[Any] | None = None
        filling = [item.seq for item in plan.fill]
        budget = plan.drafter_prefill or self.drafter_prefill.tokens()
        chunks = open_chunks(plan.join, filling, "drafter_prefill_pending", budget) if plan.join else {}

        def drafter_work() -> asyncio.Task[Any] | None:
            if plan.join or plan.fill:
                fill = self.fill(round_id, plan.join, chunks, plan.fill, alone=not ahead_items)
                self.fill_task = asyncio.create_task(fill)
                self.fill_ids = {s.id for s in [*plan.join, *filling]}
            return asyncio.create_task(self.draft(round_id, ahead_items, contexts)) if ahead_items else None

        if self.overlap:
            ahead_task = drafter_work()
        try:
            reply = await self.verifier.verify(request)
            replied = time.perf_counter_ns()
            if not self.overlap:
                ahead_task = drafter_work()
        finally:
            # Settled whatever the verify did, so no draft exchange outlives its round. The
            # drafter's prefill does, and is not waited for, except where the two services share
            # cores: there it would only slow the next verify, so it runs alone after this one.
            ahead_failure = await settle(ahead_task)
            verified = time.perf_counter_ns()
            if not self.overlap:
                await self.settle_fill()
            joined = time.perf_counter_ns()
        if ahead_failure is not None:
            raise ahead_failure
        ahead = ahead_task.result() if ahead_task is not None else None
        # A drafter that is down opens none of them (they join once it is back).
        down = self.drafter_link is not None and not self.drafter_link.up
        tokens = 0 if down else sum(chunks.get(s.id, len(s.tokens) - 1) for s in plan.join)
        return reply, ahead, tokens, (replied, verified, joined)

    @property
    def filling(self) -> bool:
        """Whether the drafter's prefill an earlier round started is still running."""
        return self.fill_task is not None and not self.fill_task.done()

    async def settle_fill(self) -> None:
        """Wait for the drafter's prefill in flight (its failures are the drafter's, handled there).
        A cancellation of the caller reaches the caller: it is not the prefill's failure."""
        task, self.fill_task = self.fill_task, None
        if task is None:
            return
        await asyncio.wait([task])
        if not task.cancelled() and task.exception() is not None:
            log.warning("the drafter's prefill failed: %s", task.exception())

    def hold_closes(self, seqs: list[Any]) -> list[Any]:
        """Of `seqs`, finished, those the drafter's prefill in flight holds: each is closed on the
        drafter once that prefill lands, so that its open or chunk does not overtake the close.
        No round waits for it: a drafter that froze mid-prefill would stall every stream."""
        task = self.fill_task
        held = [s for s in seqs if s.id in self.fill_ids] if task is not None and not task.done() else []
        if task is not None and held:
            closer = asyncio.create_task(self._close_after(task, held))
            self._closers.add(closer)
            closer.add_done_callback(self._closers.discard)
        return held

    async def _close_after(self, task: asyncio.Task[int], held: list[Any]) -> None:
        await asyncio.wait([task])
        # A prefill that failed left them off the drafter (its ids are closed once it is back).
        ids = [s.id for s in held if s.drafter.on_drafter]
        if ids:
            await self.close_on_drafter(ids)

    async def stop_fill(self) -> None:
        """At shutdown: the drafter's prefill in flight is cancelled, and the closes held for it sent."""
        if self.fill_task is not None:
            self.fill_task.cancel()
            await self.settle_fill()
        if self._closers:
            await asyncio.wait(set(self._closers))

    def fill(
        self, round_id: int, join: list[Any], chunks: dict[str, int], items: list[DraftItem], alone: bool
    ) -> Coroutine[Any, Any, int]:
        """The drafter's prefill a round starts, to run beside the later rounds: the opens of `join`
        (each prefilling its share, `chunks`) and the chunks `items` of sequences opened earlier.
        Each sequence drafts once its drafter prefill is done, and is verified target-only until
        then. The chunks' request is built now: it carries the tokens their sizes were planned for,
        not those the rounds commit before it is sent (a chunk would then never catch up)."""
        request = draft_request(round_id, items, {}) if items else None

        if not items:
            return self.join(join, [], alone=alone, chunks=chunks)
        if not join:  # as one coroutine: a fill done sooner lets the next round prefill more
            return self._fill_chunks(round_id, items, request)

        async def both() -> int:
            opens = self.join(join, [item.seq for item in items], alone=False, chunks=chunks)
            joined, chunked = await asyncio.gather(opens, self._fill_chunks(round_id, items, request))
            return joined + chunked

        return both()

    async def _fill_chunks(
        self, round_id: int, items: list[DraftItem], request: drafter_pb2.DraftRequest | None
    ) -> int:
        """One prefill-only draft exchange; returns the prompt tokens it prefilled."""
        if not items:
            return 0
        exchange = await self.draft(round_id, items, {}, request)
        if exchange is None:
            return 0
        for item in items:
            proposal = exchange.verdicts.proposals.get(item.seq.id)
            if proposal is not None and item.seq.drafter.on_drafter:
                item.seq.drafter_prefill_pending = proposal.prefill_pending
        prefilled = sum(item.prefill for item in items)
        self.drafter_prefill.observe_prefill(prefilled, exchange.elapsed_ns)
        return prefilled

    async def draft(
        self,
        round_id: int,
        items: list[DraftItem],
        contexts: dict[str, dict[str, str]],
        request: drafter_pb2.DraftRequest | None = None,
    ) -> DraftExchange | None:
        """One draft exchange (`request`: built earlier from `items`); a failed drafter marks
        itself down and the round goes on without drafts."""
        assert self.drafter is not None
        started = time.perf_counter_ns()
        request = request or draft_request(round_id, items, contexts)
        try:
            reply = await self.drafter.draft(request)
        except BackendError as exc:
            # Speculation is an optimisation: without drafts the round still makes progress.
            self.drafter_failed(str(exc))
            return None
        verdicts = read_drafts(items, reply)
        if verdicts.protocol_error:
            self.drafter_failed(verdicts.protocol_error)
            return None
        if self.drafter_link is not None:
            self.drafter_link.succeeded()
        for s, reason in verdicts.lost:
            self.rejoin(s, reason)
        for s, reason in verdicts.refused:
            log.warning("drafter refused %s: %s; continuing target-only", s.id, reason)
            s.drafter.park()
        for item, task in zip(items, request.tasks, strict=True):
            # An open failing beside this exchange may have marked the drafter down meanwhile.
            if item.seq.id in verdicts.proposals and item.seq.drafter.on_drafter:
                # What the task carried: a prefill beside the rounds sees tokens committed meanwhile.
                item.seq.drafter.synced_to(task.num_committed)
                hidden = item.seq.hidden
                if hidden is not None:
                    item.seq.drafter.sent_hidden(task.hidden_start + len(task.hidden_states) // hidden.row_bytes)
        return DraftExchange(verdicts, reply.timings, time.perf_counter_ns() - started)

    async def join(
        self,
        joining: list[Any],
        filling: list[Any],
        alone: bool,
        chunks: dict[str, int] | None = None,
        budget: int = 0,
    ) -> int:
        """Open `joining` on the drafter beside the verify, with their committed tokens as they are now;
        returns how many prompt tokens the drafter was sent to open them (0 if none was).

        They draft from a later round (with chunked prefill, once their drafter prefill is done);
        the tokens the verify commits meanwhile reach the drafter with their next task. `alone`:
        the drafter has no other exchange this round, so the open's time is its prefill's.
        `chunks`: what each prefills at its open (one missing: whole); default: their share of
        `budget`, the round's drafter prefill tokens (0: what fits behind a verify).
        """
        if not joining or self.drafter is None:
            return 0
        if self.drafter_link is not None and not (self.drafter_link.up and await self.drafter_link.flush_stale()):
            return 0  # they stay pending: they join once the drafter is back
        if chunks is None:
            budget = budget or self.drafter_prefill.tokens()
            chunks = open_chunks(joining, filling, "drafter_prefill_pending", budget)
        specs = [spec(s, chunks.get(s.id), self.ends) for s in joining]
        opened = time.perf_counter_ns()
        try:
            results = await self.drafter.open(specs)
            if [r.sequence_id for r in results] != [s.id for s in joining]:
                raise BackendError("the drafter answered an open out of protocol")
        except Exception as exc:
            self.drafter_failed(f"open failed: {exc}", [s.id for s in joining])
            return 0
        if self.drafter_link is not None and not self.drafter_link.up:
            # The draft exchange beside this open failed meanwhile: what the open made is closed
            # with the other stale ids once the drafter is back, and these join again then.
            self.drafter_link.stale.update(s.id for s, r in zip(joining, results, strict=True) if not r.error.code)
            return 0
        elapsed = time.perf_counter_ns() - opened
        self._joined(joining, specs, results, chunks)
        prefilled = sum(chunks.get(sp.sequence_id, len(sp.prompt_token_ids) - 1) for sp in specs)
        if alone:
            self.drafter_prefill.observe_prefill(prefilled, elapsed)
        return prefilled

    @staticmethod
    def _joined(joining: list[Any], specs: list[Any], results: Sequence[Any], chunks: dict[str, int]) -> None:
        for s, sp, r in zip(joining, specs, results, strict=True):
            if r.error.code:
                log.warning("drafter refused %s: %s; it runs target-only", s.id, r.error.message)
                s.drafter.refused()
            else:
                s.drafter.opened(len(sp.prompt_token_ids))
                s.drafter_prefill_pending = r.prefill_pending if s.id in chunks else 0

    async def close_finished(self, seqs: list[Any]) -> None:
        """Close finished sequences on the drafter with the tokens it was not sent (DraftTail), so
        that a drafter learning from responses (the suffix drafter) learns them whole."""
        tails = {s.id: (s.tokens[s.drafter.synced :], len(s.tokens)) for s in seqs}
        await self.close_on_drafter([s.id for s in seqs], tails)

    async def close_on_drafter(self, ids: list[str], tails: Mapping[str, tuple[list[int], int]] | None = None) -> None:
        """Close `ids` on the drafter; `tails`: finished sequences' tokens it has not been sent."""
        assert self.drafter is not None and self.drafter_link is not None
        try:
            await self.drafter.close_sequences(ids, tails=tails) if tails else await self.drafter.close_sequences(ids)
        except Exception as exc:
            if not_found_error(exc):
                return
            # Closed once the drafter answers again, before any id is reused there.
            self.drafter_link.stale.update(ids)
            log.debug("close on the drafter failed: %s", exc)

    def drafter_failed(self, reason: str, also_open: Sequence[str] = ()) -> None:
        """Continue every sequence target-only; they re-open on the drafter once it is back."""
        assert self.drafter_link is not None
        lost = [s for s in self._active() if s.drafter.on_drafter]
        for s in lost:
            s.drafter.drafter_down()
        self.drafter_link.mark_down(reason, [*(s.id for s in lost), *also_open])

    def rejoin(self, seq: Any, reason: str) -> None:
        """The drafter lost this sequence (it restarted between two rounds): open it there again."""
        assert self.drafter_link is not None
        log.warning("drafter lost %s (%s); re-opening it there", seq.id, reason)
        seq.drafter.lost()
        self.drafter_link.stale.add(seq.id)
