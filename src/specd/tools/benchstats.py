"""The arithmetic of `specd bench`: latency summaries, metric deltas, the speedup bound.

Pure functions over numbers, so each figure the benchmark prints can be tested
on its own.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.round.speculation import leviathan_speedup
from specd.tools.traces import percentile

QUANTILES = (50, 95, 99)


@dataclass
class RequestResult:
    """One request as the client saw it."""

    ttft_s: float
    e2e_s: float
    completion_tokens: int
    chunk_gaps_s: list[float] = field(default_factory=list)  # between consecutive streamed chunks
    text: str = ""
    prompt_tokens: int = 0


def summarize(results: Sequence[RequestResult], wall_s: float) -> dict[str, Any]:
    """Throughput and latency percentiles of one run (one mode at one concurrency)."""
    tokens = sum(r.completion_tokens for r in results)
    tpot = [(r.e2e_s - r.ttft_s) / (r.completion_tokens - 1) for r in results if r.completion_tokens > 1]
    gaps = [g for r in results for g in r.chunk_gaps_s]
    out: dict[str, Any] = {
        "requests": len(results),
        "output_tokens": tokens,
        "wall_s": wall_s,
        "output_tokens_per_s": tokens / wall_s if wall_s > 0 else float("nan"),
        "output_tokens_per_s_per_user": (
            statistics.mean(r.completion_tokens / r.e2e_s for r in results if r.e2e_s > 0) if results else float("nan")
        ),
    }
    for name, values in (
        ("ttft_ms", [r.ttft_s for r in results]),
        ("tpot_ms", tpot),
        ("itl_ms", gaps),
        ("e2e_ms", [r.e2e_s for r in results]),
    ):
        for q in QUANTILES:
            out[f"{name}_p{q}"] = percentile(values, q) * 1000
        out[f"{name}_mean"] = statistics.mean(values) * 1000 if values else float("nan")
    return out


def serial_schedule(service: Sequence[RequestResult], concurrency: int) -> list[RequestResult]:
    """What N closed-loop clients see from a server that runs one request at a time.

    HF assisted generation only runs at batch size 1, so at concurrency N a
    server built on it serves requests one after another: request i starts when
    i-1 ends and was submitted when its client's previous request (i-N) ended.
    Given each request's measured solo timings, the queueing is exact arithmetic.
    """
    finished: list[float] = []
    out = []
    clock = 0.0
    for i, r in enumerate(service):
        submitted = finished[i - concurrency] if i >= concurrency else 0.0
        start = max(clock, submitted)
        clock = start + r.e2e_s
        finished.append(clock)
        wait = start - submitted
        out.append(
            RequestResult(
                wait + r.ttft_s, wait + r.e2e_s, r.completion_tokens, list(r.chunk_gaps_s), r.text, r.prompt_tokens
            )
        )
    return out


def serial_wall_s(service: Sequence[RequestResult]) -> float:
    return sum(r.e2e_s for r in service)


def delta(before: Mapping[str, float], after: Mapping[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def acceptance(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, Any]:
    """Acceptance figures from two scrapes of a specd gateway's /metrics; {} if nothing was drafted."""
    drafts = delta(before, after, "specd_spec_decode_num_drafts_total")
    draft_tokens = delta(before, after, "specd_spec_decode_num_draft_tokens_total")
    accepted = delta(before, after, "specd_spec_decode_num_accepted_tokens_total")
    if not drafts:
        return {}
    per_pos = {}
    prefix = "specd_spec_decode_num_accepted_tokens_per_pos_total|position="
    for key in after:
        if key.startswith(prefix):
            per_pos[int(key[len(prefix) :])] = delta(before, after, key) / drafts
    return {
        "drafts": drafts,
        "draft_tokens": draft_tokens,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else float("nan"),
        "mean_acceptance_length": 1.0 + accepted / drafts,
        "draft_tokens_per_draft": draft_tokens / drafts,
        "per_position_acceptance": [per_pos[p] for p in sorted(per_pos)],
    }


