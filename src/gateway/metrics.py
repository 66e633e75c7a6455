"""Prometheus metrics of the gateway, with vLLM's speculative-decoding semantics.

Names mirror vLLM's `spec_decode_*` counters so dashboards translate: a "draft"
is one sequence's proposal in one round, mean acceptance length is
1 + accepted_tokens / drafts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from specd.rpc.service_metrics import peak_rss_bytes

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 128)


@dataclass(frozen=True)
class RoundTimes:
    """Where one round's time went, as the gateway saw it and as the services reported.

    The draft and drafter times are the drafting on the round's critical path (before
    the verify); `overlap_ns` is the drafting that ran while the verifier worked
    (cohort and draft-ahead pipelines), which costs the round nothing unless it
    outlasts the verify.
    """

    round_ns: int
    draft_ns: int
    verify_ns: int  # the verify, and the wait for any draft exchange run beside it
    drafter_ns: int
    verifier_ns: int
    drafter_forward_ns: int
    verifier_forward_ns: int
    overlap_ns: int = 0
    # The round's wait, after the verify, for the drafter to open the sequences joining it.
    join_ns: int = 0
    # The verify exchange alone, from its request to its reply: without the wait for a draft
    # exchange beside it, which `verify_ns` includes. 0: not timed apart.
    verify_reply_ns: int = 0
    # The drafter's forward passes in the draft exchange beside the verify (`overlap_ns` is the exchange).
    overlap_forward_ns: int = 0

    @property
    def overhead_ns(self) -> int:
        """Network, serialisation and gateway scheduling: the round minus the services' own time on its path."""
        return self.round_ns - self.drafter_ns - self.verifier_ns

    @property
    def outside_ns(self) -> int:
        """The round outside its exchanges: draft + verify + join + outside = round. (`overhead_ns`
        overlaps the exchanges, so it adds to them into more than the round.)"""
        return self.round_ns - self.draft_ns - self.verify_ns - self.join_ns

    @property
    def forwards_ns(self) -> int:
        """The models' forwards on the round's path: the drafter's before the verify, then the
        verifier's or, where it took longer, the drafter's beside the verify (draft-ahead, prefill
        chunks), which the verify waits for. At least their time: on one device the two may run one
        after the other. A join's Open reports no forward time: see `join_ns`."""
        return self.drafter_forward_ns + max(self.verifier_forward_ns, self.overlap_forward_ns)

    def attributes(self, batch_size: int) -> dict[str, float | int]:
        return {
            "specd.batch_size": batch_size,
            "specd.round_ms": self.round_ns / 1e6,
            "specd.draft_ms": self.draft_ns / 1e6,
            "specd.verify_ms": self.verify_ns / 1e6,
            "specd.verify_reply_ms": self.verify_reply_ns / 1e6,
            "specd.drafter_ms": self.drafter_ns / 1e6,
            "specd.verifier_ms": self.verifier_ns / 1e6,
            "specd.drafter_forward_ms": self.drafter_forward_ns / 1e6,
            "specd.verifier_forward_ms": self.verifier_forward_ns / 1e6,
            "specd.overlap_ms": self.overlap_ns / 1e6,
            "specd.overlap_forward_ms": self.overlap_forward_ns / 1e6,
            "specd.join_ms": self.join_ns / 1e6,
            "specd.overhead_ms": self.overhead_ns / 1e6,
            "specd.outside_ms": self.outside_ns / 1e6,
            "specd.forwards_ms": self.forwards_ns / 1e6,
        }


