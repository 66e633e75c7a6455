"""Continuous batching of speculative rounds across all active sequences.

Every round makes one drafter exchange and one verifier exchange for the whole
batch: new requests join at the next round, finished ones leave. The verifier
is the source of truth for committed tokens; the drafter is told at each round
what was committed since its last round and rolls its cache back to match.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.trace import SpanKind, Status, StatusCode

from gateway.backends import BackendError, DrafterClient, VerifierClient
from gateway.detokenize import TextStream
from gateway.drafter_link import DrafterLink, not_found_error
from gateway.metrics import GatewayMetrics, stats_line
from gateway.speculation import Acceptance, Candidate, PolicyConfig, SpeculationPolicy
from specd.proto.speculative.v1 import common_pb2, drafter_pb2, verifier_pb2
from specd.sampling import SamplingParams
from specd.serving import sampling_pb
from specd.tracing import Tracing

log = logging.getLogger(__name__)


class GenerationError(Exception):
    """A request that cannot be served; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str, code: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code


CANCELLED = GenerationError(499, "the client closed the request", "cancelled")
# How often a sequence is re-opened on a drafter that answers it has lost it.
MAX_DRAFTER_REJOINS = 3
# How long stopping waits for the services to confirm closes; the leases free the rest.
CLOSE_ON_STOP_S = 5.0


@dataclass(frozen=True)
class GenerationParams:
    max_tokens: int | None
    sampling: SamplingParams
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # None: the gateway's --speculative-mode; "auto": k chosen per round; an int: that k every round.
    speculation: int | str | None = None


@dataclass
class Delta:
    text: str
    token_ids: list[int]


@dataclass
class Finished:
    reason: str  # "stop" or "length"
    prompt_tokens: int
    completion_tokens: int


@dataclass
class Failed:
    error: GenerationError


Event = Delta | Finished | Failed


@dataclass
class _Sequence:
    id: str
    prompt: list[int]
    params: GenerationParams
    max_tokens: int
    stream: TextStream
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    tokens: list[int] = field(default_factory=list)  # prompt + committed output
    output: list[int] = field(default_factory=list)
    drafter_synced: int = 0  # committed tokens the drafter has been told about
    wants_drafter: bool = False  # to be opened on the drafter once it has its first token
    on_drafter: bool = False  # open on the drafter (must be closed there)
    speculating: bool = False  # the drafter still drafts for it
    drafter_rejoins: int = 0  # re-opened on the drafter after it lost the sequence
    deadline: float = 0.0  # time.monotonic() by which the request must end; 0 = none
    cancelled: bool = False
    done: bool = False
    drafted: int = 0
    accepted: int = 0
    submitted_ns: int = field(default_factory=time.perf_counter_ns)
    first_token_ns: int = 0
    last_emit_ns: int = 0
    span: Any = None  # the request's trace span, when traced
    acceptance: Acceptance | None = None  # its own per-position acceptance, for choosing its k


