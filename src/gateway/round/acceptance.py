"""What the policy learns of drafts: per-position acceptance, and draft-ahead guesses' hit rate."""

from __future__ import annotations

from collections.abc import Sequence


class Acceptance:
    """Per-position conditional acceptance counts, with exponential forgetting.

    `rate(j)` estimates P(draft j accepted | drafts before j accepted) (0-based j),
    smoothed toward `prior` with `prior_weight` pseudo-observations, so positions
    never tried yet are neither certain nor hopeless.

    `borrow`: a position's prior is also at least the estimate of the position before it.
    Rounds that draft little leave the later positions untried, at the prior, however often
    the earlier ones are accepted; priced that low, a longer block is never chosen, so never
    tried, and its acceptance never learnt (docs/architecture.md, "Adaptive speculation"). The rate before
    is the optimistic guess: the later drafts of a block whose first ones stood are usually
    accepted at least as often, and a position tried learns its own rate.
    """

    def __init__(
        self,
        k_max: int,
        prior: Sequence[float] | float,
        prior_weight: float,
        decay: float = 1.0,
        borrow: bool = False,
    ) -> None:
        self.k_max = k_max
        self.prior = [float(prior)] * k_max if isinstance(prior, int | float) else [float(p) for p in prior]
        self.prior_weight = prior_weight
        self.decay = decay
        self.borrow = borrow
        self.tried = [0.0] * k_max
        self.accepted = [0.0] * k_max

    def observe(self, drafted: int, accepted: int) -> None:
        """One verified proposal: positions < accepted accepted, position `accepted` rejected."""
        if self.decay < 1.0:
            self.tried = [t * self.decay for t in self.tried]
            self.accepted = [a * self.decay for a in self.accepted]
        for j in range(min(drafted, accepted + 1, self.k_max)):
            self.tried[j] += 1.0
            if j < accepted:
                self.accepted[j] += 1.0

    def rate(self, j: int) -> float:
        # The policy reads rate(0) for every sequence of every round: borrowing walks only to j.
        return self._rates(j + 1)[j] if self.borrow else self._smoothed(j, self.prior[j])

    def rates(self) -> list[float]:
        return self._rates(self.k_max)

    def _rates(self, n: int) -> list[float]:
        """The first n positions' rates."""
        out: list[float] = []
        for j in range(n):
            prior = max(self.prior[j], out[-1]) if self.borrow and out else self.prior[j]
            out.append(self._smoothed(j, prior))
        return out

    def _smoothed(self, j: int, prior: float) -> float:
        w = self.prior_weight
        return (self.accepted[j] + w * prior) / (self.tried[j] + w)

    @property
    def observations(self) -> float:
        return self.tried[0] if self.k_max else 0.0


class HitRate:
    """How often something happens (a Bernoulli rate), forgetting old observations by `decay`
    per observation, and smoothed with `prior_weight` pseudo-observations of a prior given
    when the rate is read (so a prior that is itself an estimate can move)."""

    def __init__(self, prior_weight: float, decay: float = 1.0) -> None:
        self.prior_weight = prior_weight
        self.decay = decay
        self.tried = 0.0
        self.hits = 0.0

    def observe(self, hit: bool) -> None:
        self.tried = self.tried * self.decay + 1.0
        self.hits = self.hits * self.decay + (1.0 if hit else 0.0)

    def value(self, prior: float) -> float:
        return (self.hits + self.prior_weight * prior) / (self.tried + self.prior_weight)
