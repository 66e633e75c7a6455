"""A sequence: what a request asked for, what it has committed, and its life as one state machine.

A sequence's life is two machines composed, each with one transition table that says which
changes are legal; every change goes through the table, and an illegal one raises (a gateway
bug, never a client's fault):

- `Life` (this module, `LIFE_TRANSITIONS`): where it is at the gateway and on the verifier.
- `DrafterState` (membership.py, `DRAFTER_TRANSITIONS`): its standing with the drafter, which
  only matters while it is running; the verifier alone can finish every sequence.

    submit ──▶ WAITING ──open──▶ RUNNING ──finish──▶ DONE
                  │  └─open_in_part─▶ PREFILLING ──prefilled──┘ ▲
                  └───────────────── fail ─────────────────────┴──▶ FAILED

`phase()` names the product the way the round sees it: waiting, prefilling, joining (opening
or prefilling on the drafter), drafting, target-only, parked, done, failed.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.trace import Status, StatusCode

from gateway.failures import GenerationError
from gateway.round.acceptance import Acceptance, HitRate
from gateway.round.detokenize import TextStream
from gateway.round.hidden_log import HiddenLog
from gateway.round.membership import DrafterMembership, DrafterState, MembershipError
from gateway.round.messages import Block
from specd.engine.params import LogprobsRequest, Penalties, SamplingParams, TokenLogprob


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
    # None: the gateway's --speculative-siblings; else the most siblings beside a block's chain.
    siblings: int | None = None
    # None: the gateway's --speculative-branches; else the most branches beside a draft-ahead block.
    branches: int | None = None
    # Structured output: canonical JSON Schema text the output must satisfy; "" = none.
    json_schema: str = ""
    # Structured output by an llguidance grammar (guided_regex, guided_choice); "" = none.
    grammar: str = ""
    # vLLM's: special tokens' text stays out of the output; a stop string that ended it stays in.
    skip_special_tokens: bool = True
    include_stop: bool = False


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


class Life(enum.Enum):
    WAITING = "waiting"  # queued at the gateway
    PREFILLING = "prefilling"  # open on the verifier, prompt chunks still to prefill there
    RUNNING = "running"  # verified every round it takes part in (drafting or target-only)
    DONE = "done"  # finished: EOS, a stop string or its length
    FAILED = "failed"  # an error, a cancellation or a shutdown ended it


# event: (the states it may leave, the state it enters)
LIFE_TRANSITIONS: dict[str, tuple[frozenset[Life], Life]] = {
    "open": (frozenset({Life.WAITING}), Life.RUNNING),
    "open_in_part": (frozenset({Life.WAITING}), Life.PREFILLING),
    "prefilled": (frozenset({Life.PREFILLING}), Life.RUNNING),
    "finish": (frozenset({Life.RUNNING}), Life.DONE),
    "fail": (frozenset({Life.WAITING, Life.PREFILLING, Life.RUNNING}), Life.FAILED),
}


@dataclass
class SequenceLife:
    state: Life = Life.WAITING
    # Called once, when the sequence ends (done or failed): what it held goes back (its client's share).
    on_over: Callable[[], None] | None = None

    def move(self, event: str) -> None:
        allowed, to = LIFE_TRANSITIONS[event]
        if self.state not in allowed:
            raise MembershipError(f"{event} is not allowed in state {self.state.value}")
        self.state = to
        if self.over and self.on_over is not None:
            on_over, self.on_over = self.on_over, None
            on_over()

    @property
    def over(self) -> bool:
        return self.state in (Life.DONE, Life.FAILED)


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
    life: SequenceLife = field(default_factory=SequenceLife)
    drafter: DrafterMembership = field(default_factory=DrafterMembership)
    block: Block | None = None  # drafts made ahead of its next verify (cohort, draft-ahead)
    cohort: int = 0  # which of the two cohorts it is verified with (cohort pipeline)
    deadline: float = 0.0  # time.monotonic() by which the request must end; 0 = none
    cancelled: bool = False
    client: str = ""  # whose share it counts against (gateway.round.shares)
    tenant: str = ""  # whose earlier responses the suffix drafter may draft it from (SequenceSpec.tenant)
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

    @property
    def done(self) -> bool:
        """Finished or failed: it takes part in no more rounds and is retired."""
        return self.life.over


def opened(seq: _Sequence, prefill_pending: int) -> None:
    """The verifier opened it, with `prefill_pending` prompt tokens still to prefill in rounds."""
    seq.prefill_pending = prefill_pending
    seq.life.move("open_in_part" if prefill_pending else "open")


def prefill_left(seq: _Sequence, pending: int) -> None:
    """A prefill chunk was cached on the verifier; `pending` tokens remain."""
    seq.prefill_pending = pending
    if not pending:
        seq.life.move("prefilled")


def fail(seq: _Sequence, error: GenerationError) -> None:
    """End the sequence with `error` (once: a sequence already over keeps its ending)."""
    if seq.done:
        return
    seq.life.move("fail")
    if seq.span is not None:
        seq.span.set_status(Status(StatusCode.ERROR, error.message))
        seq.span.set_attribute("specd.finish_reason", "error" if not seq.cancelled else "cancelled")
        seq.span.end()
        seq.span = None
    seq.events.put_nowait(Failed(error))


def phase(seq: _Sequence) -> str:
    """The sequence's place in the round: its life, and while running its standing with the drafter."""
    life = seq.life.state
    if life is not Life.RUNNING:
        return life.value
    drafter = seq.drafter.state
    if drafter is DrafterState.PENDING or (drafter is DrafterState.ACTIVE and seq.drafter_prefill_pending):
        return "joining"
    if drafter is DrafterState.ACTIVE:
        return "drafting"
    if drafter is DrafterState.PARKED:
        return "parked"
    return "target-only"
