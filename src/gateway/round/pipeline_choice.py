"""What a round costs in each pipeline, for `--pipeline auto` (no gRPC, no torch here).

The adaptive policy (`gateway.round.speculation`) compares, each round, the expected tokens
per second of the batch under sequential, cohort and draft-ahead scheduling, each with
its own best k per sequence. This module holds the per-pipeline round models; every
cost in them is one the gateway measures as it runs:

- V(n): the verify exchange for n verified positions (rows padded to the longest block),
  timed in rounds that run it alone; V'(n) the same timed beside a draft exchange (request to
  reply), in the overlapped pipelines' own rounds, so that their block sizes are priced as
  measured, not extrapolated from the sizes sequential rounds ran (V before any such round;
  a size not yet run beside is never priced below what V measured at or below it);
- D(B, s): a draft exchange of s steps for B sequences, d0 + s·step(B); D'(B, s) the same with
  step'(B), timed in the exchanges that ran beside a verify: there a cohort's drafting also
  catches up on the verdicts of its last verify, and shared cores slow it (step before any,
  and the floor for untried sizes, as for V');
- o: the round's overhead outside both exchanges;
- e: the share of the shorter of two concurrent exchanges that hides behind the longer
  (`Overlap`): 1 on two devices that do not interfere, 0 when they share compute and
  running both at once takes as long as running one after the other.

Two exchanges x and y run concurrently take max(x, y) + (1-e)·min(x, y). Per pipeline:

- sequential: o + D(B, max k) + V(Σ(k+1) padded);
- draft-ahead: o + (1-P)·D(misses) + both(V', D'(B, max k + 1)), with P = Π_s h_s the chance
  that every sequence's ahead block stands, h_s = P(its k drafts accepted) · g_s, g_s the
  rate at which its drafter's guess at the verifier's next token has been right (learnt
  per sequence: for sampled requests far below the acceptance); a sequence whose block
  missed drafts before the verify;
- cohort: two phases, each verifying one cohort (and the sequences that do not draft)
  while the other cohort drafts: o + both(V'(cohort A), D'(cohort B)), then the swap; the
  sequences that do not draft are verified (one token each) in both phases.

All k = 0 is target-only in every pipeline, the same cost; a pipeline that cannot apply
(cohort without drafting sequences in both cohorts, draft-ahead without drafts) is
costed as what the scheduler then runs: sequential.

What the models leave out shows in what the rounds deliver: `Calibration` keeps, per
pipeline, the tokens its rounds emitted over those its model promised, and the policy
scales that pipeline's predictions by it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.round.costs import CostModel, verified_positions

MODES = ("sequential", "cohort", "ahead")


def concurrent(a: float, b: float, overlap: float) -> float:
    """Time for two exchanges run at once, when `overlap` of the shorter hides behind the longer."""
    return max(a, b) + (1.0 - overlap) * min(a, b)


class Overlap:
    """The overlap e achieved between a verify and a draft exchange run at once, as measured.

    Each overlapped round gives one sample: (V + A - phase) / min(V, A), with V and A the verify
    and draft exchanges' own times in that round (request to reply), and `phase` the time the
    two took together; clipped to [0, 1]. What each service's work beside the other costs is
    in V' and D' (`CostModel.verify_beside`, `CostModel.step_beside`); what is left here is
    the round's wait on top of the longer exchange (one starting after the other, the gateway
    reading both replies). The estimate is the samples' mean, pulled toward `prior` by
    `prior_weight` pseudo-samples.

    The prior is optimistic (1: perfect overlap) and light on purpose: with a pessimistic
    one an overlapped pipeline never looks better than sequential, so it is never tried
    and its overlap never learnt. One or two measured rounds outweigh it. Samples age by
    rounds (`age`), not by samples: while no round overlaps the prior slowly regains its
    weight, so a low estimate (perhaps from one round slowed by something else) is tried
    again now and then rather than trusted for good.
    """

    def __init__(self, prior: float = 1.0, prior_weight: float = 0.5, forget: float = 0.99) -> None:
        self.prior = prior
        self.prior_weight = prior_weight
        self.forget = forget
        self.total = 0.0
        self.weight = 0.0
        self.samples = 0

    def observe(self, verify_ns: float, draft_ns: float, phase_ns: float) -> None:
        shorter = min(verify_ns, draft_ns)
        if shorter <= 0 or not math.isfinite(phase_ns):
            return
        sample = min(1.0, max(0.0, (verify_ns + draft_ns - phase_ns) / shorter))
        self.total += sample
        self.weight += 1.0
        self.samples += 1

    def age(self) -> None:
        """One round has passed."""
        self.total *= self.forget
        self.weight *= self.forget

    @property
    def value(self) -> float:
        return (self.total + self.prior_weight * self.prior) / (self.weight + self.prior_weight)


class Calibration:
    """Per pipeline and batch size class, the tokens its rounds emitted over the tokens its model
    predicted for them.

    The round models price what the gateway measures (a verify and a draft exchange, alone and
    beside each other, and their overlap); what they leave out (the gateway's own work, costs
    that change with the mix of sequences in the batch) shows only in what the rounds
    deliver. A pipeline's predictions are multiplied by its factor here, so a pipeline that
    delivers less than its model promised stops winning the choice on that promise.
    Target-only rounds are not calibrated: their model is the verify alone, learnt directly.

    The factor is (realised + w) / (predicted + w), with w pseudo-tokens at factor 1: a
    pipeline is trusted until its rounds say otherwise. It only ever lowers a prediction: a
    pipeline that beats its model would otherwise crowd out those not yet tried, whose factor
    is still the prior's. Sums age by rounds, not by samples
    (`age`, as `Overlap` does), so a pipeline no longer chosen regains its prior slowly and
    is tried, and measured, again.
    """

    def __init__(self, prior_tokens: float = 32.0, forget: float = 0.99, bounds: tuple[float, float] = (0.2, 1.0)):
        self.prior_tokens = prior_tokens
        self.forget = forget
        self.bounds = bounds
        # (pipeline, batch size class) -> (realised, predicted) tokens
        self._sums: dict[tuple[str, int], tuple[float, float]] = {}

    @staticmethod
    def _key(pipeline: str, batch: int) -> tuple[str, int]:
        # Batches of 1, 2, 3-4, 5-8, 9-16, ... apart: what a model leaves out changes with the batch
        # (a verify beside the drafter slows by far more at 8 sequences than at 2 on shared
        # resources), and a factor shared by all sizes, pulled up by the sizes where the pipeline
        # delivers, would keep it tried where it does not.
        return pipeline, (max(1, batch) - 1).bit_length()

    def observe(self, pipeline: str, realised: float, predicted: float, batch: int = 1) -> None:
        if predicted <= 0 or not (math.isfinite(realised) and math.isfinite(predicted)):
            return
        key = self._key(pipeline, batch)
        r, p = self._sums.get(key, (0.0, 0.0))
        self._sums[key] = (r + realised, p + predicted)

    def age(self) -> None:
        """One round has passed."""
        self._sums = {m: (r * self.forget, p * self.forget) for m, (r, p) in self._sums.items()}

    def factor(self, pipeline: str, batch: int = 1) -> float:
        """The factor for `pipeline`'s predictions in a round of `batch` sequences."""
        r, p = self._sums.get(self._key(pipeline, batch), (0.0, 0.0))
        low, high = self.bounds
        return min(high, max(low, (r + self.prior_tokens) / (p + self.prior_tokens)))