@dataclass(frozen=True)
class RoundTimes:
    """Where one round's time went, as the gateway saw it and as the services reported."""

    round_ns: int
    draft_ns: int
    verify_ns: int
    drafter_ns: int
    verifier_ns: int
    drafter_forward_ns: int
    verifier_forward_ns: int

    @property
    def overhead_ns(self) -> int:
        """Network, serialisation and gateway scheduling: the round minus the services' own time."""
        return self.round_ns - self.drafter_ns - self.verifier_ns

    def attributes(self, batch_size: int) -> dict[str, float | int]:
        return {
            "specd.batch_size": batch_size,
            "specd.round_ms": self.round_ns / 1e6,
            "specd.draft_ms": self.draft_ns / 1e6,
            "specd.verify_ms": self.verify_ns / 1e6,
            "specd.drafter_ms": self.drafter_ns / 1e6,
            "specd.verifier_ms": self.verifier_ns / 1e6,
            "specd.drafter_forward_ms": self.drafter_forward_ns / 1e6,
            "specd.verifier_forward_ms": self.verifier_forward_ns / 1e6,
            "specd.overhead_ms": self.overhead_ns / 1e6,
        }


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
        max_waiting: int = 0,
        request_timeout_s: float = 0.0,
    ) -> None:
        self.tokenizer = tokenizer
        self.verifier = verifier
        self.drafter = drafter
        self.k = num_speculative_tokens
        self.max_batch = max_batch
        self.eos = frozenset(eos_token_ids)
        assert verifier.info is not None
        self.max_context = verifier.info.max_context
        self.k_limit = min(self.k, verifier.info.max_draft_tokens)
        self.drafter_context = self.max_context
        if drafter is not None and drafter.info is not None:
            self.k_limit = min(self.k_limit, drafter.info.max_draft_tokens)
            self.drafter_context = min(self.max_context, drafter.info.max_context)
        # A batch larger than a backend's sequence slots would only see refusals.
        self.max_batch = min(self.max_batch, verifier.info.max_sequences)
        if drafter is not None and drafter.info is not None:
            self.max_batch = min(self.max_batch, drafter.info.max_sequences)
        self.waiting: deque[_Sequence] = deque()
        self.active: list[_Sequence] = []
        self._wakeup = asyncio.Event()
        self._round_ids = itertools.count(1)
        self._task: asyncio.Task[None] | None = None
        self._stats_task: asyncio.Task[None] | None = None
        self.metrics = metrics or GatewayMetrics(self.k_limit)
        self.tracing = tracing or Tracing("specd-gateway")
        self.speculative_mode = speculative_mode
        self.policy = SpeculationPolicy(PolicyConfig(k_max=self.k_limit, disable_by_batch_size=disable_by_batch_size))
        self.metrics.bind_policy(self.policy)
        self.max_waiting = max_waiting
        self.request_timeout_s = request_timeout_s
        self.draining = False
        self.drafter_link = (
            DrafterLink(drafter, self.metrics.registry, self._wakeup.set) if drafter is not None else None
        )

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
        for seq in [*self.waiting, *self.active]:
            self._fail(seq, GenerationError(503, "the gateway is shutting down", "service_unavailable"))
        # Free them on the services now, not only once this gateway's lease lapses there.
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._retire(stranded), CLOSE_ON_STOP_S)

    # -- requests -------------------------------------------------------
    def submit(
        self, prompt: list[int], params: GenerationParams, trace_parent: Mapping[str, str] | None = None
    ) -> _Sequence:
        """Validate and enqueue; raises GenerationError for requests that cannot fit."""
        self._check_admission()
        if not prompt:
            raise GenerationError(400, "the prompt is empty")
        if len(prompt) >= self.max_context:
            raise GenerationError(
                400,
                f"the prompt has {len(prompt)} tokens; this model's context window is {self.max_context} tokens",
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
            )
        spec = params.speculation
        if spec is not None and spec != "auto" and not (isinstance(spec, int) and 0 <= spec <= self.k_limit):
            raise GenerationError(
                400, f"num_speculative_tokens must be 'auto' or an integer in [0, {self.k_limit}], got {spec!r}"
            )
        seq = _Sequence(
            id=uuid.uuid4().hex,
            prompt=list(prompt),
            params=params,
            max_tokens=max_tokens,
            stream=TextStream(self.tokenizer, params.stop),
            tokens=list(prompt),
        )
        if self.request_timeout_s > 0:
            seq.deadline = time.monotonic() + self.request_timeout_s
        if self.tracing.enabled:
            seq.span = self.tracing.start(
                "specd.request",
                self.tracing.extract(trace_parent or {}),
                attributes={"specd.prompt_tokens": len(prompt), "specd.max_tokens": max_tokens},
                kind=SpanKind.SERVER,
            )
        self.waiting.append(seq)
        self.metrics.waiting.set(len(self.waiting))
        self._wakeup.set()
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

    def _check_admission(self) -> None:
        """Refuse at once what would only wait: a full queue, or a gateway shutting down."""
        if self.draining:
            raise GenerationError(503, "the gateway is shutting down", "service_unavailable")
        if self.max_waiting and len(self.waiting) >= self.max_waiting:
            raise GenerationError(
                429, f"the gateway is overloaded: {len(self.waiting)} requests are already waiting", "overloaded"
            )

    async def _next_event(self, seq: _Sequence) -> Event:
        if not seq.deadline:
            return await seq.events.get()
        try:
            return await asyncio.wait_for(seq.events.get(), max(0.0, seq.deadline - time.monotonic()))
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

    # -- the loop -------------------------------------------------------
    async def _run(self) -> None:
        while True:
            await self._drop_cancelled()
            if not self.active and not self.waiting:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            await self._admit()
            if self.active:
                try:
                    await self._round()
                except BackendError as exc:
                    log.error("round failed: %s", exc)
                    for seq in list(self.active):
                        self._fail(seq, GenerationError(503, f"backend failure: {exc}", "service_unavailable"))
                    await self._retire([s for s in self.active if s.done])
                except Exception:
                    log.exception("round failed unexpectedly")
                    for seq in list(self.active):
                        self._fail(seq, GenerationError(500, "internal error in the gateway", "internal_error"))
                    await self._retire([s for s in self.active if s.done])

    async def _drop_cancelled(self) -> None:
        if any(s.cancelled for s in self.waiting):
            for s in self.waiting:
                if s.cancelled:
                    self._fail(s, CANCELLED)
            self.waiting = deque(s for s in self.waiting if not s.cancelled)
        gone = [s for s in self.active if s.cancelled]
        for s in gone:
            self._fail(s, CANCELLED)
        await self._retire(gone)

    async def _admit(self) -> None:
        batch: list[_Sequence] = []
        while self.waiting and len(self.active) + len(batch) < self.max_batch:
            batch.append(self.waiting.popleft())
        if not batch:
            return
        # Only the verifier opens sequences here: they join the drafter after their
        # first round (see _join_drafter), so the drafter's prefill never delays
        # the first token, nor competes for the CPU with the verifier's prefill.
        try:
            results = await self.verifier.open([self._spec(s) for s in batch])
        except Exception as exc:
            for s in batch:
                self._fail(s, GenerationError(503, f"verifier unavailable: {exc}", "service_unavailable"))
            return
        for s, r in zip(batch, results, strict=True):
            if r.error.code:
                self._fail(s, open_error(r.error))
                continue
            s.wants_drafter = self.drafter is not None and self.k_limit > 0
            self.metrics.prompt_tokens.inc(len(s.prompt))
            if s.cancelled:
                self._fail(s, CANCELLED)
                await self._retire([s])
                continue
            self.active.append(s)
        self.metrics.running.set(len(self.active))
        self.metrics.waiting.set(len(self.waiting))

    @staticmethod
    def _spec(seq: _Sequence) -> common_pb2.SequenceSpec:
        """The sequence as committed so far (prompt plus any output), for opening it on a service."""
        return common_pb2.SequenceSpec(
            sequence_id=seq.id, prompt_token_ids=seq.tokens, sampling=sampling_pb(seq.params.sampling)
        )

    async def _join_drafter(self, batch: list[_Sequence]) -> None:
        """Open on the drafter the sequences that have their first token and want drafts."""
        joining = [s for s in batch if s.wants_drafter and not s.on_drafter and s.output and not s.done]
        if not joining or self.drafter is None:
            return
        if self.drafter_link is not None and not (self.drafter_link.up and await self.drafter_link.flush_stale()):
            return  # they stay wanting: they join once the drafter is back
        for s in joining:
            s.wants_drafter = False  # one attempt; on failure the sequence runs target-only
        try:
            results = await self.drafter.open([self._spec(s) for s in joining])
            if [r.sequence_id for r in results] != [s.id for s in joining]:
                raise BackendError("the drafter answered an open out of protocol")
        except Exception as exc:
            for s in joining:
                s.wants_drafter = True
            self._drafter_failed(f"open failed: {exc}", [s.id for s in joining])
            return
        for s, r in zip(joining, results, strict=True):
            if r.error.code:
                log.warning("drafter refused %s: %s; it runs target-only", s.id, r.error.message)
                continue
            s.on_drafter = s.speculating = True
            s.drafter_synced = len(s.tokens)

    def _cap(self, seq: _Sequence) -> int:
        """The most drafts the sequence can use this round."""
        if not seq.speculating:
            return 0
        remaining = seq.max_tokens - len(seq.output)
        return max(0, min(self.k_limit, remaining - 1, self.drafter_context - len(seq.tokens)))

    def _candidate(self, seq: _Sequence) -> Candidate:
        cap = self._cap(seq)
        spec = seq.params.speculation
        if spec is None:
            spec = "auto" if self.speculative_mode == "auto" else cap
        if seq.acceptance is None:
            seq.acceptance = self.policy.new_sequence()
        fixed = None if spec == "auto" else min(int(spec), cap)
        return Candidate(cap=cap, rates=seq.acceptance.rates(), fixed=fixed)

    def _choose_ks(self, batch: list[_Sequence]) -> dict[str, int]:
        ks = self.policy.choose([self._candidate(s) for s in batch], len(batch))
        return {s.id: k for s, k in zip(batch, ks, strict=True)}

    async def _round(self) -> None:
        round_id = next(self._round_ids)
        batch = list(self.active)
        await self._join_drafter(batch)
        started = time.perf_counter_ns()
        # One round span per request, under that request's span: a trace viewer
        # shows one request's trace at a time, and each then holds all of its
        # rounds and the services' work in them. The batch a round served is in
        # the specd.round_id / specd.batch_size attributes, shared by its spans.
        spans = self._start_round_spans(round_id, batch) if self.tracing.enabled else {}
        contexts = {sid: self.tracing.inject(span) for sid, span in spans.items()}
        ks = self._choose_ks(batch)
        drafts: dict[str, drafter_pb2.DraftProposal] = {}
        to_draft = [s for s in batch if ks[s.id] > 0]
        draft_ns = drafter_ns = drafter_forward_ns = 0
        if to_draft and self.drafter is not None:
            request = drafter_pb2.DraftRequest(round_id=round_id)
            for s in to_draft:
                task = request.tasks.add(
                    sequence_id=s.id,
                    new_token_ids=s.tokens[s.drafter_synced :],
                    num_committed=len(s.tokens),
                    num_draft_tokens=ks[s.id],
                )
                if s.id in contexts:
                    task.trace_context.update(contexts[s.id])
            try:
                reply = await self.drafter.draft(request)
            except BackendError as exc:
                # Speculation is an optimisation: without drafts the round still makes progress.
                self._drafter_failed(str(exc))
            else:
                drafter_ns, drafter_forward_ns = reply.timings.total_ns, reply.timings.forward_ns
                if [p.sequence_id for p in reply.proposals] != [s.id for s in to_draft]:
                    self._drafter_failed("the drafter answered a round out of protocol")
                    reply.ClearField("proposals")
                elif self.drafter_link is not None:
                    self.drafter_link.succeeded()
                for s, proposal in zip(to_draft, reply.proposals, strict=False):
                    if proposal.error.code in LOST_ON_DRAFTER:
                        self._rejoin_drafter(s, proposal.error.message)
                        continue
                    if proposal.error.code:
                        log.warning("drafter refused %s: %s; continuing target-only", s.id, proposal.error.message)
                        s.speculating = False
                        continue
                    s.drafter_synced = len(s.tokens)
                    drafts[s.id] = proposal
            draft_ns = time.perf_counter_ns() - started
        request = verifier_pb2.VerifyRequest(round_id=round_id)
        for s in batch:
            proposal = drafts.get(s.id)
            task = request.tasks.add(sequence_id=s.id, num_committed=len(s.tokens))
            if proposal is not None:
                task.draft_token_ids.extend(proposal.token_ids[: ks[s.id]])
                task.draft_distributions.extend(proposal.distributions[: ks[s.id]])
            if s.id in contexts:
                task.trace_context.update(contexts[s.id])
        verify_started = time.perf_counter_ns()
        try:
            reply = await self.verifier.verify(request)
        except BaseException:
            for span in spans.values():
                span.end()
            raise
        now = time.perf_counter_ns()
        timing = RoundTimes(
            round_ns=now - started,
            draft_ns=draft_ns,
            verify_ns=now - verify_started,
            drafter_ns=drafter_ns,
            verifier_ns=reply.timings.total_ns,
            drafter_forward_ns=drafter_forward_ns,
            verifier_forward_ns=reply.timings.forward_ns,
        )
        proposals: list[tuple[int, int]] = []
        drafted = [len(task.draft_token_ids) for task in request.tasks]
        emitted = 0
        for s, task, result in zip(batch, request.tasks, reply.results, strict=True):
            k = len(task.draft_token_ids)
            if result.error.code == common_pb2.ERROR_CODE_INVALID_ARGUMENT and k > 0:
                # The verifier checks a round before changing anything, so bad drafts
                # cost this sequence one round; it goes on target-only.
                log.warning("verifier refused drafts for %s: %s; continuing target-only", s.id, result.error.message)
                s.speculating = False
            elif result.error.code:
                self._fail(s, verifier_round_error(result.error))
            else:
                proposals.append((k, result.num_accepted))
                s.drafted += k
                s.accepted += result.num_accepted
                emitted += result.num_accepted + 1
                if k and s.acceptance is not None:
                    s.acceptance.observe(k, result.num_accepted)
                    self.policy.overall.observe(k, result.num_accepted)
                self._commit(s, [*task.draft_token_ids[: result.num_accepted], result.next_token_id])
        choice = self.policy.last_choice
        observed_gain = self.policy.observe_round(
            drafted, timing.round_ns, timing.draft_ns, timing.verify_ns, timing.drafter_forward_ns, emitted
        )
        for s, task, result in zip(batch, request.tasks, reply.results, strict=True):
            if s.id in spans:
                span = spans[s.id]
                span.set_attributes(
                    {
                        "specd.k": len(task.draft_token_ids),
                        "specd.accepted": result.num_accepted,
                        "specd.round_k_max": max(drafted, default=0),
                        **timing.attributes(len(batch)),
                    }
                )
                if choice is not None:
                    span.set_attribute("specd.predicted_gain", choice.predicted_gain)
                if observed_gain is not None:
                    span.set_attribute("specd.observed_gain", observed_gain)
                span.end()
        self.metrics.observe_round(proposals, len(batch), timing)
        self.metrics.observe_ks(drafted)
        await self._retire([s for s in batch if s.done])

    def _start_round_spans(self, round_id: int, batch: list[_Sequence]) -> dict[str, Any]:
        spans = {}
        for s in batch:
            if s.span is not None:
                spans[s.id] = self.tracing.start("specd.round", s.span, attributes={"specd.round_id": round_id})
        return spans

    def _commit(self, seq: _Sequence, new_tokens: list[int]) -> None:
        """Append verified tokens, emit text, and finish on EOS, a stop string or the length limit."""
        emitted: list[int] = []
        reason = None
        for token in new_tokens:
            seq.tokens.append(token)
            seq.output.append(token)
            emitted.append(token)
            if token in self.eos and not seq.params.ignore_eos:
                reason = "stop"
                break
            seq.stream.add(token)
            if seq.stream.stopped:
                reason = "stop"
                break
            if len(seq.output) >= seq.max_tokens:
                reason = "length"
                break
        now = time.perf_counter_ns()
        if seq.first_token_ns == 0:
            seq.first_token_ns = now
            self.metrics.ttft.observe((now - seq.submitted_ns) / 1e9)
        else:
            self.metrics.itl.observe((now - seq.last_emit_ns) / 1e9)
        seq.last_emit_ns = now
        self.metrics.observe_generated(len(emitted))
        text = seq.stream.take(final=reason is not None)
        if (text or emitted) and not seq.cancelled:
            seq.events.put_nowait(Delta(text, emitted))
        if reason is not None:
            seq.done = True
            self._observe_finish(seq, reason)
            seq.events.put_nowait(Finished(reason, len(seq.prompt), len(seq.output)))

    def _observe_finish(self, seq: _Sequence, reason: str) -> None:
        now = time.perf_counter_ns()
        ttft_s = (seq.first_token_ns - seq.submitted_ns) / 1e9
        tpot_s = (now - seq.first_token_ns) / 1e9 / (len(seq.output) - 1) if len(seq.output) > 1 else 0.0
        self.metrics.requests.labels(finished_reason=reason).inc()
        self.metrics.e2e.observe((now - seq.submitted_ns) / 1e9)
        if len(seq.output) > 1:
            self.metrics.tpot.observe(tpot_s)
        if seq.span is not None:
            seq.span.set_attributes(
                {
                    "specd.prompt_tokens": len(seq.prompt),
                    "specd.completion_tokens": len(seq.output),
                    "specd.ttft_ms": ttft_s * 1e3,
                    "specd.tpot_ms": tpot_s * 1e3,
                    "specd.acceptance_rate": seq.accepted / seq.drafted if seq.drafted else 0.0,
                    "specd.draft_tokens": seq.drafted,
                    "specd.accepted_tokens": seq.accepted,
                    "specd.finish_reason": reason,
                }
            )
            seq.span.end()
            seq.span = None

    def _fail(self, seq: _Sequence, error: GenerationError) -> None:
        if not seq.done:
            seq.done = True
            if seq.span is not None:
                seq.span.set_status(Status(StatusCode.ERROR, error.message))
                seq.span.set_attribute("specd.finish_reason", "error" if not seq.cancelled else "cancelled")
                seq.span.end()
                seq.span = None
            seq.events.put_nowait(Failed(error))

    async def _retire(self, seqs: list[_Sequence]) -> None:
        """Remove finished sequences and free their state on both services."""
        if not seqs:
            return
        gone = {s.id for s in seqs}
        self.active = [s for s in self.active if s.id not in gone]
        self.metrics.running.set(len(self.active))
        closes = [self._close_quietly(self.verifier, [s.id for s in seqs])]
        on_drafter = [s.id for s in seqs if s.on_drafter]
        if on_drafter and self.drafter is not None:
            closes.append(self._close_on_drafter(on_drafter))
        await asyncio.gather(*closes)

    async def _close_on_drafter(self, ids: list[str]) -> None:
        assert self.drafter is not None and self.drafter_link is not None
        try:
            await self.drafter.close_sequences(ids)
        except Exception as exc:
            if not_found_error(exc):
                return
            # Closed once the drafter answers again, before any id is reused there.
            self.drafter_link.stale.update(ids)
            log.debug("close on the drafter failed: %s", exc)

    # -- drafter failures -------------------------------------------------
    def _drafter_failed(self, reason: str, also_open: Sequence[str] = ()) -> None:
        """Continue every sequence target-only; they re-open on the drafter once it is back."""
        assert self.drafter_link is not None
        lost = [s for s in self.active if s.on_drafter]
        for s in lost:
            s.on_drafter = s.speculating = False
            s.wants_drafter = True
        self.drafter_link.mark_down(reason, [*(s.id for s in lost), *also_open])

    def _rejoin_drafter(self, seq: _Sequence, reason: str) -> None:
        """The drafter lost this sequence (it restarted between two rounds): open it there again."""
        assert self.drafter_link is not None
        log.warning("drafter lost %s (%s); re-opening it there", seq.id, reason)
        seq.on_drafter = seq.speculating = False
        seq.wants_drafter = seq.drafter_rejoins < MAX_DRAFTER_REJOINS
        seq.drafter_rejoins += 1
        self.drafter_link.stale.add(seq.id)

    @staticmethod
    async def _close_quietly(backend: Any, ids: list[str]) -> None:
        try:
            await backend.close_sequences(ids)
        except Exception as exc:  # a backend that lost them already freed them
            log.debug("close on %s failed: %s", getattr(backend, "name", backend), exc)


