"""Continuous batching of speculative rounds across all active sequences.

Every round makes one drafter exchange and one verifier exchange for the whole
batch: new requests join at the next round, finished ones leave. The verifier
is the source of truth for committed tokens; the drafter is told at each round
what was committed since its last round and rolls its cache back to match.

The Scheduler keeps admission, queueing and the loop; a round is four steps, each
in its own module (docs/architecture.md, "The round" draws them):

    plan = decide(...)                   round/decide.py    what each sequence does; no I/O
    result = await exchange.run(plan)    round/exchange.py  the RPCs, drafter beside verifier
    applied = apply(plan, result)        round/apply.py     commit verdicts, keep/drop blocks
    observe(...)                         round/observer.py  spans, metrics, policy learning

A sequence's life is the state machine of round/state.py (with round/membership.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from opentelemetry.trace import SpanKind

from gateway.backends import BackendError, DrafterClient, VerifierClient, within
from gateway.failures import CANCELLED, GenerationError, InvalidParameter, open_error, unavailable
from gateway.metrics import GatewayMetrics, stats_line
from gateway.round.apply import Applied, apply, drop_stale_blocks, internal_error
from gateway.round.decide import Limits, decide, early_joins, open_chunks, speculation, width_refusal
from gateway.round.detokenize import TextStream
from gateway.round.drafter_link import DrafterLink
from gateway.round.exchange import Exchange, RoundResult, close_quietly, settle, spec
from gateway.round.hidden_log import HiddenLog
from gateway.round.messages import ProtocolError, RoundPlan
from gateway.round.observer import RoundObserver, RoundOutcome
from gateway.round.pipeline_choice import MODES
from gateway.round.prefill_budget import DrafterPrefillBudget
from gateway.round.shares import Shares, fairest
from gateway.round.speculation import PolicyConfig, SpeculationPolicy
from gateway.round.state import Delta, Event, Failed, Finished, GenerationParams, _Sequence, fail, opened
from specd.rpc.serving import token_logprob_from_pb
from specd.rpc.tracing import Tracing

# The sequence and its events are the API modules' to import from here.
__all__ = ["PIPELINES", "Delta", "Event", "Failed", "Finished", "GenerationParams", "Scheduler", "_Sequence"]

log = logging.getLogger(__name__)


# How long stopping waits for the services to confirm closes; the leases free the rest.
CLOSE_ON_STOP_S = 5.0

PIPELINES = (*MODES, "auto")  # auto: the policy picks one of MODES each round


class Scheduler:
    def __init__(
        self,
        tokenizer: Any,
        verifier: VerifierClient,
        drafter: DrafterClient | None,
        num_speculative_tokens: int,
        max_batch: int,
        eos_token_ids: Sequence[int],
        metrics: GatewayMetrics | None = None,
        tracing: Tracing | None = None,
        speculative_mode: str = "auto",
        disable_by_batch_size: int = 0,
        policy_off: frozenset[str] = frozenset(),
        max_waiting: int = 0,
        max_sequences_per_key: int = 0,
        request_timeout_s: float = 0.0,
        pipeline: str = "sequential",
        siblings: int = 0,
        branches: int = 0,
        prefill_chunk_tokens: int = 0,
        drafter_overlap: bool = True,
    ) -> None:
        if pipeline not in PIPELINES:
            raise ValueError(f"pipeline must be one of {', '.join(PIPELINES)}, got {pipeline!r}")
        self.tokenizer = tokenizer
        self.verifier = verifier
        self.drafter = drafter
        self.k = num_speculative_tokens
        self.max_batch = max_batch
        self.eos = frozenset(eos_token_ids)
        self._fit_to_services(verifier, drafter)
        self.waiting: deque[_Sequence] = deque()
        self.active: list[_Sequence] = []
        self._wakeup = asyncio.Event()
        self._round_ids = itertools.count(1)
        self._task: asyncio.Task[None] | None = None
        self._stats_task: asyncio.Task[None] | None = None
        self.metrics = metrics or GatewayMetrics(self.k_limit)
        self.tracing = tracing or Tracing("specd-gateway")
        self.speculative_mode = speculative_mode
        self.policy = SpeculationPolicy(
            PolicyConfig(k_max=self.k_limit, disable_by_batch_size=disable_by_batch_size, off=policy_off)
        )
        self.metrics.bind_policy(self.policy)
        self.observer = RoundObserver(
            self.metrics, self.policy, self.tracing, lambda record: asyncio.get_running_loop().call_soon(record)
        )
        self.pipeline = pipeline
        if siblings < 0 or branches < 0:
            raise ValueError(f"siblings and branches must be >= 0, got {siblings} and {branches}")
        self.siblings, self.branches = siblings, branches
        self.max_waiting = max_waiting
        self.shares = Shares(max_sequences_per_key)
        self.request_timeout_s = request_timeout_s
        self.draining = False
        # Prompt tokens the verifier prefills per round (0: whole prompts at their open, which stalls
        # every running sequence for as long as the prefill takes); what this round's verifier opens spent of it.
        # The drafter always prefills in chunks, what fits behind a verify (within this cap if set): it
        # prefills beside the verify, and a sequence drafts only once its drafter prefill is done.
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self._verifier_prefill_spent = 0
        self.drafter_prefill = DrafterPrefillBudget(prefill_chunk_tokens)
        self.drafter_link = (
            DrafterLink(drafter, self.metrics.registry, self._wakeup.set) if drafter is not None else None
        )
        # Whether the drafter's exchanges of a round (draft-ahead, the other cohort's drafts, its
        # prefill of joining sequences) run while the verifier works, or after it: two services
        # that share cores slow each other far more than the overlap wins (their threads fight
        # over the same cores), so there every exchange runs alone.
        self.exchange = Exchange(
            verifier, drafter, self.drafter_link, self.drafter_prefill, drafter_overlap, lambda: self.active, self.eos
        )

    def _fit_to_services(self, verifier: VerifierClient, drafter: DrafterClient | None) -> None:
        """The drafts, context and batch both services can take."""
        assert verifier.info is not None
        self.max_context = verifier.info.max_context
        # Without a drafter nothing is drafted: a request asking for drafts is refused, not run target-only.
        self.k_limit = min(self.k, verifier.info.max_draft_tokens) if drafter is not None else 0
        # A token tree's drafts, chain and siblings together, that both services take.
        self.draft_room = verifier.info.max_draft_tokens
        self.drafter_context = self.max_context
        # A draft-ahead asks for one draft more than it will verify: its guess at the verifier's token.
        self.ahead_limit = self.k_limit
        if drafter is not None and drafter.info is not None:
            self.k_limit = min(self.k_limit, drafter.info.max_draft_tokens)
            self.draft_room = min(self.draft_room, drafter.info.max_draft_tokens)
            self.ahead_limit = min(self.k_limit, drafter.info.max_draft_tokens - 1)
            self.drafter_context = min(self.max_context, drafter.info.max_context)
        # A drafter that reads the target's hidden states gets them: the verifier returns them with
        # each verdict (bfloat16 rows), and each sequence keeps them until it retires.
        self.hidden_row_bytes = 2 * int(getattr(drafter, "feature_size", 0) or 0) if drafter is not None else 0
        # A batch larger than a backend's sequence slots would only see refusals.
        self.max_batch = min(self.max_batch, verifier.info.max_sequences)
        if drafter is not None and drafter.info is not None:
            self.max_batch = min(self.max_batch, drafter.info.max_sequences)

    # -- lifecycle ------------------------------------------------------
    def start(self, stats_interval_s: float = 0.0) -> None:
        self._task = asyncio.create_task(self._run(), name="specd-scheduler")
        if stats_interval_s > 0:
            self._stats_task = asyncio.create_task(self._log_stats(stats_interval_s), name="specd-stats")

    async def _log_stats(self, interval_s: float) -> None:
        before = self.metrics.snapshot()
        while True:
            await asyncio.sleep(interval_s)
            after = self.metrics.snapshot()
            line = stats_line(before, after, interval_s, self.k_limit)
            if line:
                log.info("%s; running %d, waiting %d", line, len(self.active), len(self.waiting))
            before = after

    async def stop(self) -> None:
        if self.drafter_link is not None:
            await self.drafter_link.stop()
        if self._stats_task is not None:
            self._stats_task.cancel()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        stranded = list(self.active)
        await self.exchange.stop_fill()
        for seq in [*self.waiting, *self.active]:
            fail(seq, GenerationError(503, "the gateway is shutting down", "service_unavailable"))
        # Free them on the services now, not only once this gateway's lease lapses there.
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._retire(stranded), CLOSE_ON_STOP_S)

    # -- requests -------------------------------------------------------
    def submit(
        self, prompt: list[int], params: GenerationParams, trace_parent: Mapping[str, str] | None = None
    ) -> _Sequence:
        """Validate and enqueue; raises GenerationError for requests that cannot fit."""
        return self.submit_group(prompt, [params], trace_parent)[0]

    def submit_group(
        self,
        prompt: list[int],
        group: Sequence[GenerationParams],
        trace_parent: Mapping[str, str] | None = None,
        client: str = "",
        tenant: str = "",
    ) -> list[_Sequence]:
        """Enqueue one sequence per params of `group` (a request's choices), all of them or none.

        Everything that could refuse one of them is checked before any is queued, so a request
        never half-runs. Each is its own sequence on the services (the KV cache has no prefix
        sharing: each prefills the prompt itself). `tenant`: whose text the suffix drafter may
        draft them from (SequenceSpec.tenant).
        """
        self._check_admission(len(group))
        max_tokens = [self._max_tokens(prompt, params) for params in group]
        self.shares.take(client, len(group))
        seqs = [self._sequence(prompt, params, n, trace_parent) for params, n in zip(group, max_tokens, strict=True)]
        for seq in seqs:
            seq.client = client
            seq.tenant = tenant
            seq.life.on_over = functools.partial(self.shares.give_back, client)
        self.waiting.extend(seqs)
        self.metrics.waiting.set(len(self.waiting))
        self._wakeup.set()
        return seqs

    def _max_tokens(self, prompt: list[int], params: GenerationParams) -> int:
        """The sequence's output bound; raises GenerationError for what cannot fit or run."""
        if not prompt:
            raise GenerationError(400, "the prompt is empty")
        if len(prompt) >= self.max_context:
            raise GenerationError(
                400,
                f"the prompt has {len(prompt)} tokens; this model's context window is {self.max_context} tokens",
                "context_length_exceeded",  # OpenAI's code for it
            )
        room = self.max_context - len(prompt)
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        if max_tokens < 1:
            raise GenerationError(400, f"max_tokens must be at least 1, got {max_tokens}")
        if max_tokens > room:
            raise GenerationError(
                400,
                f"the prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) exceeds the context "
                f"window of {self.max_context} tokens",
                "context_length_exceeded",
            )
        if params.pipeline is not None and params.pipeline not in PIPELINES:
            raise GenerationError(400, f"pipeline must be one of {', '.join(PIPELINES)}, got {params.pipeline!r}")
        spec = params.speculation
        if spec is not None and spec != "auto" and not (isinstance(spec, int) and 0 <= spec <= self.k_limit):
            raise InvalidParameter(
                "num_speculative_tokens",
                f"num_speculative_tokens must be 'auto' or an integer in [0, {self.k_limit}], got {spec!r}"
                + ("" if self.drafter is not None else " (this gateway has no drafter)"),
            )
        if (refused := width_refusal(params, self.limits)) is not None:
            raise refused  # a tree or a fan-out it names could never apply: not ignored
        return max_tokens

    def _sequence(
        self, prompt: list[int], params: GenerationParams, max_tokens: int, trace_parent: Mapping[str, str] | None
    ) -> _Sequence:
        if params.penalties.min_tokens:
            # min_tokens holds back every id this scheduler stops on, on both services.
            params = dataclasses.replace(
                params, penalties=dataclasses.replace(params.penalties, eos=tuple(sorted(self.eos)))
            )
        seq = _Sequence(
            id=uuid.uuid4().hex,
            prompt=list(prompt),
            params=params,
            max_tokens=max_tokens,
            stream=TextStream(self.tokenizer, params.stop, params.skip_special_tokens, params.include_stop),
            tokens=list(prompt),
        )
        if self.hidden_row_bytes:
            seq.hidden = HiddenLog(self.hidden_row_bytes)
        if self.request_timeout_s > 0:
            seq.deadline = time.monotonic() + self.request_timeout_s
        if self.tracing.enabled:
            seq.span = self.tracing.start(
                "specd.request",
                self.tracing.extract(trace_parent or {}),
                attributes={"specd.prompt_tokens": len(prompt), "specd.max_tokens": max_tokens},
                kind=SpanKind.SERVER,
            )
        return seq

    def cancel(self, seq: _Sequence) -> None:
        """The client went away: drop the sequence at the next round boundary."""
        if seq.done:
            return
        seq.cancelled = True
        self._wakeup.set()

    async def events(self, seq: _Sequence) -> AsyncIterator[Event]:
        """Yield the sequence's events until it finishes; cancels it if the consumer stops early."""
        try:
            while True:
                event = await self._next_event(seq)
                yield event
                if isinstance(event, Finished | Failed):
                    return
        finally:
            self.cancel(seq)

    def _check_admission(self, count: int = 1) -> None:
        """Refuse at once what would only wait: a full queue, or a gateway shutting down."""
        if self.draining:
            raise GenerationError(503, "the gateway is shutting down", "service_unavailable")
        if self.max_waiting and count > self.max_waiting:
            raise GenerationError(
                400,
                f"this request needs {count} sequences; the gateway queues at most {self.max_waiting} (--max-waiting)",
            )
        if self.max_waiting and len(self.waiting) + count > self.max_waiting:
            also = f"; this request's {count} choices would not fit" if count > 1 else ""
            raise GenerationError(
                429, f"the gateway is overloaded: {len(self.waiting)} requests are already waiting{also}", "overloaded"
            )

    async def _next_event(self, seq: _Sequence) -> Event:
        if not seq.deadline:
            return await seq.events.get()
        try:
            # In this task: wait_for would make a task of every event's wait.
            return await within(max(0.0, seq.deadline - time.monotonic()), seq.events.get())
        except asyncio.TimeoutError:
            # events() cancels the sequence on the way out, which frees it on both services.
            return Failed(
                GenerationError(504, f"the request did not finish within {self.request_timeout_s:g} s", "timeout")
            )

    def drain(self) -> None:
        """Stop admitting requests; those already submitted go on."""
        self.draining = True

    @property
    def idle(self) -> bool:
        return not self.active and not self.waiting

    @property
    def num_running(self) -> int:
        return len(self.active)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def limits(self) -> Limits:
        return Limits(
            self.k_limit,
            self.ahead_limit,
            self.drafter_context,
            self.speculative_mode,
            self.pipeline,
            self.prefill_chunk_tokens,
            self.siblings,
            self.draft_room,
            self.branches,
        )

    @property
    def drafter_overlap(self) -> bool:
        """Whether the drafter's exchanges of a round run while the verifier works (see __init__)."""
        return self.exchange.overlap

    @drafter_overlap.setter
    def drafter_overlap(self, overlap: bool) -> None:
        self.exchange.overlap = overlap

    # -- the loop -------------------------------------------------------
    async def _run(self) -> None:
        while True:
            await self._drop_cancelled()
            if not self.active and not self.waiting:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            await self._admit()
            if not self.active:
                continue
            try:
                await self._round()
            except (BackendError, ProtocolError) as exc:
                # The verifier failed the round as a whole: nothing of it was committed.
                log.error("round failed: %s", exc)
                await self._fail_all(unavailable(f"backend failure: {exc}"))
            except Exception as exc:
                # Per-sequence work is isolated in apply; what reaches here is a bug in the
                # round itself, and no sequence's state can be trusted to go on.
                await self._fail_all(internal_error("running a round", exc))

    async def _fail_all(self, error: GenerationError) -> None:
        for seq in list(self.active):
            fail(seq, error)
        await self._retire([s for s in self.active if s.done])

    async def _drop_cancelled(self) -> None:
        if any(s.cancelled for s in self.waiting):
            for s in self.waiting:
                if s.cancelled:
                    fail(s, CANCELLED)
            self.waiting = deque(s for s in self.waiting if not s.cancelled)
        gone = [s for s in self.active if s.cancelled]
        for s in gone:
            fail(s, CANCELLED)
        await self._retire(gone)

    # -- admission ------------------------------------------------------
    async def _admit(self) -> None:
        self._verifier_prefill_spent = 0
        batch: list[_Sequence] = []
        while self.waiting and len(self.active) + len(batch) < self.max_batch:
            # One client: first come, first served; several: the fairest (gateway.round.shares).
            pick = fairest(self.waiting, [*self.active, *batch]) if len(self.shares.held) > 1 else 0
            batch.append(self.waiting[pick])
            del self.waiting[pick]
        if not batch:
            return
        chunks = open_chunks(batch, self.active, "prefill_pending", self.prefill_chunk_tokens, scores_prompts=True)
        self._verifier_prefill_spent = sum(chunks.values())
        # The sequences that will draft open on the drafter at their admission (`_early_joins`)
        # and draft from their second round: beside their open on the verifier where the two
        # services work at once, else right after it, so the drafter's prefill never competes
        # with the verifier's. Prompts the drafter cannot prefill by then join in later rounds.
        prefilled = sum(chunks.get(s.id, len(s.tokens) - 1) for s in batch)
        early, early_chunks = self._early_joins(batch, prefilled)
        for s in early:
            s.drafter.want()
            s.joined_for_auto = speculation(s, self.limits) == "auto"
        beside = bool(early) and self.drafter_overlap
        join = asyncio.create_task(self.exchange.join(early, [], True, early_chunks)) if beside else None
        results = await self._open(batch, chunks, prefilled, join, early)
        if results is None:
            return
        if early and not beside:
            await self.exchange.join(early, [], True, early_chunks)
        await settle(join)  # its failures are the drafter's, handled there: the sequences go on
        refused = [s for s, r in zip(batch, results, strict=True) if not await self._opened(s, r, chunks, early)]
        self.metrics.running.set(len(self.active))
        self.metrics.waiting.set(len(self.waiting))
        await self._undo_joins(None, refused)

    async def _open(
        self,
        batch: list[_Sequence],
        chunks: dict[str, int],
        prefilled: int,
        join: asyncio.Task[int] | None,
        early: list[_Sequence],
    ) -> list[Any] | None:
        """Open `batch` on the verifier; None, with every sequence of it failed, if that failed."""
        try:
            opening = time.perf_counter_ns()
            results = await self.verifier.open([spec(s, chunks.get(s.id), self.exchange.ends) for s in batch])
            self.drafter_prefill.observe_open(prefilled, time.perf_counter_ns() - opening)
            if [r.sequence_id for r in results] != [s.id for s in batch]:
                raise BackendError("the verifier answered an open out of protocol")
            return list(results)
        except BackendError as exc:
            for s in batch:
                fail(s, unavailable(f"verifier unavailable: {exc}"))
        except Exception as exc:
            # Not the verifier being away: a gateway bug, which must not read as an outage.
            error = internal_error(f"opening {len(batch)} sequences", exc)
            for s in batch:
                fail(s, error)
            await close_quietly(self.verifier, [s.id for s in batch])
        await self._undo_joins(join, early)
        return None

    async def _opened(self, s: _Sequence, r: Any, chunks: dict[str, int], early: list[_Sequence]) -> bool:
        """Take one sequence the verifier answered for into the running batch; False if it refused it."""
        if r.error.code:
            fail(s, open_error(r.error))
            return False
        # One opened beside is on the drafter already (or pending there, if its open failed).
        wants_drafter = self.drafter is not None and self.k_limit > 0
        if s not in early and wants_drafter and s.params.speculation != 0:  # target-only never drafts
            s.drafter.want()
        s.cohort = self._smaller_cohort()
        s.prompt_logprobs = [token_logprob_from_pb(lp) for lp in r.prompt_logprobs]
        opened(s, r.prefill_pending if s.id in chunks else 0)
        self.metrics.prompt_tokens.inc(len(s.prompt))
        if s.cancelled:
            fail(s, CANCELLED)
            await self._retire([s])
            return True
        self.active.append(s)
        return True

    def _early_joins(self, batch: list[_Sequence], prefilled: int) -> tuple[list[_Sequence], dict[str, int]]:
        """The sequences to open on the drafter at their verifier open, and what each prefills
        there: as much prompt as the drafter is measured to prefill in the time the verifier's
        open of `prefilled` tokens takes (beside it, the first token waits for nothing more;
        after it, on shared cores, at most about as long again). The rest is prefilled in the
        rounds; until both opens have been timed (by sequences joining after their first
        round), none joins early."""
        if self.drafter is None or self.k_limit <= 0:
            return [], {}
        if self.drafter_link is not None and not self.drafter_link.up:
            return [], {}
        budget = self.drafter_prefill.fits_beside_open(prefilled)
        if budget <= 0:
            return [], {}
        return early_joins(batch, self.active, budget, self.limits, self.policy)

    async def _undo_joins(self, join: asyncio.Task[int] | None, seqs: list[_Sequence]) -> None:
        """Close on the drafter the sequences opened there at admission that will not run."""
        await settle(join)
        opened_there = [s.id for s in seqs if s.drafter.on_drafter]
        if opened_there and self.drafter is not None:
            await self.exchange.close_on_drafter(opened_there)

    def _smaller_cohort(self) -> int:
        ones = sum(s.cohort for s in self.active)
        return int(ones < len(self.active) - ones)

    # -- one round ------------------------------------------------------------
    async def _round(self) -> None:
        round_id = next(self._round_ids)
        seqs = list(self.active)
        wasted = drop_stale_blocks(seqs)
        plan = self._decide(seqs, round_id)
        if not plan.verify and not plan.prefill:
            return  # only prompts to prefill, and their opens spent this round's budget
        # Sequences drafting for the next round only (cohort) get a round span too: their draft is in it.
        taking_part = {s.id: s for s in [*plan.verify, *(item.seq for item in plan.ahead)]}
        spans = self.observer.start_spans(round_id, list(taking_part.values()))
        contexts = {sid: self.tracing.inject(span) for sid, span in spans.items()}
        result = await self.exchange.run(plan, round_id, contexts)
        applied = apply(plan, result, self.eos)
        applied.wasted += wasted
        self._observe(round_id, plan, result, applied, spans)
        await self._retire([s for s in seqs if s.done])

    def _decide(self, seqs: list[_Sequence], round_id: int) -> RoundPlan:
        """The round's plan; each sequence that may draft gets its acceptance and guess rates
        first, from the policy's rates now."""
        for s in seqs:
            if not s.prefill_pending and s.acceptance is None:
                s.acceptance = self.policy.new_sequence()
            if not s.prefill_pending and s.guess is None:
                s.guess = self.policy.new_guess_rate()
        spent = self._verifier_prefill_spent
        busy = self.exchange.filling
        return decide(seqs, round_id, self.limits, self.policy, spent, self.drafter_prefill, drafter_busy=busy)

    def _observe(
        self, round_id: int, plan: RoundPlan, result: RoundResult, applied: Applied, spans: dict[str, Any]
    ) -> None:
        """What the round teaches: the drafter's prefill budget, the latencies, the policy."""
        self.drafter_prefill.observe_verify(result.reply.timings.total_ns)
        self.observer.observe_commits(applied.emitted, applied.finished)
        self.metrics.refused_draft_blocks.inc(applied.refused)
        if plan.not_as_chosen:
            self.policy.not_as_chosen()
        self.observer.observe(
            RoundOutcome(
                round_id,
                applied.verdicts,
                result.times,
                plan.pipeline,
                applied.wasted,
                spans,
                sum(n for _, n in plan.prefill),
                [item.num_draft_tokens for item in plan.pre_draft] if result.pre is not None else [],
                result.ahead_drafted(),
                result.joined_tokens,
                applied.guesses,
                sum(item.prefill for item in plan.fill),
                applied.branches,
                applied.branch_hits,
                applied.branch_outcomes,
                applied.fan_out_misses,
                len(plan.unready),
            )
        )

    async def _retire(self, seqs: list[_Sequence]) -> None:
        """Remove finished sequences and free their state on both services."""
        if not seqs:
            return
        gone = {s.id for s in seqs}
        held = self.exchange.hold_closes(seqs)  # closed on the drafter once its prefill in flight lands
        self.active = [s for s in self.active if s.id not in gone]
        self.metrics.running.set(len(self.active))
        closes = [close_quietly(self.verifier, [s.id for s in seqs])]
        on_drafter = [s for s in seqs if s.drafter.on_drafter and s not in held]
        if on_drafter and self.drafter is not None:
            closes.append(self.exchange.close_finished(on_drafter))
        await asyncio.gather(*closes)
