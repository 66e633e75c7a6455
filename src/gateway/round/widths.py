"""How wide a drafting sequence's work is made, beside its k: each width one more term of the cost model.

Token trees (`siblings`): m leaves beside each drafting sequence's chain. The verify checks
k + 1 + m positions, and a sibling is worth one more token when the chain's draft beside it
is rejected and the sibling is the target's token there, which happens for a fraction h of
the siblings sent (measured: `SpeculationPolicy.sibling_hits`). With n sequences drafting,
the round's rate with m siblings is (T + h * n * m) / (R + verify(k + m) - verify(k)), T and R
the tokens and time of the round chosen without them; m is the one in 0..most with the best
rate, so where verify width is not nearly free (a CPU) the tree shrinks to a chain.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.round.costs import CostModel, verified_positions

SIBLING_PRIOR = 0.25  # a sibling's hit rate before any is seen


def sibling_width(costs: CostModel, ks: Sequence[int], tokens_per_s: float, hit: float, most: int) -> int:
    """The siblings in 0..`most` beside each drafting chain of `ks` with the best rate, for a round
    predicted at `tokens_per_s` without them and a sibling hit rate `hit` (the module's docstring)."""
    drafting = sum(1 for k in ks if k > 0)
    round_ns = costs.round_ns(ks)
    tokens = tokens_per_s * round_ns / 1e9
    verify = costs.verify.predict(verified_positions(ks))

    def rate(m: int) -> float:
        wider = verified_positions([k + m if k > 0 else 0 for k in ks])
        extra_ns = max(0.0, costs.verify.predict(wider) - verify)
        return (tokens + hit * drafting * m) / (round_ns + extra_ns)

    return max(range(most + 1), key=lambda m: (rate(m), -m))