LOST_ON_DRAFTER = (
    common_pb2.ERROR_CODE_NOT_FOUND,
    common_pb2.ERROR_CODE_FAILED_PRECONDITION,
    common_pb2.ERROR_CODE_UNAVAILABLE,  # its drafter replica failed: re-open it on another
)


def verifier_round_error(error: common_pb2.SequenceError) -> GenerationError:
    """The HTTP-level error for a sequence the verifier refused in a round."""
    if error.code in (
        common_pb2.ERROR_CODE_NOT_FOUND,
        common_pb2.ERROR_CODE_FAILED_PRECONDITION,
        common_pb2.ERROR_CODE_UNAVAILABLE,
    ):
        # A restarted or unreachable verifier has lost the sequence: the request cannot go on, a new one can.
        return GenerationError(503, f"the verifier lost the sequence: {error.message}", "service_unavailable")
    return GenerationError(500, f"verifier refused the round: {error.message}", "internal_error")


def open_error(error: common_pb2.SequenceError) -> GenerationError:
    """The HTTP-level error for a sequence the verifier would not open."""
    if error.code == common_pb2.ERROR_CODE_INVALID_ARGUMENT:
        return GenerationError(400, error.message)
    if error.code == common_pb2.ERROR_CODE_RESOURCE_EXHAUSTED:
        return GenerationError(503, f"the verifier is full: {error.message}", "service_unavailable")
    if error.code == common_pb2.ERROR_CODE_UNAVAILABLE:
        return GenerationError(503, f"no verifier could open the sequence: {error.message}", "service_unavailable")
    return GenerationError(500, f"the verifier could not open the sequence: {error.message}", "internal_error")
