"""Cost models fitted from exact synthetic measurements, for the speculation policy's tests."""

from __future__ import annotations

from gateway.round.costs import CostModel

MS = 1e6


def costs(
    verify_fixed_ms: float, verify_per_token_ms: float, step_ms: float, step_per_seq_ms: float = 0.0
) -> CostModel:
    """A verify linear in verified positions, a draft step linear in batch size, 0.5 ms fixed costs."""
    model = CostModel()
    for tokens in (1, 2, 4, 8, 16, 40, 64):
        model.verify.observe(tokens, (verify_fixed_ms + verify_per_token_ms * tokens) * MS)
    for batch in (1, 2, 4, 8, 16):
        model.step.observe(batch, (step_ms + step_per_seq_ms * batch) * MS)
    model.draft_fixed.observe(0.5 * MS)
    model.overhead.observe(0.5 * MS)
    return model