class GatewayMetrics:
    def __init__(self, max_positions: int) -> None:
        self.max_positions = max_positions
        # Plain totals beside the Prometheus counters, for the periodic log line.
        self._totals: dict[str, float] = dict.fromkeys(
            ["drafts", "draft_tokens", "accepted", "generated", *(f"pos{p}" for p in range(max_positions))], 0.0
        )
        self.registry = CollectorRegistry()
        r = self.registry
        self._speculation_metrics(r, max_positions)
        self._round_counters(r)
        self._request_metrics(r)
        self._batch_metrics(r, max_positions)
        self._gauges(r)

    def _speculation_metrics(self, r: CollectorRegistry, max_positions: int) -> None:
        """Counters of drafts and their acceptance, in vLLM's `spec_decode_*` names."""
        self.num_drafts = Counter("specd_spec_decode_num_drafts", "Sequence proposals verified", registry=r)
        self.num_draft_tokens = Counter(
            "specd_spec_decode_num_draft_tokens", "Draft tokens sent for verification", registry=r
        )
        self.num_accepted_tokens = Counter(
            "specd_spec_decode_num_accepted_tokens", "Draft tokens accepted by the verifier", registry=r
        )
        self.accepted_per_pos = Counter(
            "specd_spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position (0 = first)",
            ["position"],
            registry=r,
        )
        # Pre-create the position series so rates start at 0 rather than being absent.
        for pos in range(max_positions):
            self.accepted_per_pos.labels(position=str(pos))
        Gauge(
            "specd_spec_decode_mean_acceptance_length",
            "1 + accepted tokens / drafts since start (tokens emitted per sequence-round with a draft)",
            registry=r,
        ).set_function(self._mean_acceptance_length)
        # Token trees: the siblings sent beside the chains, and those the accepted path ended in.
        self.num_sibling_tokens = Counter(
            "specd_spec_decode_num_sibling_tokens", "Sibling drafts (token trees) sent for verification", registry=r
        )
        self.num_accepted_siblings = Counter(
            "specd_spec_decode_num_accepted_siblings",
            "Sibling drafts accepted (the chain's draft beside them was not)",
            registry=r,
        )
        # Fan-out draft-ahead: the other blocks drafted beside draft-ahead blocks, and those adopted
        # because the verdict was theirs (the main block's assumption or guess missed).
        self.num_branches = Counter(
            "specd_spec_decode_num_branches", "Branches (fan-out draft-ahead) drafted beside ahead blocks", registry=r
        )
        self.num_branch_hits = Counter(
            "specd_spec_decode_num_branch_hits",
            "Branches adopted as a sequence's next block (its main ahead block missed)",
            registry=r,
        )
        self.num_fan_out_misses = Counter(
            "specd_spec_decode_num_fan_out_misses",
            "Fanned-out draft-aheads whose verdict neither their main block nor a branch assumed",
            registry=r,
        )
        self.wasted_draft_tokens = Counter(
            "specd_spec_decode_num_wasted_draft_tokens",
            "Draft tokens drafted ahead (or for a cohort) and discarded before verification",
            registry=r,
        )
        # Above 0 means a gateway bug (drafts sent with a q that does not fit them): acceptance
        # then collapses to target-only for those sequences without any request failing.
        self.refused_draft_blocks = Counter(
            "specd_spec_decode_num_refused_draft_blocks",
            "Draft blocks the verifier refused (their distributions did not fit their tokens)",
            registry=r,
        )
        self.drafter_unready_rounds = Counter(
            "specd_spec_decode_drafter_unready_rounds",
            "Sequence-rounds after a sequence's first verified target-only though drafts were wanted, because "
            "its drafter cache was not ready yet (waiting to open on the drafter, or its prefill there in flight)",
            registry=r,
        )
        self.ahead_guesses = Counter(
            "specd_spec_decode_ahead_guesses",
            "Draft-ahead guesses at the verifier's own token after a block accepted whole, by outcome",
            ["outcome"],
            registry=r,
        )

    def _round_counters(self, r: CollectorRegistry) -> None:
        """Rounds run, by the pipeline they ran."""
        self.rounds = Counter("specd_rounds", "Draft/verify rounds run", registry=r)
        self.pipeline_rounds = Counter(
            "specd_pipeline_rounds",
            "Rounds by the pipeline they ran (under --pipeline auto, the one the policy chose; "
            "a batch mixing pipelines named per request joins them with +)",
            ["pipeline"],
            registry=r,
        )

    def _request_metrics(self, r: CollectorRegistry) -> None:
        """Tokens, finished requests and their latencies."""
        self.prompt_tokens = Counter("specd_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("specd_generation_tokens", "Tokens generated", registry=r)
        self.requests = Counter(
            "specd_request_success", "Finished requests by finish reason", ["finished_reason"], registry=r
        )
        self.ttft = Histogram(
            "specd_time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            "specd_time_per_output_token_seconds",
            "Mean time per output token after the first, per request",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "specd_inter_token_latency_seconds",
            "Time between consecutive emissions to a client (one per round; a round may emit several tokens)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "specd_e2e_request_latency_seconds", "End-to-end request latency", buckets=E2E_BUCKETS, registry=r
        )

    def _batch_metrics(self, r: CollectorRegistry, max_positions: int) -> None:
        """Each round's latency by phase, the batch and the queue, and the ks chosen."""
        self.round_latency = Histogram(
            "specd_round_latency_seconds",
            "Round latency: round (the whole), split into draft (drafter exchange), verify (verifier exchange, "
            "and any drafter exchange beside it), join (the drafter opening joining sequences) and outside "
            "(the gateway's own time), which add up to round; overhead (network, serialisation and gateway "
            "scheduling: the round minus both services' own time) overlaps them; drafter_forward and "
            "verifier_forward are the models' forward time inside draft and verify, drafter_beside_forward "
            "the drafter's inside the exchange beside the verify, forwards the models' forward time on the "
            "round's path (see gateway.metrics.RoundTimes)",
            ["phase"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram("specd_round_batch_size", "Sequences per round", buckets=BATCH_BUCKETS, registry=r)
        self.running = Gauge("specd_num_requests_running", "Sequences in the running batch", registry=r)
        self.waiting = Gauge("specd_num_requests_waiting", "Requests waiting for a batch slot", registry=r)
        self.chosen_k = Histogram(
            "specd_spec_decode_chosen_k",
            "Draft tokens chosen per sequence-round (0 = the sequence ran target-only in that round)",
            buckets=tuple(range(max(1, max_positions) + 1)),
            registry=r,
        )

    def _gauges(self, r: CollectorRegistry) -> None:
        """The process's peak memory and the speculation policy's estimates."""
        self._policy: Any = None
        Gauge("specd_gateway_peak_rss_bytes", "Peak resident set size of the gateway process", registry=r).set_function(
            peak_rss_bytes
        )
        Gauge(
            "specd_spec_decode_predicted_gain",
            "Adaptive speculation: predicted tokens/s of the chosen ks over target-only, moving average",
            registry=r,
        ).set_function(lambda: self._policy.predicted_gain.get(1.0) if self._policy is not None else 1.0)
        Gauge(
            "specd_spec_decode_observed_gain",
            "Adaptive speculation: measured tokens/s of its rounds over the predicted target-only rate, moving average",
            registry=r,
        ).set_function(lambda: self._policy.observed_gain.get(1.0) if self._policy is not None else 1.0)

        Gauge(
            "specd_pipeline_overlap",
            "Share of the shorter of a verify and a draft exchange run at once that hid behind the longer, "
            "as measured (1 before any measurement: the policy's optimistic prior)",
            registry=r,
        ).set_function(lambda: self._policy.overlap.value if self._policy is not None else 1.0)

    def bind_policy(self, policy: Any) -> None:
        """The speculation policy whose gain estimates the gauges report."""
        self._policy = policy

    def observe_ks(self, ks: Sequence[int]) -> None:
        for k in ks:
            self.chosen_k.observe(k)

    def observe_round(self, proposals: Sequence[tuple[int, int]], batch_size: int, times: RoundTimes) -> None:
        """One round; `proposals` holds (draft tokens, accepted) per sequence verified."""
        self.rounds.inc()
        self.batch_size.observe(batch_size)
        phases = {
            "round": times.round_ns,
            "draft": times.draft_ns,
            "verify": times.verify_ns,
            "join": times.join_ns,
            "outside": times.outside_ns,
            "overhead": max(0, times.overhead_ns),
            # The models' own forward time, for the bound on speedup that `specd bench` reports.
            "drafter_forward": times.drafter_forward_ns,
            "verifier_forward": times.verifier_forward_ns,
            "drafter_beside_forward": times.overlap_forward_ns,
            "forwards": times.forwards_ns,
        }
        for phase, ns in phases.items():
            self.round_latency.labels(phase=phase).observe(ns / 1e9)
        for drafted, accepted in proposals:
            if drafted == 0:
                continue
            self.num_drafts.inc()
            self.num_draft_tokens.inc(drafted)
            self.num_accepted_tokens.inc(accepted)
            self._totals["drafts"] += 1
            self._totals["draft_tokens"] += drafted
            self._totals["accepted"] += accepted
            for pos in range(accepted):
                self.accepted_per_pos.labels(position=str(pos)).inc()
                self._totals[f"pos{pos}"] += 1

    def _mean_acceptance_length(self) -> float:
        drafts = self._totals["drafts"]
        return 1.0 + self._totals["accepted"] / drafts if drafts else 0.0

    def observe_generated(self, tokens: int) -> None:
        self.generation_tokens.inc(tokens)
        self._totals["generated"] += tokens

    def snapshot(self) -> dict[str, float]:
        """Counter totals for the periodic stats log line."""
        return dict(self._totals)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def stats_line(before: dict[str, float], after: dict[str, float], seconds: float, positions: int) -> str | None:
    """The engines' periodic speculation summary, from two snapshots; None when nothing was drafted."""
    drafts = after["drafts"] - before["drafts"]
    if drafts <= 0:
        return None
    drafted = after["draft_tokens"] - before["draft_tokens"]
    accepted = after["accepted"] - before["accepted"]
    per_pos = ", ".join(f"{(after[f'pos{p}'] - before[f'pos{p}']) / drafts:.3f}" for p in range(positions))
    return (
        f"SpecDecoding metrics: mean acceptance length {1 + accepted / drafts:.2f}, "
        f"accepted throughput {accepted / seconds:.1f} tokens/s, drafted throughput {drafted / seconds:.1f} tokens/s, "
        f"accepted {int(accepted)}, drafted {int(drafted)}, per-position acceptance rate: {per_pos}, "
        f"generation throughput {(after['generated'] - before['generated']) / seconds:.1f} tokens/s"
    )
