"""Turns a round's outcome into spans, metrics and what the speculation policy learns.

Observing never fails a request: an error here is logged and the round's tokens
stand.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.metrics import GatewayMetrics, RoundTimes
from gateway.round.messages import Verdict
from gateway.round.speculation import SpeculationPolicy
from specd.rpc.tracing import Tracing

log = logging.getLogger(__name__)


@dataclass
class RoundOutcome:
    round_id: int
    verdicts: list[Verdict]
    times: RoundTimes
    pipeline: str = "sequential"  # the one it ran (under auto, the one chosen); "a+b" for a mixed batch
    wasted_drafts: int = 0  # drafted ahead and thrown away
    spans: dict[str, Any] = field(default_factory=dict)
    # Prompt chunks prefilled in the round on the verifier (chunked prefill): its times are not a verify's alone.
    prefill_tokens: int = 0
    # Drafts asked per sequence of the exchange before the verify, and of the one during it.
    pre_drafted: list[int] = field(default_factory=list)
    ahead_drafted: list[int] = field(default_factory=list)
    # Prompt tokens the drafter opened beside the verify (sequences joining it).
    joined_tokens: int = 0
    # Draft-ahead blocks whose assumed block was accepted whole: was the guess after it right?
    guesses: list[tuple[Any, bool]] = field(default_factory=list)
    # Prompt chunks the drafter prefilled beside the verify: the round's times are not its drafts' alone.
    drafter_prefill_tokens: int = 0
    # Fan-out draft-ahead: branches drafted, those adopted, and the guesses of those whose verdict came.
    branches: int = 0
    branch_hits: int = 0
    branch_outcomes: list[bool] = field(default_factory=list)
    fan_out_misses: int = 0  # fanned-out draft-aheads left with no block (the next round drafts first)
    unready: int = 0  # sequences the policy wanted drafts from, target-only while their drafter cache is not ready

    @property
    def drafted(self) -> list[int]:
        return [v.drafted for v in self.verdicts]

    @property
    def widths(self) -> list[int]:
        """The drafts each verified sequence's row carried, its chain's and its siblings'."""
        return [v.drafted + v.siblings for v in self.verdicts]

    @property
    def emitted(self) -> int:
        return sum(len(v.tokens) for v in self.verdicts)