def histogram_mean(before: Mapping[str, float], after: Mapping[str, float], name: str, labels: str = "") -> float:
    """Mean of a Prometheus histogram's observations between two scrapes; nan if none."""
    count = delta(before, after, f"{name}_count{labels}")
    return delta(before, after, f"{name}_sum{labels}") / count if count else float("nan")


def round_costs(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """Mean per-round times (ms) by phase, and the mean k chosen per sequence-round.

    draft + verify + join + outside = round (gateway.metrics.RoundTimes); overhead (the round
    outside the services' own time) overlaps the exchanges and adds to nothing. outside_forwards
    is the round outside the models' forwards on its path, the drafter's beside the verify counted,
    and outside the joins (the drafter's Open reports no forward time)."""
    name = "specd_round_latency_seconds"
    phases = ("round", "draft", "verify", "join", "outside", "overhead")
    forwards = ("drafter_forward", "verifier_forward", "drafter_beside_forward", "forwards")
    out = {
        f"round_{phase}_ms": histogram_mean(before, after, name, f"|phase={phase}") * 1000
        for phase in (*phases, *forwards)
    }
    round_ms = out["round_round_ms"]
    out["round_outside_forwards_ms"] = round_ms - out["round_forwards_ms"] - out["round_join_ms"]
    # What disaggregation costs: the share of a round spent outside the two models'
    # forward passes (network hops, serialisation, scheduling, sampling).
    out["round_outside_models"] = out["round_outside_forwards_ms"] / round_ms if round_ms > 0 else float("nan")
    out["rounds"] = delta(before, after, "specd_rounds_total")
    out["mean_k"] = histogram_mean(before, after, "specd_spec_decode_chosen_k")
    out["mean_batch"] = histogram_mean(before, after, "specd_round_batch_size")
    # Which pipeline the rounds ran: under --pipeline auto, what the policy chose.
    prefix = "specd_pipeline_rounds_total|pipeline="
    for key in after:
        if key.startswith(prefix):
            out[f"rounds_{key[len(prefix) :]}"] = delta(before, after, key)
    return out


def speedup_bound(
    alpha: float, k: int, draft_step_ms: float, verify_ms: float, target_step_ms: float
) -> dict[str, float]:
    """Leviathan et al.'s expected speedup from measured acceptance and model costs.

    c = drafter step / target step and the verify ratio (checking k+1 tokens
    against one target step) come from the models' own forward times, so the
    bound leaves out exactly what a disaggregated stack adds: network hops,
    serialisation and scheduling.
    """
    if not (target_step_ms > 0 and k > 0):
        return {}
    c = draft_step_ms / target_step_ms
    v = verify_ms / target_step_ms
    return {"alpha": alpha, "k": k, "c": c, "verify_ratio": v, "bound": leviathan_speedup(alpha, k, c, v)}


# Modes that do not draft on the server: target-only, and the in-process HF peers.
NOT_DRAFTING = frozenset({"target", "hf", "hf-target"})


def drafted_again(modes: Sequence[str], levels: Sequence[int]) -> list[str]:
    """A warning per server that this bench sends the same prompts in more than one drafting run
    (mode and level: every level starts from the same prompts). A drafter that keeps earlier
    responses, as the suffix drafter does for every request of a server without API keys, drafts
    each run after the first from an earlier run's answers, so those runs read faster than a new
    prompt would."""
    runs: dict[str, list[str]] = {}
    for mode in modes:
        name, _, server = mode.partition("@")
        if name not in NOT_DRAFTING:
            runs.setdefault(server, []).extend(f"{mode}@{level}" for level in levels)
    return [
        f"{', '.join(names)} send {server or 'the --base-url server'} the same prompts: where its drafter "
        "keeps earlier responses (the suffix drafter does), every run after the first may draft from "
        "an earlier one's answers and read faster than it is; compare such runs on fresh stacks"
        for server, names in runs.items()
        if len(names) > 1
    ]
