"""Prometheus metrics of the gateway, with vLLM's speculative-decoding semantics.

Names mirror vLLM's `spec_decode_*` counters so dashboards translate: a "draft"
is one sequence's proposal in one round, mean acceptance length is
1 + accepted_tokens / drafts.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest


class GatewayMetrics:
    def __init__(self, max_positions: int) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
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
        self.rounds = Counter("specd_rounds", "Draft/verify rounds run", registry=r)
        self.prompt_tokens = Counter("specd_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("specd_generation_tokens", "Tokens generated", registry=r)
        self.requests = Counter(
            "specd_request_success", "Finished requests by finish reason", ["finished_reason"], registry=r
        )
        self.running = Gauge("specd_num_requests_running", "Sequences in the running batch", registry=r)
        self.waiting = Gauge("specd_num_requests_waiting", "Requests waiting for a batch slot", registry=r)

    def observe_round(self, proposals: Sequence[tuple[int, int]]) -> None:
        """One round; `proposals` holds (draft tokens, accepted) per sequence that had a draft."""
        self.rounds.inc()
        for drafted, accepted in proposals:
            if drafted == 0:
                continue
            self.num_drafts.inc()
            self.num_draft_tokens.inc(drafted)
            self.num_accepted_tokens.inc(accepted)
            for pos in range(accepted):
                self.accepted_per_pos.labels(position=str(pos)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
