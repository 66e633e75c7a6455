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
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.trace import SpanKind, Status, StatusCode

from gateway.backends import BackendError, DrafterClient, VerifierClient
from gateway.detokenize import TextStream
from gateway.drafter_link import DrafterLink, not_found_error
from gateway.failures import CANCELLED, GenerationError, internal, open_error, unavailable
from gateway.hidden_log import HiddenLog
from gateway.membership import DrafterMembership
from gateway.metrics import GatewayMetrics, stats_line
from gateway.observer import RoundObserver, RoundOutcome, RoundTimes
from gateway.pipeline_choice import MODES
from gateway.prefill_budget import DrafterPrefillBudget
from gateway.round import (
    Block,
    DraftItem,
    DraftVerdicts,
    ProtocolError,
    RoundPlan,
    Verdict,
    draft_request,
    plan_prefill,
    read_drafts,
    read_guesses,
    read_verdicts,
    verify_request,
)
from gateway.speculation import Acceptance, Candidate, HitRate, PolicyConfig, SpeculationPolicy
from specd.params import LogprobsRequest, Penalties, SamplingParams, TokenLogprob
from specd.proto.speculative.v1 import common_pb2, drafter_pb2
from specd.serving import add_penalties_pb, logprobs_request_pb, sampling_pb, token_logprob_from_pb
from specd.tracing import Tracing

log = logging.getLogger(__name__)


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
    penalties: Penalties = field(default_factory=Penalties)
    logprobs: LogprobsRequest | None = None
    # None: the gateway's --pipeline; else "sequential", "cohort", "ahead" or "auto" (chosen per round).
    pipeline: str | None = None
    # Structured output: canonical JSON Schema text the output must satisfy; "" = none.
    json_schema: str = ""
    # Structured output by an llguidance grammar (guided_regex, guided_choice); "" = none.
    grammar: str = ""


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token id, when asked for


@dataclass
class Finished:
    reason: str  # "stop" or "length"
    prompt_tokens: int
    completion_tokens: int
    # Each verify step that carried drafts: (drafts verified, drafts accepted), in order.
    spec_steps: tuple[tuple[int, int], ...] = ()


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
    drafter: DrafterMembership = field(default_factory=DrafterMembership)
    block: Block | None = None  # drafts made ahead of its next verify (cohort, draft-ahead)
    cohort: int = 0  # which of the two cohorts it is verified with (cohort pipeline)
    deadline: float = 0.0  # time.monotonic() by which the request must end; 0 = none
    cancelled: bool = False
    done: bool = False
    drafted: int = 0
    accepted: int = 0
    spec_steps: list[tuple[int, int]] = field(default_factory=list)  # see Finished.spec_steps
    # Joined the drafter because auto mode wanted its drafts; then, its rounds on the drafter and
    # those in which it drafted (what the policy learns its joins are worth from).
    joined_for_auto: bool = False
    rounds_on_drafter: int = 0
    rounds_drafting: int = 0
    submitted_ns: int = field(default_factory=time.perf_counter_ns)
    first_token_ns: int = 0
    last_emit_ns: int = 0
    span: Any = None  # the request's trace span, when traced
    acceptance: Acceptance | None = None  # its own per-position acceptance, for choosing its k
    guess: HitRate | None = None  # how often its draft-ahead guesses at the verifier's token were right
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # from the verifier's open, when asked for
    # Chunked prefill: prompt tokens the verifier, and the drafter, have still to cache. A sequence
    # is verified once the first is 0, and drafts once the second is.
    prefill_pending: int = 0
    drafter_prefill_pending: int = 0
    # The target's hidden states, kept when the drafter reads them (a feature drafter).
    hidden: HiddenLog | None = None


@dataclass
class _DraftExchange:
    verdicts: DraftVerdicts
    timings: common_pb2.ServiceTimings
    elapsed_ns: int


