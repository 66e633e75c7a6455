"""Measured costs: least-squares lines with forgetting, and the drafter's and verifier's step and verify costs.

The policy (speculation.py) and the pipeline choice (pipeline_choice.py) both price rounds with these.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


def verified_positions(ks: Sequence[int]) -> int:
    """Positions the verifier computes for a round: it pads every row to the longest block."""
    return len(ks) * (max(ks, default=0) + 1)


class LinearCost:
    """y ≈ w0 + w1·x by least squares with exponential forgetting.

    Two features are all the cost curves need here (a fixed cost plus one that
    grows with tokens or with batch size). A small ridge term keeps the fit
    defined before x has varied; it pulls the slope toward 0, which is the
    optimistic guess ("more tokens are free") that makes the policy try them
    and learn their real cost.
    """

    def __init__(self, forget: float = 0.98, ridge: float = 1e-6) -> None:
        self.forget = forget
        self.ridge = ridge
        self.n = 0.0
        self.sx = self.sy = self.sxx = self.sxy = 0.0
        self.samples = 0
        self._fit: tuple[float, float] | None = None  # the policy prices many rounds between observations

    def observe(self, x: float, y: float) -> None:
        self._fit = None
        f = self.forget
        self.n = self.n * f + 1.0
        self.sx = self.sx * f + x
        self.sy = self.sy * f + y
        self.sxx = self.sxx * f + x * x
        self.sxy = self.sxy * f + x * y
        self.samples += 1

    def coefficients(self) -> tuple[float, float]:
        if self._fit is None:
            self._fit = self._solve()
        return self._fit

    def _solve(self) -> tuple[float, float]:
        if self.n == 0:
            return 0.0, 0.0
        mean_x, mean_y = self.sx / self.n, self.sy / self.n
        var = self.sxx / self.n - mean_x * mean_x
        cov = self.sxy / self.n - mean_x * mean_y
        slope = max(0.0, cov / (var + self.ridge * (1.0 + mean_x * mean_x)))
        return max(0.0, mean_y - slope * mean_x), slope

    def predict(self, x: float) -> float:
        w0, w1 = self.coefficients()
        return w0 + w1 * x

    def means(self) -> tuple[float, float]:
        """The (forgetting) means of x and y observed; (0, 0) before any."""
        return (self.sx / self.n, self.sy / self.n) if self.n else (0.0, 0.0)


class SizedCost:
    """Cost against size: a line (`LinearCost`) for every size, corrected at each size measured.

    The services' forwards are not linear in their size on every device: on a CPU a verify of
    two or three positions can cost as much as one of five, where the LM head's product over a
    few rows is slow. A line fitted mostly to the sizes the policy runs most (one position per
    sequence, and k + 1) then underprices the sizes between them, and the policy picks them for
    a saving that is not there. So each size measured keeps a forgetting mean of its own costs,
    and its prediction is the line moved by that mean's distance from the line, shrunk by
    `prior_weight` pseudo-samples so that one slow round does not reprice a size. Sizes never
    measured get the line. Sizes above `EXACT_UP_TO` share quarter-octave buckets (the bucket
    keeps the mean of its sizes too), which bounds the table.

    `explore`: a size never measured costs at most what the nearest smaller size measured
    costs. That is the optimistic guess (a larger size is never cheaper), so the policy tries
    the size and learns its cost, where the line through a few sizes, steep between them,
    might price it out for good (on a CPU a verify of 3 positions can cost more than one of 4).
    """

    EXACT_UP_TO = 32

    def __init__(self, forget: float = 0.98, prior_weight: float = 1.0, explore: bool = False) -> None:
        self.line = LinearCost(forget)
        self.prior_weight = prior_weight
        self.explore = explore
        self._sizes: dict[int, tuple[float, float, float]] = {}  # key -> forgetting sums of (1, x, y)
        self._predicted: dict[float, float] = {}  # x -> predict(x) since the last observation

    @classmethod
    def key(cls, x: float) -> int:
        n = max(1, round(x))
        return n if n <= cls.EXACT_UP_TO else cls.EXACT_UP_TO + round(4 * math.log2(n / cls.EXACT_UP_TO))

    @property
    def samples(self) -> int:
        return self.line.samples

    def coefficients(self) -> tuple[float, float]:
        return self.line.coefficients()

    def observe(self, x: float, y: float) -> None:
        if not (math.isfinite(x) and math.isfinite(y)):
            return
        self.line.observe(x, y)
        self._predicted.clear()
        f = self.line.forget
        key = self.key(x)
        n, sx, sy = self._sizes.get(key, (0.0, 0.0, 0.0))
        self._sizes[key] = (n * f + 1.0, sx * f + x, sy * f + y)

    def predict(self, x: float) -> float:
        # The policy asks for the same few sizes many times a round, between observations.
        if (known := self._predicted.get(x)) is None:
            known = self._predicted[x] = self._predict(x)
        return known

    def _predict(self, x: float) -> float:
        w0, w1 = self.line.coefficients()
        key = self.key(x)
        if key in self._sizes:
            return self._at(key, x, w0, w1)
        below = max((k for k in self._sizes if k < key), default=None) if self.explore else None
        if below is not None:
            n, sx, _ = self._sizes[below]
            return min(w0 + w1 * x, self._at(below, sx / n, w0, w1))
        return w0 + w1 * x

    def measured(self, x: float) -> bool:
        """Whether the size of x (its bucket above `EXACT_UP_TO`) has been measured."""
        return self.key(x) in self._sizes

    def largest(self) -> float:
        """The largest size measured (the mean of its bucket's sizes); 0 before any."""
        if not self._sizes:
            return 0.0
        n, sx, _ = self._sizes[max(self._sizes)]
        return sx / n

    def lower_bound(self, x: float) -> float:
        """What x costs at least, as measured: the cost of the largest size measured at or below
        it (a larger size is never cheaper); 0 where none is."""
        key = self.key(x)
        below = max((k for k in self._sizes if k <= key), default=None)
        if below is None:
            return 0.0
        n, sx, _ = self._sizes[below]
        w0, w1 = self.line.coefficients()
        return self._at(below, sx / n, w0, w1)

    def _at(self, key: int, x: float, w0: float, w1: float) -> float:
        """The prediction at x of a size measured: the line moved toward that size's own mean."""
        n, sx, sy = self._sizes[key]
        # The size's mean cost against the line at the mean of its sizes (equal sizes below the buckets).
        off_line = sy / n - (w0 + w1 * sx / n)
        return max(0.0, w0 + w1 * x + off_line * n / (n + self.prior_weight))


class Ewma:
    def __init__(self, alpha: float = 0.1) -> None:
        self.alpha = alpha
        self.value: float | None = None

    def observe(self, y: float) -> None:
        self.value = y if self.value is None else self.value + self.alpha * (y - self.value)

    def get(self, default: float = 0.0) -> float:
        return default if self.value is None else self.value


@dataclass
class CostModel:
    """Round cost in ns as measured by the gateway."""

    verify: SizedCost = field(default_factory=SizedCost)  # verify exchange ns vs positions checked
    # The same, timed in rounds where a draft exchange ran beside it (cohort, draft-ahead), from
    # its request to its reply. Those rounds run the block sizes their pipelines choose, which
    # rounds alone may never run; on cores the two services share, it also holds the slowdown.
    # Sizes not run yet are priced optimistically, so that they are tried (`SizedCost.explore`).
    verify_beside: SizedCost = field(default_factory=lambda: SizedCost(explore=True))
    step: SizedCost = field(default_factory=SizedCost)  # drafter ns per draft step vs sequences drafted for
    # The same, timed in draft exchanges that ran beside a verify (cohort, draft-ahead).
    step_beside: SizedCost = field(default_factory=SizedCost)
    draft_fixed: Ewma = field(default_factory=Ewma)  # drafter exchange ns outside its steps
    overhead: Ewma = field(default_factory=Ewma)  # round ns outside both exchanges

    @property
    def verify_beside_or_alone(self) -> SizedCost:
        """The verify's costs beside a draft exchange, or, before any such round, alone."""
        return self.verify_beside if self.verify_beside.samples else self.verify

    def verify_beside_ns(self, positions: int) -> float:
        """A verify exchange of `positions` beside a draft exchange (`verify_beside_or_alone`),
        never priced below what a verify of its size has been measured to cost alone."""
        return _beside(self.verify_beside, self.verify, positions)

    def step_beside_ns(self, sequences: float) -> float:
        """A draft step for `sequences` beside a verify: as timed beside one, or, before any, alone;
        never priced below what a step of its size has been measured to cost alone."""
        return _beside(self.step_beside, self.step, sequences)

    def draft_ns(self, sequences: float, steps: int, beside: bool = False) -> float:
        """A draft exchange of `steps` for `sequences`; `beside`: with a verify running beside it."""
        if steps <= 0 or sequences <= 0:
            return 0.0
        step = self.step_beside_ns(sequences) if beside else self.step.predict(sequences)
        return self.draft_fixed.get() + steps * step

    def seed_steps(self, timings: Iterable[tuple[int, float]]) -> None:
        """The drafter's one-token step as it timed it at start-up, (sequences, ns) for batches of
        several sizes: `step` for batches not drafted for yet; the rounds' own times refine it."""
        for sequences, ns in timings:
            if sequences > 0 and ns > 0:
                self.step.observe(sequences, float(ns))

    def round_ns(self, ks: Sequence[int]) -> float:
        drafting = sum(1 for k in ks if k > 0)
        verify = self.verify.predict(verified_positions(ks))
        return verify + self.overhead.get() + self.draft_ns(drafting, max(ks, default=0))

    @property
    def ready(self) -> bool:
        return self.verify.samples > 0 and self.step.samples > 0


def _beside(beside: SizedCost, alone: SizedCost, x: float) -> float:
    """The cost of x in `beside` (`alone` before it has any sample), floored, for a size not
    measured there, by what the same work costs alone: work beside the other service's is never
    cheaper. Without the floor an untried size's optimistic guess (`SizedCost.explore`), or a
    line through small sizes, prices a batch far beyond them at a fraction of its cost, and
    wins a round that then runs below target-only. Near the sizes measured beside (up to twice
    the largest) the floor is what `alone` measured at or below x, so exploring the next size
    up stays cheap; beyond, it is `alone`'s prediction, which the rounds alone measure at every
    batch they run."""
    if not beside.samples:
        return alone.predict(x)
    if beside.measured(x):
        return beside.predict(x)
    floor = alone.predict(x) if x > 2 * beside.largest() else alone.lower_bound(x)
    return max(beside.predict(x), floor)
