"""A drafter's or verifier's own Prometheus metrics, and the process's peak memory."""

from __future__ import annotations

import sys
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from specd.engine.tasks import RoundTiming


class ServiceMetrics:
    """A drafter's or verifier's own Prometheus metrics, served on --metrics-port."""

    def __init__(self, service: str, engine: Any) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.rounds = Counter(f"specd_{service}_rounds", "Batched rounds served", registry=r)
        self.forward = Histogram(
            f"specd_{service}_forward_seconds",
            "Time in model forward passes per round",
            buckets=(0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0),
            registry=r,
        )
        self.batch = Histogram(
            f"specd_{service}_batch_size", "Sequences per round", buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r
        )
        self.tokens_fed = Counter(f"specd_{service}_tokens_fed", "Tokens fed through the model in rounds", registry=r)
        # A prompt prefilled whole at its open is no round's work: without these, a service's
        # prefill (on a drafter, a quantized copy's, often dearer per token than its drafting)
        # shows in its CPU time and nowhere else.
        self.open_prefill_tokens = Counter(
            f"specd_{service}_open_prefill_tokens",
            "Prompt tokens cached when sequences open (computed, or copied from an open sequence with the same prefix)",
            registry=r,
        )
        self.open_prefill = Counter(
            f"specd_{service}_open_prefill_seconds", "Time in model forward passes prefilling at opens", registry=r
        )
        self.hidden_rows = Counter(
            f"specd_{service}_hidden_state_rows",
            "The target's hidden states (one per position) returned (verifier) or received (a feature drafter)",
            registry=r,
        )
        self.expired = Counter(
            f"specd_{service}_sequences_expired",
            "Sequences freed because their owner's lease lapsed (a gateway that died or was cut off)",
            registry=r,
        )
        Gauge(f"specd_{service}_open_sequences", "Sequences open", registry=r).set_function(lambda: len(engine.table))
        Gauge(
            f"specd_{service}_kv_cache_bytes",
            "KV-cache bytes backed by memory now (CPU: the written positions of open sequences; "
            "accelerators: all of the reservation)",
            registry=r,
        ).set_function(engine.kv_bytes)
        Gauge(
            f"specd_{service}_kv_cache_reserved_bytes",
            "The most the KV cache can ever take: --max-sequences x --max-context positions",
            registry=r,
        ).set_function(engine.table.kv_reserved_bytes)
        Gauge(
            f"specd_{service}_kv_cache_bytes_per_token",
            "KV-cache bytes one token of one sequence takes (all layers, keys and values)",
            registry=r,
        ).set_function(engine.table.kv_bytes_per_token)
        Gauge(f"specd_{service}_peak_rss_bytes", "Peak resident set size of this process", registry=r).set_function(
            peak_rss_bytes
        )

    def observe(self, timing: RoundTiming | None) -> None:
        if timing is None:
            return
        self.rounds.inc()
        self.forward.observe(timing.forward_ns / 1e9)
        self.batch.observe(timing.batch_size)
        self.tokens_fed.inc(timing.tokens_fed)

    def observe_open(self, tokens: int, forward_ns: int) -> None:
        self.open_prefill_tokens.inc(tokens)
        self.open_prefill.inc(forward_ns / 1e9)

    def serve(self, host: str, port: int) -> None:
        start_http_server(port, addr=host, registry=self.registry)


def peak_rss_bytes() -> int:
    """The process's peak resident set size (Linux reports ru_maxrss in KiB, macOS in bytes)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024