async def _settle(task: asyncio.Task[Any] | None) -> BaseException | None:
    """Wait for a task beside the verify; its exception, if it failed."""
    if task is None:
        return None
    try:
        await task
    except BaseException as exc:
        return exc
    return None


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
        max_waiting: int = 0,
        request_timeout_s: float = 0.0,
        pipeline: str = "sequential",
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
        assert verifier.info is not None
        self.max_context = verifier.info.max_context
        self.k_limit = min(self.k, verifier.info.max_draft_tokens)
        self.drafter_context = self.max_context
        # A draft-ahead asks for one draft more than it will verify: its guess at the verifier's token.
        self.ahead_limit = self.k_limit
        if drafter is not None and drafter.info is not None:
            self.k_limit = min(self.k_limit, drafter.info.max_draft_tokens)
            self.ahead_limit = min(self.k_limit, drafter.info.max_draft_tokens - 1)
            self.drafter_context = min(self.max_context, drafter.info.max_context)
        # A drafter that reads the target's hidden states gets them: the verifier returns them with
        # each verdict (bfloat16 rows), and each sequence keeps them until it retires.
        self.hidden_row_bytes = 2 * int(getattr(drafter, "feature_size", 0) or 0) if drafter is not None else 0
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
        self.observer = RoundObserver(self.metrics, self.policy, self.tracing)
        self.pipeline = pipeline
        # Whether the drafter's exchanges of a round (draft-ahead, the other cohort's drafts, its
        # prefill of joining sequences) run while the verifier works, or after it: two services
        # that share cores slow each other far more than the overlap wins (their threads fight
        # over the same cores), so there every exchange runs alone.
        self.drafter_overlap = drafter_overlap
        self._auto_pipeline = "sequential"  # what `auto` resolves to this round
        self.max_waiting = max_waiting
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
        return self.submit_group(prompt, [params], trace_parent)[0]

    def submit_group(
        self, prompt: list[int], group: Sequence[GenerationParams], trace_parent: Mapping[str, str] | None = None
    ) -> list[_Sequence]:
        """Enqueue one sequence per params of `group` (a request's choices), all of them or none.

        Everything that could refuse one of them is checked before any is queued, so a request
        never half-runs. Each is its own sequence on the services (the KV cache has no prefix
        sharing: each prefills the prompt itself).
        """
        self._check_admission(len(group))
        max_tokens = [self._max_tokens(prompt, params) for params in group]
        seqs = [self._sequence(prompt, params, n, trace_parent) for params, n in zip(group, max_tokens, strict=True)]
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
        if params.pipeline is not None and params.pipeline not in PIPELINES:
            raise GenerationError(400, f"pipeline must be one of {', '.join(PIPELINES)}, got {params.pipeline!r}")
        spec = params.speculation
        if spec is not None and spec != "auto" and not (isinstance(spec, int) and 0 <= spec <= self.k_limit):
            raise GenerationError(
                400, f"num_speculative_tokens must be 'auto' or an integer in [0, {self.k_limit}], got {spec!r}"
            )
        return max_tokens

    def _sequence(
        self, prompt: list[int], params: GenerationParams, max_tokens: int, trace_parent: Mapping[str, str] | None
    ) -> _Sequence:
        seq = _Sequence(
            id=uuid.uuid4().hex,
            prompt=list(prompt),
            params=params,
            max_tokens=max_tokens,
            stream=TextStream(self.tokenizer, params.stop),
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
            if not self.active:
                continue
            try:
                await self._round()
            except (BackendError, ProtocolError) as exc:
                # The verifier failed the round as a whole: nothing of it was committed.
                log.error("round failed: %s", exc)
                for seq in list(self.active):
                    self._fail(seq, unavailable(f"backend failure: {exc}"))
                await self._retire([s for s in self.active if s.done])
            except Exception as exc:
                # Per-sequence work is isolated in _apply; what reaches here is a bug in the
                # round itself, and no sequence's state can be trusted to go on.
                error = self._internal_error("running a round", exc)
                for seq in list(self.active):
                    self._fail(seq, error)
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
        self._verifier_prefill_spent = 0
        batch: list[_Sequence] = []
        while self.waiting and len(self.active) + len(batch) < self.max_batch:
            batch.append(self.waiting.popleft())
        if not batch:
            return
        chunks = self._open_chunks(
            batch, self.active, "prefill_pending", self.prefill_chunk_tokens, scores_prompts=True
        )
        self._verifier_prefill_spent = sum(chunks.values())
        # Where the two services work at once, the sequences that will draft open on the drafter
        # beside their open on the verifier (`_early_joins`), and draft from their second round.
        # Otherwise only the verifier opens them here; they join the drafter after their first
        # round, once the policy wants drafts from them (see _join_drafter), so the drafter's
        # prefill never competes with the verifier's.
        prefilled = sum(chunks.get(s.id, len(s.tokens) - 1) for s in batch)
        early, early_chunks = self._early_joins(batch, prefilled)
        for s in early:
            s.drafter.want()
            s.joined_for_auto = self._speculation(s) == "auto"
        join = asyncio.create_task(self._join_drafter(early, [], True, early_chunks)) if early else None
        try:
            opening = time.perf_counter_ns()
            results = await self.verifier.open([self._spec(s, chunks.get(s.id)) for s in batch])
            self.drafter_prefill.observe_open(prefilled, time.perf_counter_ns() - opening)
            if [r.sequence_id for r in results] != [s.id for s in batch]:
                raise BackendError("the verifier answered an open out of protocol")
        except BackendError as exc:
            for s in batch:
                self._fail(s, unavailable(f"verifier unavailable: {exc}"))
            await self._undo_joins(join, early)
            return
        except Exception as exc:
            # Not the verifier being away: a gateway bug, which must not read as an outage.
            error = self._internal_error(f"opening {len(batch)} sequences", exc)
            for s in batch:
                self._fail(s, error)
            await self._close_quietly(self.verifier, [s.id for s in batch])
            await self._undo_joins(join, early)
            return
        await _settle(join)  # its failures are the drafter's, handled there: the sequences go on
        wants_drafter = self.drafter is not None and self.k_limit > 0
        refused: list[_Sequence] = []
        for s, r in zip(batch, results, strict=True):
            if r.error.code:
                self._fail(s, open_error(r.error))
                refused.append(s)
                continue
            # One opened beside is on the drafter already (or pending there, if its open failed).
            if s not in early and wants_drafter and s.params.speculation != 0:  # target-only never drafts
                s.drafter.want()
            s.cohort = self._smaller_cohort()
            s.prompt_logprobs = [token_logprob_from_pb(lp) for lp in r.prompt_logprobs]
            s.prefill_pending = r.prefill_pending if s.id in chunks else 0
            self.metrics.prompt_tokens.inc(len(s.prompt))
            if s.cancelled:
                self._fail(s, CANCELLED)
                await self._retire([s])
                continue
            self.active.append(s)
        self.metrics.running.set(len(self.active))
        self.metrics.waiting.set(len(self.waiting))
        await self._undo_joins(None, refused)

    def _speculation(self, seq: _Sequence) -> int | str:
        """What the sequence drafts: a fixed k, or "auto"."""
        spec = seq.params.speculation
        if spec is None:
            return "auto" if self.speculative_mode == "auto" else self.k_limit
        return spec

    def _early_joins(self, batch: list[_Sequence], prefilled: int) -> tuple[list[_Sequence], dict[str, int]]:
        """The sequences to open on the drafter beside their verifier open, and what each prefills
        there: only where the two services work at once (`drafter_overlap`), for requests that
        draft (auto ones only into a batch the policy would draft for), and only as much prompt as
        the drafter is measured to prefill in the time the verifier's open of `prefilled` tokens
        takes, so the first token waits for nothing more. The rest is prefilled beside the
        verifies; until both opens have been timed (by sequences joining after their first
        round), none joins early."""
        if not self.drafter_overlap or self.drafter is None or self.k_limit <= 0:
            return [], {}
        if self.drafter_link is not None and not self.drafter_link.up:
            return [], {}
        budget = self.drafter_prefill.fits_beside_open(prefilled)
        if budget <= 0:
            return [], {}
        # Auto requests only into a batch auto is predicted to draft for (what pays for a few
        # sequences may not for many).
        auto = any(self._speculation(s) == "auto" for s in batch)
        everyone = [*self.active, *batch]
        auto_drafts = auto and self.policy.drafts_for(len(everyone), self._offered(everyone))
        wanted = [s for s in batch if (spec := self._speculation(s)) != 0 and (spec != "auto" or auto_drafts)]
        chunks = self._open_chunks(wanted, [], "drafter_prefill_pending", budget)
        early = [s for s in wanted if chunks.get(s.id, 0) > 0 or len(s.tokens) <= 1]  # one token: nothing to prefill
        return early, {s.id: chunks[s.id] for s in early}

    async def _undo_joins(self, join: asyncio.Task[int] | None, seqs: list[_Sequence]) -> None:
        """Close on the drafter the sequences opened there at admission that will not run."""
        await _settle(join)
        opened = [s.id for s in seqs if s.drafter.on_drafter]
        if opened and self.drafter is not None:
            await self._close_on_drafter(opened)

    def _smaller_cohort(self) -> int:
        ones = sum(s.cohort for s in self.active)
        return int(ones < len(self.active) - ones)

    def _open_chunks(
        self,
        opening: list[_Sequence],
        others: list[_Sequence],
        pending: str,
        round_budget: int,
        scores_prompts: bool = False,
    ) -> dict[str, int]:
        """What each sequence being opened prefills at its open, by id; one missing is opened whole.

        The sequences already prefilling (`pending` names their counter) have the first claim on
        the round's budget, and those being opened share what is left. `round_budget` 0: no
        chunks, every prompt whole at its open. `scores_prompts`: the verifier's opens, where a
        sequence that asks for its prompt's logprobs is prefilled whole (they come with the open).
        """
        if round_budget <= 0:
            return {}
        claimed = plan_prefill([(s.id, getattr(s, pending)) for s in others], round_budget)
        budget = round_budget - sum(claimed.values())
        chunked = [
            s for s in opening if not (scores_prompts and s.params.logprobs is not None and s.params.logprobs.prompt)
        ]
        shares = plan_prefill([(s.id, len(s.tokens) - 1) for s in chunked], budget)
        return {s.id: shares.get(s.id, 0) for s in chunked}

    @staticmethod
    def _spec(seq: _Sequence, prefill_tokens: int | None = None) -> common_pb2.SequenceSpec:
        """The sequence as committed so far (prompt plus any output), for opening it on a service.

        `prefill_tokens`: prefill that many tokens at the open and the rest in rounds (None: all).
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
        )

    async def _join_drafter(
        self,
        joining: list[_Sequence],
        filling: list[_Sequence],
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
            chunks = self._open_chunks(joining, filling, "drafter_prefill_pending", budget)
        specs = [self._spec(s, chunks.get(s.id)) for s in joining]
        opened = time.perf_counter_ns()
        try:
            results = await self.drafter.open(specs)
            if [r.sequence_id for r in results] != [s.id for s in joining]:
                raise BackendError("the drafter answered an open out of protocol")
        except Exception as exc:
            self._drafter_failed(f"open failed: {exc}", [s.id for s in joining])
            return 0
        if self.drafter_link is not None and not self.drafter_link.up:
            # The draft exchange beside this open failed meanwhile: what the open made is closed
            # with the other stale ids once the drafter is back, and these join again then.
            self.drafter_link.stale.update(s.id for s, r in zip(joining, results, strict=True) if not r.error.code)
            return 0
        elapsed = time.perf_counter_ns() - opened
        for s, spec, r in zip(joining, specs, results, strict=True):
            if r.error.code:
                log.warning("drafter refused %s: %s; it runs target-only", s.id, r.error.message)
                s.drafter.refused()
            else:
                s.drafter.opened(len(spec.prompt_token_ids))
                s.drafter_prefill_pending = r.prefill_pending if s.id in chunks else 0
        whole = {spec.sequence_id: len(spec.prompt_token_ids) - 1 for spec in specs}
        prefilled = sum(chunks.get(sid, n) for sid, n in whole.items())
        if alone:
            self.drafter_prefill.observe_prefill(prefilled, elapsed)
        return prefilled

    # -- plan ---------------------------------------------------------------
    def _cap(self, seq: _Sequence, after: int = 0, preparing: bool = False) -> int:
        """The most drafts the sequence can use in a block that starts `after` tokens from now
        (`preparing`: once ready on the drafter, for one waiting to join it or prefilling there)."""
        ready = (seq.drafter.pending or seq.drafter.drafting) if preparing else self._drafts_now(seq)
        if not ready:
            return 0
        remaining = seq.max_tokens - len(seq.output) - after
        return max(0, min(self.k_limit, remaining - 1, self.drafter_context - len(seq.tokens) - after))

    @staticmethod
    def _drafts_now(seq: _Sequence) -> bool:
        return seq.drafter.drafting and not seq.drafter_prefill_pending

    def _candidate(self, seq: _Sequence, cap: int) -> Candidate:
        spec = self._speculation(seq)
        if seq.acceptance is None:
            seq.acceptance = self.policy.new_sequence()
        if seq.guess is None:
            seq.guess = self.policy.new_guess_rate()
        fixed = None if spec == "auto" else min(int(spec), cap)
        return Candidate(
            cap=cap,
            rates=seq.acceptance.rates(),
            fixed=fixed,
            cohort=seq.cohort,
            guess=self.policy.guess_rate(seq.guess),
        )

    def _choose_ks(
        self, seqs: list[_Sequence], batch_size: int, measurable: bool = True
    ) -> tuple[dict[str, int], list[_Sequence]]:
        """Each sequence's k this round, and those the drafter should get ready; for `auto`, the round's pipeline.

        A sequence waiting to join the drafter, or still prefilling there, is offered to the
        policy as if it were ready: the drafter works on it (opens it, or prefills a chunk of it)
        only if the policy would have it draft, so not while drafting does not pay; it drafts
        from a later round. The round itself then runs the policy's choice for the sequences
        that can draft now.
        """
        preparing = {
            s.id
            for s in seqs
            if (s.drafter.pending and s.output and not s.done) or (s.drafter.drafting and s.drafter_prefill_pending)
        }
        caps = [self._cap(s, preparing=s.id in preparing) for s in seqs]
        offered = self._offered(seqs)
        try:
            candidates = [self._candidate(s, c) for s, c in zip(seqs, caps, strict=True)]
            ks = self.policy.choose(candidates, batch_size, offered, measurable)
            self._auto_pipeline = self.policy.last_pipeline
        except Exception:
            # The policy is an optimisation: without it, each sequence drafts what it may.
            log.exception("the speculation policy failed; drafting the full k this round")
            ks, self._auto_pipeline = caps, "sequential"
            candidates = [Candidate(cap=c, rates=(), fixed=c) for c in caps]
        wanted = []
        for s, k, c in zip(seqs, ks, candidates, strict=True):
            if s.id in preparing and k > 0 and (c.fixed is not None or self._join_pays(s)):
                wanted.append(s)
                s.joined_for_auto |= c.fixed is None
        if any(k > 0 for s, k in zip(seqs, ks, strict=True) if s.id in preparing):
            # They draft nothing this round: its ks and pipeline are chosen again for the sequences
            # that can draft in it, so that the round runs, and is measured against, a choice the
            # policy made for it, not one whose drafts half the batch cannot make yet.
            try:
                ready = [
                    c if s.id not in preparing else self._candidate(s, 0) for s, c in zip(seqs, candidates, strict=True)
                ]
                ks = self.policy.choose(ready, batch_size, offered, measurable, again=True)
                self._auto_pipeline = self.policy.last_pipeline
            except Exception:
                log.exception("the speculation policy failed; the sequences ready keep their first k")
        return {s.id: 0 if s.id in preparing else k for s, k in zip(seqs, ks, strict=True)}, wanted

    def _offered(self, seqs: Iterable[_Sequence]) -> tuple[str, ...]:
        """The pipelines a round of `seqs` is chosen among: with `auto` among the requests, all of
        them (requests that named one keep theirs); a mix of named ones is costed as sequential,
        as before there was a choice."""
        named = {s.params.pipeline or self.pipeline for s in seqs}
        return MODES if "auto" in named else tuple(named) if len(named) == 1 else ("sequential",)

    def _join_pays(self, seq: _Sequence) -> bool:
        """For a sequence the policy chose to draft: whether its drafts will repay opening it on the
        drafter. One already open (still prefilling there) has paid."""
        if not seq.drafter.pending:
            return True
        return self.policy.join_pays(len(seq.output), seq.max_tokens - len(seq.output), len(seq.tokens))

    def _pipeline(self, seq: _Sequence) -> str:
        named = seq.params.pipeline or self.pipeline
        return self._auto_pipeline if named == "auto" else named

    def _plan(self, everyone: list[_Sequence], round_id: int) -> RoundPlan:
        """Which sequences draft before the verify, which are verified, and which draft during it;
        and which prefill a chunk of their prompt, on the verifier or the drafter, instead."""
        plan = RoundPlan()
        if self.prefill_chunk_tokens > 0:
            budget = self.prefill_chunk_tokens - self._verifier_prefill_spent
            chunks = plan_prefill([(s.id, s.prefill_pending) for s in everyone], budget)
            plan.prefill = [(s, chunks[s.id]) for s in everyone if s.id in chunks]
        # A sequence still prefilling on the verifier waits for its last chunk.
        seqs = [s for s in everyone if not s.prefill_pending]
        # A round that prefills on the verifier teaches the policy nothing (see the observer).
        ks, wanted = self._choose_ks(seqs, len(seqs), measurable=not plan.prefill)
        # All may join: each prefills on the drafter only its share of what fits behind a verify.
        plan.join = [s for s in wanted if s.drafter.pending]
        filling = [s for s in wanted if s.drafter.drafting]
        # Only sequences that draft take turns; a cohort alone has no partner to overlap
        # with, and a sequence that does not draft is verified every round.
        turns = [s for s in seqs if self._pipeline(s) == "cohort" and ks[s.id] > 0 and s.output]
        paired = len({s.cohort for s in turns}) == 2
        first_rounds_drafted = False
        for s in seqs:
            k = ks[s.id]
            mode = self._pipeline(s)
            ready = self._ready(s)
            if self._cap(s) > 0:  # on the drafter, with room left to draft: did the policy use it?
                s.rounds_on_drafter += 1
                s.rounds_drafting += k > 0
            if not s.output:
                # Its first round is target-only whatever the pipeline, so that its first token
                # waits for no drafts; draft-ahead drafts its next block meanwhile, as long a
                # block as fits in the verify.
                plan.verify.append(s)
                if k > 0:
                    first_rounds_drafted = True
                    n = min(self._cap(s, after=1), self.ahead_limit, k, self._fits_in_verify(len(seqs)))
                    if mode == "ahead" and n > 0:
                        plan.ahead.append(DraftItem(s, n + 1, assumed=()))
                continue
            if mode == "cohort" and paired and k > 0:
                if s.cohort != round_id % 2:
                    if k > 0 and ready is None:
                        plan.ahead.append(DraftItem(s, k))  # verified next round, with these drafts
                    continue
                plan.verify.append(s)
                plan.ks[s.id] = min(len(ready.tokens), self._cap(s), k) if ready is not None else 0
                continue
            plan.verify.append(s)
            if ready is not None:
                # A block drafted earlier is verified up to this round's k: no more than chosen.
                plan.ks[s.id] = min(len(ready.tokens), self._cap(s), k)
            elif k > 0:
                plan.ks[s.id] = k
                plan.pre_draft.append(DraftItem(s, k))
            if mode == "ahead" and k > 0:
                # Drafted while the verifier checks this block, assuming all of it is
                # accepted: the first draft is a guess at the verifier's own token.
                # As many as this round's k, the best guess at the next round's.
                n = min(self._cap(s, after=plan.ks.get(s.id, 0) + 1), self.ahead_limit, k)
                if n > 0:
                    plan.ahead.append(DraftItem(s, n + 1, assumed=()))
        if first_rounds_drafted:
            self.policy.not_as_chosen()
        plan.drafter_prefill = self.drafter_prefill.tokens(self._drafting_beside(plan.ahead))
        if filling:
            # What it has left includes the tokens committed since the drafter last heard of it,
            # which this exchange brings: without them a prefill would stay one round behind for good.
            left = [(s.id, s.drafter_prefill_pending + len(s.tokens) - s.drafter.synced) for s in filling]
            chunks = plan_prefill(left, plan.drafter_prefill)
            # Prefilled on the drafter while the verifier works, like a draft-ahead.
            plan.ahead.extend(DraftItem(s, 0, prefill=chunks[s.id]) for s in filling if s.id in chunks)
        return plan

    def _drafting_beside(self, items: list[DraftItem]) -> float:
        """What the drafts among `items`, drafted beside the verify, are predicted to take of the
        drafter's time there (ns; 0 until the drafter has been timed)."""
        drafting = [item.num_draft_tokens for item in items if item.num_draft_tokens > 0]
        costs = self.policy.costs
        if not drafting or not costs.ready:
            return 0.0
        return costs.draft_ns(len(drafting), max(drafting), beside=True)

    def _fits_in_verify(self, sequences: int) -> int:
        """Drafts an ahead block (after its guess at the verifier's token) can hold without
        outlasting a target-only verify of `sequences`, by the policy's measured costs."""
        costs = self.policy.costs
        if not costs.ready:
            return 0
        step = costs.step_beside_ns(1)
        if step <= 0:
            return self.k_limit
        steps = (costs.verify.predict(sequences) - costs.draft_fixed.get()) / step
        return max(0, int(steps) - 1)

    def _ready(self, seq: _Sequence) -> Block | None:
        if seq.block is not None and seq.block.valid_for(seq.tokens):
            return seq.block
        return None

    # -- one round ------------------------------------------------------------
    async def _round(self) -> None:
        round_id = next(self._round_ids)
        seqs = list(self.active)
        wasted = self._drop_stale_blocks(seqs)
        plan = self._plan(seqs, round_id)
        if not plan.verify and not plan.prefill:
            return  # only prompts to prefill, and their opens spent this round's budget
        # Sequences drafting for the next round only (cohort) get a round span too: their draft is in it.
        taking_part = {s.id: s for s in [*plan.verify, *(item.seq for item in plan.ahead)]}
        spans = self.observer.start_spans(round_id, list(taking_part.values()))
        contexts = {sid: self.tracing.inject(span) for sid, span in spans.items()}
        started = time.perf_counter_ns()

        # 1. Drafts the verify needs now; a verified sequence's block is used up by this round.
        blocks: dict[str, Block] = {}
        for s in plan.verify:
            if (ready := self._ready(s)) is not None:
                blocks[s.id] = ready
            s.block = None
        pre = await self._draft(round_id, plan.pre_draft, contexts) if plan.pre_draft else None
        for item in plan.pre_draft if pre is not None else ():
            proposal = pre.verdicts.proposals.get(item.seq.id)
            if proposal is not None:
                blocks[item.seq.id] = Block(
                    list(proposal.token_ids), list(proposal.distributions), len(item.seq.tokens)
                )
        ks = {s.id: min(plan.ks.get(s.id, 0), len(blocks[s.id].tokens)) if s.id in blocks else 0 for s in plan.verify}
        draft_done = time.perf_counter_ns()

        # 2. The verify, and meanwhile the drafts of the next round.
        ahead_items = [
            self._assume_block(item, blocks, ks)
            for item in plan.ahead
            if item.seq.drafter.drafting and not item.seq.done
        ]
        request = verify_request(round_id, plan.verify, blocks, ks, contexts, plan.prefill)
        filling = [item.seq for item in plan.ahead if item.prefill]
        ahead_task: asyncio.Task[Any] | None = None
        join_task: asyncio.Task[int] | None = None

        def drafter_work() -> tuple[asyncio.Task[Any] | None, asyncio.Task[int] | None]:
            ahead = asyncio.create_task(self._draft(round_id, ahead_items, contexts)) if ahead_items else None
            join = (
                asyncio.create_task(
                    self._join_drafter(plan.join, filling, alone=not ahead_items, budget=plan.drafter_prefill)
                )
                if plan.join
                else None
            )
            return ahead, join

        if self.drafter_overlap:
            ahead_task, join_task = drafter_work()
        try:
            reply = await self.verifier.verify(request)
            replied = time.perf_counter_ns()
            if not self.drafter_overlap:
                ahead_task, join_task = drafter_work()
        finally:
            # Settled whatever the verify did, so no exchange outlives its round.
            ahead_failure = await _settle(ahead_task)
            verified = time.perf_counter_ns()
            join_failure = await _settle(join_task)
            joined = time.perf_counter_ns()
        for failure in (ahead_failure, join_failure):
            if failure is not None:
                raise failure
        ahead = ahead_task.result() if ahead_task is not None else None
        joined_tokens = join_task.result() if join_task is not None else 0
        self.drafter_prefill.observe_verify(reply.timings.total_ns)
        if ahead is not None and ahead_items and all(item.prefill for item in ahead_items):
            self.drafter_prefill.observe_prefill(sum(item.prefill for item in ahead_items), ahead.elapsed_ns)
        for item in ahead_items if ahead is not None else ():
            proposal = ahead.verdicts.proposals.get(item.seq.id)
            if item.prefill:
                if proposal is not None:
                    item.seq.drafter_prefill_pending = proposal.prefill_pending
                continue
            item.seq.block = self._ahead_block(item, proposal)
        now = time.perf_counter_ns()
        times = RoundTimes(
            round_ns=now - started,
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

        # 3. Apply the verdicts, each sequence on its own; draft-ahead blocks that missed are dropped.
        everything = read_verdicts(request, reply, [*plan.verify, *(s for s, _ in plan.prefill)])
        for v in everything:
            self._apply(v)
        verdicts = [v for v in everything if v.prefill_pending is None]
        guesses = read_guesses(
            [(item.seq, item.seq.block) for item in ahead_items if item.seq.block is not None and item.seq.block.tail],
            verdicts,
        )
        wasted += self._drop_stale_blocks([item.seq for item in ahead_items])

        # 4. Observe, then retire.
        pipeline = "+".join(sorted({self._pipeline(s) for s in seqs}))
        prefilled = sum(n for _, n in plan.prefill)
        pre_drafted = [item.num_draft_tokens for item in plan.pre_draft] if pre is not None else []
        ahead_drafted = [item.num_draft_tokens for item in ahead_items if not item.prefill] if ahead else []
        self.observer.observe(
            RoundOutcome(
                round_id,
                verdicts,
                times,
                pipeline,
                wasted,
                spans,
                prefilled,
                pre_drafted,
                ahead_drafted,
                joined_tokens,
                guesses,
                sum(item.prefill for item in ahead_items),
            )
        )
        await self._retire([s for s in seqs if s.done])

    def _drop_stale_blocks(self, seqs: list[_Sequence]) -> int:
        """Forget blocks the committed tokens no longer match; returns how many drafts that throws away."""
        wasted = 0
        for s in seqs:
            if s.block is not None and (s.done or self._ready(s) is None):
                wasted += len(s.block.tokens) + (1 if s.block.tail else 0)
                s.block = None
        return wasted

    @staticmethod
    def _assume_block(item: DraftItem, blocks: dict[str, Block], ks: dict[str, int]) -> DraftItem:
        """A draft-ahead item assumes the block now being verified is accepted whole."""
        if item.assumed is None:  # not verified this round (cohort): nothing to assume
            return item
        block = blocks.get(item.seq.id)
        k = ks.get(item.seq.id, 0)
        return DraftItem(item.seq, item.num_draft_tokens, tuple(block.tokens[:k]) if block is not None else ())

    @staticmethod
    def _ahead_block(item: DraftItem, proposal: drafter_pb2.DraftProposal | None) -> Block | None:
        """The block drafted during the verify, and what the verify must commit for it to stand."""
        if proposal is None or not proposal.token_ids:
            return None
        tokens, dists = list(proposal.token_ids), list(proposal.distributions)
        base = len(item.seq.tokens)
        if item.assumed is None:
            return Block(tokens, dists, base)
        # The first draft guessed the verifier's own token after the assumed block.
        tail = (*item.assumed, tokens[0])
        return Block(tokens[1:], dists[1:], base + len(tail), tail)

    async def _draft(
        self, round_id: int, items: list[DraftItem], contexts: dict[str, dict[str, str]]
    ) -> _DraftExchange | None:
        """One draft exchange; a failed drafter marks itself down and the round goes on without drafts."""
        assert self.drafter is not None
        started = time.perf_counter_ns()
        request = draft_request(round_id, items, contexts)
        try:
            reply = await self.drafter.draft(request)
        except BackendError as exc:
            # Speculation is an optimisation: without drafts the round still makes progress.
            self._drafter_failed(str(exc))
            return None
        verdicts = read_drafts(items, reply)
        if verdicts.protocol_error:
            self._drafter_failed(verdicts.protocol_error)
            return None
        if self.drafter_link is not None:
            self.drafter_link.succeeded()
        for s, reason in verdicts.lost:
            self._rejoin_drafter(s, reason)
        for s, reason in verdicts.refused:
            log.warning("drafter refused %s: %s; continuing target-only", s.id, reason)
            s.drafter.park()
        for item, task in zip(items, request.tasks, strict=True):
            # An open failing beside this exchange may have marked the drafter down meanwhile.
            if item.seq.id in verdicts.proposals and item.seq.drafter.on_drafter:
                item.seq.drafter.synced_to(len(item.seq.tokens))
                hidden = item.seq.hidden
                if hidden is not None:
                    item.seq.drafter.sent_hidden(task.hidden_start + len(task.hidden_states) // hidden.row_bytes)
        return _DraftExchange(verdicts, reply.timings, time.perf_counter_ns() - started)

    def _apply(self, verdict: Verdict) -> None:
        s = verdict.seq
        try:
            if verdict.prefill_pending is not None and verdict.error is None:
                s.prefill_pending = verdict.prefill_pending
            elif verdict.drafts_refused:
                log.warning("verifier refused the drafts of %s; continuing target-only", s.id)
                self.metrics.refused_draft_blocks.inc()
                s.drafter.park()
            elif verdict.error is not None:
                self._fail(s, verdict.error)
            else:
                s.drafted += verdict.drafted
                s.accepted += verdict.accepted
                if verdict.drafted:
                    s.spec_steps.append((verdict.drafted, verdict.accepted))
                if s.hidden is not None:
                    s.hidden.add(verdict.hidden_start, verdict.hidden_states)
                self._commit(s, list(verdict.tokens), verdict.logprobs)
        except Exception as exc:
            self._fail(s, self._internal_error(f"applying the verdict of {s.id}", exc))

    def _internal_error(self, what: str, exc: BaseException) -> GenerationError:
        """Log a gateway bug under an id the client is told, so the two can be matched."""
        error_id = uuid.uuid4().hex[:12]
        log.error("internal error %s while %s", error_id, what, exc_info=exc)
        return internal(f"internal error in the gateway (error id {error_id})")

    def _commit(self, seq: _Sequence, new_tokens: list[int], logprobs: Sequence[Any] = ()) -> None:
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
            seq.events.put_nowait(Delta(text, emitted, [token_logprob_from_pb(lp) for lp in logprobs[: len(emitted)]]))
        if reason is not None:
            seq.done = True
            self._observe_finish(seq, reason)
            seq.events.put_nowait(Finished(reason, len(seq.prompt), len(seq.output), tuple(seq.spec_steps)))

    def _observe_finish(self, seq: _Sequence, reason: str) -> None:
        now = time.perf_counter_ns()
        ttft_s = (seq.first_token_ns - seq.submitted_ns) / 1e9
        tpot_s = (now - seq.first_token_ns) / 1e9 / (len(seq.output) - 1) if len(seq.output) > 1 else 0.0
        self.metrics.requests.labels(finished_reason=reason).inc()
        self.policy.observe_finished(len(seq.output))
        if seq.joined_for_auto:
            self.policy.observe_follow_through(seq.rounds_on_drafter, seq.rounds_drafting)
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
        on_drafter = [s.id for s in seqs if s.drafter.on_drafter]
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
        lost = [s for s in self.active if s.drafter.on_drafter]
        for s in lost:
            s.drafter.drafter_down()
        self.drafter_link.mark_down(reason, [*(s.id for s in lost), *also_open])

    def _rejoin_drafter(self, seq: _Sequence, reason: str) -> None:
        """The drafter lost this sequence (it restarted between two rounds): open it there again."""
        assert self.drafter_link is not None
        log.warning("drafter lost %s (%s); re-opening it there", seq.id, reason)
        seq.drafter.lost()
        self.drafter_link.stale.add(seq.id)

    @staticmethod
    async def _close_quietly(backend: Any, ids: list[str]) -> None:
        try:
            await backend.close_sequences(ids)
        except Exception as exc:  # a backend that lost them already freed them
            log.debug("close on %s failed: %s", getattr(backend, "name", backend), exc)
