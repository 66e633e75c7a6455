"""Per-request speculation statistics in vLLM's shape (`--per-request-spec-decode-metrics`).

Off by default, as in vLLM; on, a non-streamed response and the last chunk of a streamed one
carry `metrics.speculative_decoding`, which AIPerf reads:

- `num_spec_steps`: verify steps of the request that carried drafts (all its choices);
- `num_draft_tokens`, `num_accepted_draft_tokens`: drafts verified and accepted;
- `draft_acceptance_rate`: accepted / drafted (0 without drafts);
- `mean_acceptance_length`: tokens per step, 1 + accepted / steps (1 without steps);
- `acceptance_histogram`: index j counts the steps that accepted exactly j drafts (0 .. k);
- `num_spec_tokens`: k, the gateway's most drafts per step;
- `acceptance_rate_per_position`: index i, the share of steps whose draft i was accepted
  (vLLM's per-position acceptance rate, per request).

`detailed` adds `per_step_accepted` and `per_step_drafted`, one entry per step in order.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

MODES = ("off", "summary", "detailed")

# One verify step of a sequence that carried drafts: (drafts verified, drafts accepted).
Step = tuple[int, int]


def speculative_decoding(steps_per_choice: Iterable[Sequence[Step]], k: int, mode: str) -> dict[str, Any]:
    """The `metrics.speculative_decoding` object of a request whose choices took these steps."""
    steps = [step for choice in steps_per_choice for step in choice]
    drafted = sum(d for d, _ in steps)
    accepted = sum(a for _, a in steps)
    width = max([k, *(d for d, _ in steps)])
    histogram = [0] * (width + 1)
    per_position = [0] * width
    for _, a in steps:
        histogram[a] += 1
        for i in range(a):
            per_position[i] += 1
    out: dict[str, Any] = {
        "mean_acceptance_length": 1 + accepted / len(steps) if steps else 1.0,
        "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
        "acceptance_histogram": histogram,
        "num_spec_steps": len(steps),
        "num_accepted_draft_tokens": accepted,
        "num_draft_tokens": drafted,
        "num_spec_tokens": k,
        "acceptance_rate_per_position": [n / len(steps) for n in per_position] if steps else [0.0] * width,
    }
    if mode == "detailed":
        out["per_step_accepted"] = [a for _, a in steps]
        out["per_step_drafted"] = [d for d, _ in steps]
    return out
