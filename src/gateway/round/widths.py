"""How wide a drafting sequence's work is made, beside its k: each width one more term of the cost model.

Token trees (`siblings`): m leaves beside each drafting sequence's chain. The verify checks
k + 1 + m positions, and a sibling is worth one more token when the chain's draft beside it
is rejected and the sibling is the target's token there, which happens for a fraction h of
the siblings sent (measured: `SpeculationPolicy.sibling_hits`). With n sequences drafting,
the round's rate with m siblings is (T + h * n * m) / (R + verify(k + m) - verify(k)), T and R
the tokens and time of the round chosen without them; m is the one in 0..most with the best
rate, so where verify width is not nearly free (a CPU) the tree shrinks to a chain.

Fan-out draft-ahead (`branches`): while the verifier checks a sequence's block of k drafts,
draft-ahead drafts the next block after one verdict on it, "all k accepted, then the drafter's
guess at the verifier's token", which stands with h = r_k * g (r_j = a_1 ... a_j the chance that
the first j drafts are accepted, g the guess's hit rate). The k + 1 other verdicts are "the
first j accepted, draft j + 1 rejected", v_j = r_j * (1 - a_{j+1}) for j < k, and "all accepted,
the guess wrong", v_k = r_k * (1 - g); h + sum v_j = 1. m branches are blocks drafted after
the m likeliest of them, each with its own guess at the verifier's token there, right (once
its verdict comes) at a rate b (measured: `SpeculationPolicy.branch_hits`). So the sequence's
next round finds a block ready with h_m = h + b * (sum of its m largest v_j), and needs no
draft on its critical path. Each branch is one more row of the ahead exchange's batched
forwards: with n sequences drafting ahead, the exchange costs D'(n(1 + m), k + 1) instead of
D'(n, k + 1). The draft-ahead round model (`pipeline_choice`), o + (1 - P) D(misses) +
both(V', D'(rows, k + 1)) with P = prod h_m, prices both; the tokens do not change, so m is
the one in 0..most with the shortest round: branches pay where the drafter's batch is
nearly free beside the verify and its guesses are often wrong.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gateway.round.costs import CostModel, verified_positions
from gateway.round.pipeline_choice import ahead_round_ns

SIBLING_PRIOR = 0.25  # a sibling's hit rate before any is seen
BRANCH_PRIOR = 0.25  # a branch's hit rate, once its verdict comes, before any is seen


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


@dataclass(frozen=True)
class Ahead:
    """A sequence drafting ahead, as the branch term sees it."""

    k: int  # drafts of the block verified while it drafts ahead
    rates: Sequence[float]  # its per-position acceptance
    guess: float  # P(its guess at the verifier's token after a wholly accepted block is right)


def other_verdicts(rates: Sequence[float], k: int, guess: float) -> list[float]:
    """The chances of the verdicts on a k-block that a draft-ahead's main block does not assume:
    rejected at each of its k drafts, then all accepted with the guess wrong (v_0 .. v_k)."""
    out, reach = [], 1.0
    for j in range(k):
        out.append(reach * (1.0 - rates[j]))
        reach *= rates[j]
    out.append(reach * (1.0 - guess))
    return out


def stands_with(seq: Ahead, hit: float, m: int) -> float:
    """P(a block is ready for the sequence's next round) with `m` branches beside its main block."""
    others = sorted(other_verdicts(seq.rates, seq.k, seq.guess), reverse=True)
    return min(1.0, 1.0 - sum(others) + hit * sum(others[:m]))


def branch_width(
    costs: CostModel, overlap: float, ks: Sequence[int], ahead: Sequence[Ahead], hit: float, most: int
) -> int:
    """The branches in 0..`most` beside each draft-ahead of `ahead` with the shortest round, in a
    round verifying `ks` (every sequence's), at a branch hit rate `hit` (the module's docstring);
    a sequence takes at most one per verdict its main block does not assume, k + 1."""

    def round_ns(m: int) -> float:
        stands = [stands_with(seq, hit, m) for seq in ahead]
        rows = sum(1 + min(m, seq.k + 1) for seq in ahead)
        return ahead_round_ns(costs, overlap, ks, stands, rows)

    return min(range(most + 1), key=lambda m: (round_ns(m), m))