class RoundObserver:
    def __init__(
        self,
        metrics: GatewayMetrics,
        policy: SpeculationPolicy,
        tracing: Tracing,
        later: Callable[[Callable[[], None]], object] | None = None,
    ) -> None:
        self.metrics = metrics
        self.policy = policy
        self.tracing = tracing
        # Runs a round's metrics (None: at once). The scheduler's runs them when it next waits, on the
        # next round's exchange with its request sent, not between a round's reply and that request.
        self.later = later

    def start_spans(self, round_id: int, seqs: Sequence[Any]) -> dict[str, Any]:
        """One round span per request, under that request's span.

        A trace viewer shows one request's trace at a time, and each then holds all
        of its rounds and the services' work in them. The batch a round served is in
        the specd.round_id / specd.batch_size attributes, shared by its spans.
        """
        if not self.tracing.enabled:
            return {}
        return {
            s.id: self.tracing.start("specd.round", s.span, attributes={"specd.round_id": round_id})
            for s in seqs
            if s.span is not None
        }

    def observe_commits(self, emitted: Sequence[Any], finished: Sequence[tuple[Any, str]]) -> None:
        """The latencies of what a round emitted (`Emission`s), and the sequences it finished."""
        try:
            for e in emitted:
                if e.ttft_s is not None:
                    self.metrics.ttft.observe(e.ttft_s)
                else:
                    self.metrics.itl.observe(e.itl_s)
                self.metrics.observe_generated(e.tokens)
            for seq, reason in finished:
                self.finished(seq, reason)
        except Exception:
            log.exception("observing a round's commits failed; its tokens stand")

    def finished(self, seq: Any, reason: str) -> None:
        """A sequence's end: its latencies, what the policy learns of it, and its span."""
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

    def observe(self, outcome: RoundOutcome) -> None:
        """What the round teaches the policy, and its spans, now: the next round's plan reads the one,
        and the other ends with the round. Its metrics go through `later` (see __init__)."""
        try:
            self._observe(outcome)
        except Exception:
            log.exception("observing round %d failed; its tokens stand", outcome.round_id)
            return
        finally:
            for span in outcome.spans.values():
                if span.is_recording():
                    span.end()
        record = functools.partial(self._record, outcome)
        if self.later is None:
            record()
        else:
            self.later(record)

    def _record(self, outcome: RoundOutcome) -> None:
        """The round's metrics."""
        try:
            proposals = [(v.drafted, v.accepted) for v in outcome.verdicts if v.error is None and not v.drafts_refused]
            self.metrics.observe_round(proposals, len(outcome.verdicts), outcome.times)
            self.metrics.pipeline_rounds.labels(pipeline=outcome.pipeline).inc()
            self.metrics.observe_ks(outcome.drafted)
            self.metrics.drafter_unready_rounds.inc(outcome.unready)
            if outcome.wasted_drafts:
                self.metrics.wasted_draft_tokens.inc(outcome.wasted_drafts)
        except Exception:
            log.exception("recording round %d's metrics failed; its tokens stand", outcome.round_id)

    def _observe(self, outcome: RoundOutcome) -> None:
        times = outcome.times
        for v in outcome.verdicts:
            if v.error is None and not v.drafts_refused:
                self._learn_acceptance(v)
        for seq, hit in outcome.guesses:
            self.policy.observe_guess(getattr(seq, "guess", None), hit)
            self.metrics.ahead_guesses.labels(outcome="right" if hit else "wrong").inc()
        self._learn_branches(outcome)
        choice = self.policy.last_choice
        observed_gain = None
        if not outcome.prefill_tokens:
            # A round that also prefilled on the verifier would teach the policy a verify far dearer
            # than it is, and hold its pipeline to account for a prefill it did not choose.
            # Nor does a join's wait belong to the costs of drafting and verifying: it is paid
            # once per sequence, in rounds the policy chose for their drafts, not for their verify.
            # The drafter's prefill beside the verify is the pipeline's own doing (it prepares the
            # drafts the policy chose): such a round still calibrates the pipeline, though its
            # times teach no cost. Left out, a policy whose batch joins the drafter round after
            # round learns nothing while it joins, and keeps a choice its rounds do not bear out.
            observed_gain = self.policy.observe_round(
                outcome.widths,
                times.round_ns - times.join_ns,
                times.draft_ns,
                times.verify_ns,
                times.drafter_forward_ns,
                outcome.emitted,
                outcome.pre_drafted,
                outcome.ahead_drafted,
                outcome.joined_tokens,
                times.join_ns,
                times.verify_reply_ns,
                times.overlap_ns,
                times.overlap_forward_ns,
                learn_costs=not outcome.drafter_prefill_tokens,
            )
        self._annotate(outcome, choice, observed_gain)

    def _learn_branches(self, outcome: RoundOutcome) -> None:
        """Fan-out draft-ahead: the branches drafted and adopted, and their guesses' hit rate."""
        if outcome.branches:
            self.metrics.num_branches.inc(outcome.branches)
            self.metrics.num_branch_hits.inc(outcome.branch_hits)
            self.metrics.num_fan_out_misses.inc(outcome.fan_out_misses)
        for hit in outcome.branch_outcomes:
            self.policy.observe_branch(hit)

    def _learn_acceptance(self, v: Verdict) -> None:
        """What one verdict teaches: the chain's acceptance per position, and its siblings' hits."""
        if v.siblings:
            self.policy.observe_siblings(v.siblings, v.sibling_hit)
            self.metrics.num_sibling_tokens.inc(v.siblings)
            self.metrics.num_accepted_siblings.inc(int(v.sibling_hit))
        if not v.drafted:
            return
        # A sibling accepted stands where the chain's draft was rejected.
        chain_accepted = v.accepted - int(v.sibling_hit)
        acceptance = getattr(v.seq, "acceptance", None)
        if acceptance is not None:
            acceptance.observe(v.drafted, chain_accepted)
        self.policy.overall.observe(v.drafted, chain_accepted)

    def _annotate(self, outcome: RoundOutcome, choice: Any, observed_gain: float | None) -> None:
        """The round's spans: what each sequence drafted and had accepted, and what the policy believed."""
        attributes = outcome.times.attributes(len(outcome.verdicts))
        round_k_max = max(outcome.drafted, default=0)
        # Once per round, not per span: a round of a large batch has one span per sequence.
        predictions = offered_text(choice.offered) if choice is not None and len(choice.offered) > 1 else ""
        for v in outcome.verdicts:
            span = outcome.spans.get(v.seq.id)
            if span is None:
                continue
            span.set_attributes(
                {
                    "specd.k": v.drafted,
                    "specd.accepted": v.accepted,
                    "specd.siblings": v.siblings,
                    "specd.sibling_hit": v.sibling_hit,
                    "specd.round_k_max": round_k_max,
                    "specd.pipeline": outcome.pipeline,
                    **attributes,
                }
            )
            if choice is not None:
                # What the policy believed: a trace reader can tell a wrong cost from a wrong acceptance.
                span.set_attributes(
                    {
                        "specd.predicted_gain": choice.predicted_gain,
                        "specd.predicted_tokens_per_s": choice.predicted_rate,
                        "specd.baseline_tokens_per_s": choice.baseline_rate,
                        "specd.overlap_estimate": self.policy.overlap.value,
                        # Realised over modelled tokens of this pipeline's recent rounds (1: as modelled).
                        "specd.pipeline_calibration": self.policy.calibration.factor(choice.pipeline, len(choice.ks)),
                    }
                )
                if predictions:
                    span.set_attribute("specd.pipeline_predictions", predictions)
            if observed_gain is not None:
                span.set_attribute("specd.observed_gain", observed_gain)


def offered_text(offered: Sequence[tuple[str, float, float]]) -> str:
    """The pipelines a round's choice weighed, for a span: "sequential 61.2/k0.0, cohort 80.4/k3.5"
    (predicted tokens per second of the round, and its mean k)."""
    return ", ".join(f"{mode} {rate:.1f}/k{k:.1f}" for mode, rate, k in offered)