def ahead_round_ns(costs: CostModel, overlap: float, ks: Sequence[int], stands: Sequence[float], rows: float) -> float:
    """A draft-ahead round (the module's docstring): the verify of `ks` beside an ahead exchange
    for `rows` (one per sequence drafting, more where a draft-ahead fans out), and the drafts
    before the verify of those whose ahead block missed; `stands`: each drafting sequence's
    chance that its ahead block stands."""
    longest = max(ks, default=0)
    all_stand = math.prod(stands)
    # A missed block is drafted again before the verify; the exchange is as long as the longest.
    misses = sum(1.0 - h for h in stands)
    pre = costs.draft_ns(misses / (1.0 - all_stand), longest) if all_stand < 1.0 else 0.0
    # The guess at the verifier's token, then k.
    ahead = costs.draft_ns(rows, longest + 1, beside=True)
    verify = costs.verify_beside_ns(verified_positions(ks)) if ks else 0.0
    return costs.overhead.get() + (1.0 - all_stand) * pre + concurrent(verify, ahead, overlap)


@dataclass(frozen=True)
class RoundModel:
    """Expected tokens and time of one round (one cycle of two phases for cohort) per pipeline.

    `tables[i][k]` is sequence i's expected tokens when it drafts k; `rates[i]` its
    per-position acceptance; `cohorts[i]` the cohort it belongs to (0 or 1); `guesses[i]`
    P(its draft-ahead guess at the verifier's token is right).
    """

    costs: CostModel
    overlap: float
    tables: Sequence[Sequence[float]]
    rates: Sequence[Sequence[float]]
    cohorts: Sequence[int]
    guesses: Sequence[float]

    def rate(self, mode: str, ks: Sequence[int]) -> float:
        """Expected output tokens per second of the batch with these ks under `mode`."""
        tokens, ns = self.cycle(mode, ks)
        return tokens / max(ns, 1.0) * 1e9

    def cycle(self, mode: str, ks: Sequence[int]) -> tuple[float, float]:
        if mode == "cohort" and self.paired(ks):
            return self._cohort(ks)
        if mode == "ahead" and any(ks):
            return self._ahead(ks)
        return self._tokens(range(len(ks)), ks), self.costs.round_ns(ks)

    def paired(self, ks: Sequence[int]) -> bool:
        """Whether both cohorts have a drafting sequence (the scheduler's condition for taking turns)."""
        return len({c for c, k in zip(self.cohorts, ks, strict=True) if k > 0}) == 2

    def _tokens(self, indices: Sequence[int] | range, ks: Sequence[int]) -> float:
        return sum(self.tables[i][ks[i]] for i in indices)

    def _verify_ns(self, ks: Sequence[int], beside: bool = False) -> float:
        """The verify exchange for these blocks; `beside`: with a draft exchange running beside it."""
        if not ks:
            return 0.0
        positions = verified_positions(ks)
        return self.costs.verify_beside_ns(positions) if beside else self.costs.verify.predict(positions)

    def _ahead(self, ks: Sequence[int]) -> tuple[float, float]:
        drafting = [i for i, k in enumerate(ks) if k > 0]
        stands = [self._reach(i, ks[i]) * self.guesses[i] for i in drafting]
        return self._tokens(range(len(ks)), ks), ahead_round_ns(self.costs, self.overlap, ks, stands, len(drafting))

    def _cohort(self, ks: Sequence[int]) -> tuple[float, float]:
        tokens, ns = 0.0, 0.0
        for turn in (0, 1):
            verified = [i for i, k in enumerate(ks) if k == 0 or self.cohorts[i] == turn]
            drafting = [i for i, k in enumerate(ks) if k > 0 and self.cohorts[i] != turn]
            draft = self.costs.draft_ns(len(drafting), max(ks[i] for i in drafting), beside=True)
            verify = self._verify_ns([ks[i] for i in verified], beside=draft > 0)
            ns += self.costs.overhead.get() + concurrent(verify, draft, self.overlap)
            tokens += self._tokens(verified, ks)
        return tokens, ns

    def _reach(self, i: int, k: int) -> float:
        """P(all k drafts of sequence i accepted)."""
        return math.prod(self.rates[i][:k])
