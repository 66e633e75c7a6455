"""How many tokens to draft for each sequence in a round (no gRPC, no torch here).

Three policies share one entry point, `SpeculationPolicy.choose`:

- fixed: every speculating sequence drafts k (capped by what it may still emit),
  also what a request that names its own k gets;
- disable by batch size (vLLM's `speculative_disable_by_batch_size`): no drafting
  in a round whose batch has at least N sequences;
- auto (default): pick per-sequence k in 0..k_max to maximise expected output
  tokens per second of the round, from what the gateway measures as it runs —
  per-position acceptance (overall and per sequence), the drafter's step time as
  a function of the batch it drafts for, and the verifier's time as a function
  of the positions it checks (each a line, corrected at every size measured:
  `SizedCost`). On a machine where verifying k+1 tokens for every
  sequence stops being nearly free (large batches, CPUs), the expected gain of
  drafting falls below its cost and k shrinks to 0.

The maths (Leviathan et al. 2023, generalised to position-dependent acceptance):
a sequence that drafts k tokens emits E(k) = 1 + sum_{i=1..k} prod_{j<=i} a_j
tokens in expectation, where a_j is the probability that draft j is accepted
given that drafts 1..j-1 were. A round costs
R = [drafting] (d0 + max_k * step(B_drafting)) + verify(sum (k_s + 1)) + overhead.
The rate sum_s E_s(k_s) / R is a ratio, maximised per sequence with Dinkelbach's
iteration: for a rate lambda each sequence independently maximises
E_s(k) - lambda * marginal verify cost * k.

Beside k, the policy sizes a token tree's siblings (`siblings`) and a draft-ahead's fan-out
(`branches`) with one more term of the same cost model each (`gateway.round.widths`).

Under `--pipeline auto` the same search runs once per pipeline with that pipeline's
round model (`gateway.round.pipeline_choice`), and the round takes the pipeline and ks with
the highest rate; target-only (every k = 0) is a candidate in each, so auto mode
drafts only when drafting is predicted faster than not drafting.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from gateway.round.acceptance import Acceptance, HitRate
from gateway.round.costs import CostModel, Ewma, SizedCost, verified_positions
from gateway.round.pipeline_choice import MODES as PIPELINES
from gateway.round.pipeline_choice import Calibration, Overlap, RoundModel
from gateway.round.widths import BRANCH_PRIOR, SIBLING_PRIOR, Ahead, branch_width, sibling_width

MODES = ("auto", "fixed")  # how the gateway picks k for requests that do not name one

# The policy's heuristics on top of the cost model, each of which `--policy-off` can switch off
# for an A/B run with `specd bench --server` (docs/pipeline.md, "What each heuristic buys"):
HEURISTICS = {
    "overlap-prior": "an untried overlap is priced perfect (prior 1), not at no opinion (0.5)",
    "borrow": "an untried draft position's acceptance is at least the one before it",
    "calibration": "each pipeline's predictions scaled by what its rounds delivered, per batch size",
    "switch-margin": "another pipeline must be predicted faster by `switch_margin` to replace the last round's",
    "early-joins": "auto sequences open on the drafter beside their verifier open, not after it",
    "join-cost": "a sequence joins the drafter only if its drafts are predicted to repay the prefill",
}


def expected_tokens(rates: Sequence[float], k: int) -> float:
    """Tokens a sequence emits in expectation when it drafts k: 1 + sum of P(first i accepted)."""
    return expected_tokens_table(rates, k)[k]


def expected_tokens_table(rates: Sequence[float], k_max: int) -> list[float]:
    """E(0), E(1), …, E(k_max) for one sequence (see expected_tokens)."""
    table, reach = [1.0], 1.0
    for j in range(k_max):
        reach *= rates[j]
        table.append(table[-1] + reach)
    return table


def leviathan_speedup(alpha: float, k: int, c: float, verify_ratio: float = 1.0) -> float:
    """Expected speedup over target-only of k drafts per round with i.i.d. acceptance alpha.

    c = drafter step / target step; verify_ratio = verifying k+1 tokens / one target step
    (1 on hardware where the extra tokens are free; > 1 on a compute-bound CPU).
    Leviathan et al. 2023, eq. (1) and Theorem 3.8, with the verify cost made explicit.
    """
    if k == 0:
        return 1.0
    tokens = (k + 1) if alpha >= 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return tokens / (k * c + verify_ratio)


@dataclass(frozen=True)
class Candidate:
    """What the policy needs to know of one sequence in the round."""

    cap: int  # most drafts it may take (0 if it does not speculate)
    rates: Sequence[float]  # its per-position acceptance estimates
    fixed: int | None = None  # a k the request asked for, not to be chosen
    cohort: int = 0  # which of the two cohorts it is verified with (cohort pipeline)
    # P(its drafter's guess at the verifier's own token after a wholly accepted block is right):
    # what a draft-ahead block needs besides acceptance to stand (0: it never stands).
    guess: float = 0.0


@dataclass(frozen=True)
class Choice:
    ks: list[int]
    predicted_rate: float  # expected tokens per second of the round with ks
    baseline_rate: float  # expected tokens per second of the same round target-only
    pipeline: str = "sequential"  # the pipeline the rate was predicted for
    # The pipeline's round model's rate before its calibration (`Calibration`): what the
    # round's outcome is measured against. 0: not calibrated (target-only, or a fixed round).
    model_rate: float = 0.0
    # Every pipeline offered, with the rate and mean k it was predicted at (so a trace shows why
    # one won): (pipeline offered, tokens per second, mean k).
    offered: tuple[tuple[str, float, float], ...] = ()

    @property
    def predicted_gain(self) -> float:
        return self.predicted_rate / self.baseline_rate if self.baseline_rate > 0 else 1.0


def _tables(candidates: Sequence[Candidate]) -> list[list[float]]:
    """Each sequence's expected tokens for every k it may draft, computed once per round."""
    return [expected_tokens_table(c.rates, c.fixed if c.fixed is not None else c.cap) for c in candidates]


def choose_ks(
    candidates: Sequence[Candidate],
    costs: CostModel,
    k_max: int,
    rate: Callable[[list[int]], float] | None = None,
    verify: SizedCost | None = None,
) -> Choice:
    """Per-sequence k maximising expected tokens per second of one round.

    `rate` predicts the round's tokens per second for given ks (default: the sequential
    round). The search prices verified tokens at the marginal cost of `verify` (default:
    the verify timed alone), which is exact for a sequential round and a heuristic for
    the others; every candidate it finds is scored by `rate` itself.
    """
    tables = _tables(candidates)

    def sequential(ks: list[int]) -> float:
        tokens = sum(table[k] for table, k in zip(tables, ks, strict=True))
        return tokens / max(costs.round_ns(ks), 1.0) * 1e9

    score = rate or sequential
    scored: dict[tuple[int, ...], float] = {}

    def evaluate(ks: list[int]) -> float:
        # The search revisits ks (each m's uniform ks, a price that settles): score each once.
        key = tuple(ks)
        if key not in scored:
            scored[key] = score(ks)
        return scored[key]

    base = [c.fixed if c.fixed is not None else 0 for c in candidates]
    baseline_rate = evaluate([0] * len(candidates))
    best_ks, best_rate = base, evaluate(base)
    if len(candidates) == 1 and candidates[0].fixed is None:
        # One sequence: every k it may draft is scored, which is what the search below reaches.
        for k in range(1, min(k_max, candidates[0].cap) + 1):
            if (k_rate := evaluate([k])) > best_rate * (1 + 1e-9):
                best_ks, best_rate = [k], k_rate
        return Choice(best_ks, best_rate, baseline_rate)
    _, marginal = (verify or costs.verify).coefficients()
    for m in range(1, k_max + 1):
        # Every sequence drafting m (what it may) is scored too: the price is a line, and where
        # the verify's cost is not (a CPU's verify of 5 positions can cost less than one of 3),
        # the search below can stop short of the k that pays.
        uniform = [c.fixed if c.fixed is not None else min(m, c.cap) for c in candidates]
        uniform_rate = evaluate(uniform)
        if uniform_rate > best_rate * (1 + 1e-9):
            best_ks, best_rate = uniform, uniform_rate
        rate, ks = best_rate, base
        for _ in range(4):
            price = rate / 1e9 * marginal  # tokens one more verified token must pay for
            trial = []
            for c, table, fixed in zip(candidates, tables, base, strict=True):
                if c.fixed is not None:
                    trial.append(fixed)
                    continue
                best_k = 0  # ties go to the smaller k: the same rate for less work
                for k in range(1, min(m, c.cap) + 1):
                    if table[k] - price * k > table[best_k] - price * best_k:
                        best_k = k
                trial.append(best_k)
            if trial == ks:
                break
            ks, rate = trial, evaluate(trial)
            # The best seen, not the last: under a price that is off the iteration can swing.
            if rate > best_rate * (1 + 1e-9):
                best_ks, best_rate = ks, rate
    return Choice(best_ks, best_rate, baseline_rate)


def choose_round(
    candidates: Sequence[Candidate],
    costs: CostModel,
    k_max: int,
    overlap: float,
    pipelines: Sequence[str] = ("sequential",),
    current: str = "sequential",
    switch_margin: float = 0.0,
    calibration: Calibration | None = None,
) -> Choice:
    """The pipeline among `pipelines`, and its ks, with the most expected tokens per second.

    Each pipeline gets its own best ks (`choose_ks` under its round model, times the
    pipeline's `calibration` factor where anything is drafted). A round where no sequence
    drafts is target-only whatever the pipeline, and is labelled sequential.
    `current` (the pipeline of the last round) is kept unless another beats it by
    `switch_margin`: switching costs a round the models do not see (a cohort's first
    half has no block ready; a draft-ahead block may be left unused).
    """
    model = RoundModel(
        costs,
        overlap,
        _tables(candidates),
        [c.rates for c in candidates],
        [c.cohort for c in candidates],
        [c.guess for c in candidates],
    )

    def rate(mode: str, ks: list[int]) -> float:
        raw = model.rate(mode, ks)
        if calibration is None or not any(ks):
            return raw
        return raw * calibration.factor(_ran(model, mode, ks), len(ks))

    if "cohort" in pipelines and not _can_pair(candidates):
        # Cohorts that cannot take turns run sequential rounds, and are priced as those: one fewer search.
        pipelines = tuple(mode for mode in pipelines if mode != "cohort") or ("sequential",)
    choices = []
    for mode in pipelines:
        # The overlapped pipelines' verifies run beside a draft exchange: priced as timed there.
        verify = costs.verify if mode == "sequential" else costs.verify_beside_or_alone
        choice = choose_ks(candidates, costs, k_max, lambda ks, mode=mode: rate(mode, ks), verify)
        ran = _ran(model, mode, choice.ks)
        raw = model.rate(mode, choice.ks) if any(choice.ks) else 0.0
        choices.append(Choice(choice.ks, choice.predicted_rate, choice.baseline_rate, ran, raw))
    offered = tuple(
        (mode, c.predicted_rate, sum(c.ks) / max(1, len(c.ks))) for mode, c in zip(pipelines, choices, strict=True)
    )
    choices = [replace(c, offered=offered) for c in choices]
    best = max(choices, key=lambda c: c.predicted_rate)  # the first of equals: `pipelines` order
    if not any(best.ks):
        return best  # target-only is predicted fastest: no margin may keep drafts that lose to it
    for choice in choices:
        if choice.pipeline == current and choice.predicted_rate * (1 + switch_margin) >= best.predicted_rate:
            return choice
    return best


def _can_pair(candidates: Sequence[Candidate]) -> bool:
    """Whether both cohorts hold a sequence that may draft: else a cohort round is a sequential one."""
    return len({c.cohort for c in candidates if (c.fixed if c.fixed is not None else c.cap) > 0}) == 2


def _ran(model: RoundModel, mode: str, ks: Sequence[int]) -> str:
    """The pipeline the scheduler runs for `mode` with these ks: sequential where `mode` cannot apply."""
    if not any(ks) or (mode == "cohort" and not model.paired(ks)):
        return "sequential"
    return mode


@dataclass(frozen=True)
class PolicyConfig:
    k_max: int = 4
    disable_by_batch_size: int = 0  # 0: never
    probe_every: int = 64  # rounds between exploratory drafts while auto mode keeps k at 0
    prior_acceptance: float = 0.7
    sequence_prior_weight: float = 4.0  # how many observations of a sequence outweigh the overall rates
    switch_margin: float = 0.03  # predicted gain another pipeline needs over the last round's (--pipeline auto)
    off: frozenset[str] = frozenset()  # of HEURISTICS, those switched off

    def __post_init__(self) -> None:
        unknown = sorted(set(self.off) - set(HEURISTICS))
        if unknown:
            raise ValueError(f"unknown policy heuristics {unknown}; choose from {', '.join(HEURISTICS)}")

    def on(self, heuristic: str) -> bool:
        return heuristic not in self.off


class SpeculationPolicy:
    """Chooses each round's k per sequence, and its pipeline under `--pipeline auto`; learns from the outcome."""

    def __init__(self, config: PolicyConfig) -> None:
        self.config = config
        self.k_max = config.k_max
        borrow = config.on("borrow")
        self.overall = Acceptance(config.k_max, config.prior_acceptance, prior_weight=2.0, decay=0.999, borrow=borrow)
        # How often a draft-ahead block's guess at the verifier's token is right, once the block
        # it assumed was accepted whole. Not the acceptance there: a sampled request's token and
        # the drafter's guess are two draws, which agree far less often than a draft is accepted.
        # Until guesses are seen they are taken to be right as often as a first draft is accepted:
        # optimistic (as the overlap's prior) so that draft-ahead is tried and its guesses learnt.
        self.overall_guess = HitRate(prior_weight=2.0, decay=0.999)
        # Of the siblings sent (token trees), how often the accepted path ended in one. Until one
        # is seen a sibling is priced at SIBLING_PRIOR: tried, where width is cheap, then learnt.
        self.sibling_hits = HitRate(prior_weight=2.0, decay=0.999)
        # Of the branches beside draft-ahead blocks whose verdict came (their main block missed),
        # how often their guess at the verifier's token was right: priced at BRANCH_PRIOR until seen.
        self.branch_hits = HitRate(prior_weight=2.0, decay=0.999)
        self.costs = CostModel()
        self.overlap = Overlap(prior=1.0 if config.on("overlap-prior") else 0.5)
        self.calibration = Calibration()
        # What the choice reads: the calibration, unless switched off (it is still kept, for the metrics).
        self.calibrated = self.calibration if config.on("calibration") else None
        self._rounds_without_drafts = 0
        self.last_choice: Choice | None = None
        self._previous_pipeline = "sequential"  # the pipeline of the round before the one being chosen
        # The pipeline chosen for this round among those offered (the only one offered, if one).
        self.last_pipeline = "sequential"
        self.observed_gain = Ewma(0.05)
        self.predicted_gain = Ewma(0.05)
        # What opening a sequence on the drafter costs the round it runs in, per prompt token
        # it prefills there: the wait for the open, plus what it slows the verify beside it
        # (on cores the two services share, much more than the open's own time).
        self.join_ns_per_token = Ewma(0.2)
        # How many tokens finished sequences emitted: what a joining sequence can expect to draft for.
        self.output_tokens = Ewma(0.1)
        # Of the rounds a sequence spent on the drafter after joining for auto drafts, the share in
        # which it drafted: a policy whose joins are not followed by drafts learns to stop joining.
        self.join_follow_through = Ewma(0.2)

    def new_sequence(self) -> Acceptance:
        return Acceptance(self.k_max, self.overall.rates(), self.config.sequence_prior_weight)

    def new_guess_rate(self) -> HitRate:
        """A sequence's own guess rate; read with `guess_rate`, it starts from the overall one."""
        return HitRate(self.config.sequence_prior_weight)

    def guess_rate(self, rate: HitRate) -> float:
        """P(a sequence's next draft-ahead guess is right), from its own guesses and everyone's."""
        return rate.value(self.overall_guess.value(self.overall.rate(0) if self.k_max else 0.0))

    def observe_guess(self, rate: HitRate | None, hit: bool) -> None:
        """A draft-ahead guess after a wholly accepted block: right (`hit`) or not."""
        self.overall_guess.observe(hit)
        if rate is not None:
            rate.observe(hit)

    def choose(
        self,
        candidates: Sequence[Candidate],
        batch_size: int,
        pipelines: Sequence[str] = ("sequential",),
        measurable: bool = True,
        again: bool = False,
    ) -> list[int]:
        """k per candidate; a candidate's `fixed` k (fixed mode, or asked for by its request) is kept.

        `pipelines`: those the round may run (several under `--pipeline auto`); the one
        chosen is left in `last_pipeline`, and the ks are the best for it. `measurable`:
        whether the round's costs will be learnt (a round that also prefills is not).
        `again`: the same round chosen a second time, for the drafts it can run (the
        scheduler's first choice offered sequences still getting ready on the drafter as if
        ready, to decide whether they should get ready); it replaces the first choice and
        leaves alone what a round teaches once (the probe's count, the predicted gain).
        """
        cfg = self.config
        self.last_choice = None
        if not again:
            self._previous_pipeline = self.last_pipeline
        previous = self._previous_pipeline
        self.last_pipeline = "sequential" if len(pipelines) > 1 else pipelines[0]
        if cfg.disable_by_batch_size and batch_size >= cfg.disable_by_batch_size:
            return [0] * len(candidates)
        all_fixed = all(c.fixed is not None for c in candidates)
        if not self.costs.ready and not measurable and not all_fixed:
            # Drafting to time the services is pointless in a round whose times are not learnt.
            return [c.fixed if c.fixed is not None else 0 for c in candidates]
        if (all_fixed and len(pipelines) == 1) or not self.costs.ready or self.k_max == 0:
            # Until both services have been timed there is nothing to optimise against:
            # draft the full k, sequentially, to measure the drafter and the verifier alone.
            return [c.fixed if c.fixed is not None else c.cap for c in candidates]
        choice = choose_round(
            candidates,
            self.costs,
            self.k_max,
            self.overlap.value,
            pipelines,
            previous,
            cfg.switch_margin if cfg.on("switch-margin") else 0.0,
            self.calibrated,
        )
        self.last_pipeline = choice.pipeline if len(pipelines) > 1 else pipelines[0]
        if all_fixed:
            return choice.ks  # only the pipeline was chosen: nothing adaptive to report
        ks = choice.ks
        if again:
            self.last_choice = choice
            return ks
        if any(ks):
            self._rounds_without_drafts = 0
        else:
            self._rounds_without_drafts += 1
            if self._rounds_without_drafts >= cfg.probe_every:
                # Acceptance is only learnt from drafts; probe now and then so a
                # workload that has become predictable gets its drafts back.
                # One draft from one sequence: probing the whole batch would cost a drafter
                # step (and a catch-up on the tokens it has not seen) for every sequence.
                self._rounds_without_drafts = 0
                ks = [c.fixed if c.fixed is not None else 0 for c in candidates]
                probe = next((i for i, c in enumerate(candidates) if c.fixed is None and c.cap > 0), None)
                if probe is not None:
                    ks[probe] = 1
        # A probe's round is not the choice's: it is not measured against the model.
        model_rate = choice.model_rate if ks == choice.ks else 0.0
        self.last_choice = replace(choice, ks=ks, model_rate=model_rate)
        self.predicted_gain.observe(choice.predicted_gain)
        return ks

    def siblings(self, ks: Sequence[int], most: int) -> int:
        """How many siblings each drafting sequence's chain gets this round, of at most `most`:
        the m with the best predicted rate (`widths.sibling_width`); `most` until the services
        are timed (so the verify's width is measured too)."""
        if most <= 0 or not any(k > 0 for k in ks):
            return 0
        choice = self.last_choice
        if not self.costs.ready or choice is None or choice.predicted_rate <= 0:
            return most
        return sibling_width(self.costs, ks, choice.predicted_rate, self.sibling_hits.value(SIBLING_PRIOR), most)

    def observe_siblings(self, sent: int, hit: bool) -> None:
        """A verdict on a block with `sent` siblings; `hit`: its accepted path ended in one."""
        for i in range(sent):
            self.sibling_hits.observe(hit and i == 0)

    def branches(self, ks: Sequence[int], ahead: Sequence[Ahead], most: int) -> int:
        """How many branches each auto sequence drafting ahead (`ahead`) gets this round, of at
        most `most`, in a round verifying `ks`: the m with the shortest predicted round
        (`widths.branch_width`); `most` until the services are timed."""
        if most <= 0 or not ahead:
            return 0
        if not self.costs.ready:
            return most
        hit = self.branch_hits.value(BRANCH_PRIOR)
        return branch_width(self.costs, self.overlap.value, ks, ahead, hit, most)

    def observe_branch(self, hit: bool) -> None:
        """A branch whose verdict came, its main block having missed: `hit`, its guess was right."""
        self.branch_hits.observe(hit)

    def drafts_for(self, batch: int, pipelines: Sequence[str] = PIPELINES) -> bool:
        """Whether a round of `batch` sequences, each free to draft the full k at the acceptance
        seen so far, would draft: what an auto request joining the drafter at its open goes by
        (`decide.early_joins`), so a batch the policy drafts for has its drafter ready from
        its second round, and one it does not draft for costs the drafter no prefill.

        The round's own choice, on the same costs and calibration, for a typical batch of that
        size: no memory of the batches drafted for, which a cold stack's first wave (or any
        batch larger than the last) would lack, leaving it to join in chunks beside its verifies
        while it ran target-only. Until both services are timed the rounds draft the full k to
        time them, so the drafts need the drafter too.
        """
        cfg = self.config
        if batch <= 0 or self.k_max == 0 or (cfg.disable_by_batch_size and batch >= cfg.disable_by_batch_size):
            return False
        if not self.costs.ready:
            return True
        rates = self.overall.rates()
        guess = self.guess_rate(self.new_guess_rate())  # a sequence not seen yet: everyone's rate
        typical = [Candidate(cap=self.k_max, rates=rates, cohort=i % 2, guess=guess) for i in range(batch)]
        choice = choose_round(
            typical, self.costs, self.k_max, self.overlap.value, pipelines, calibration=self.calibrated
        )
        return any(choice.ks) and choice.predicted_gain > 1.0

    def not_as_chosen(self) -> None:
        """The round will not run the ks chosen (a sequence's first round stays target-only):
        like a probe's, its outcome is not measured against the pipeline's model."""
        if self.last_choice is not None:
            self.last_choice = replace(self.last_choice, model_rate=0.0)

    def join_pays(self, generated: int, left: int, prompt_tokens: int) -> bool:
        """Whether opening a sequence on the drafter, so that it drafts as this round's choice
        wants, is predicted to save more time than the open costs.

        A join is paid once, in the round it runs in; the drafting it allows saves (1 - 1/gain)
        of every later round the sequence takes part in, and the sequences drafting share that
        saving. `generated`: tokens the sequence emitted so far; `left`: the most it may still
        emit; `prompt_tokens`: what the drafter must prefill. Joins not yet timed are allowed:
        the first one measures the cost.
        """
        choice = self.last_choice
        if not self.config.on("join-cost") or choice is None or choice.baseline_rate <= 0:
            return True  # no adaptive choice this round (untimed or fixed): the drafts need the join
        gain = choice.predicted_gain
        if gain <= 1.0:
            return False
        per_token = self.join_ns_per_token.value
        if per_token is None:
            return True
        typical = self.output_tokens.value
        remaining = left if typical is None else min(left, max(1.0, typical - generated))
        drafting = max(1, sum(1 for k in choice.ks if k > 0))
        round_ns = len(choice.ks) / choice.baseline_rate * 1e9  # one token per sequence, target-only
        saved = remaining * round_ns * (1.0 - 1.0 / gain) / drafting * self.join_follow_through.get(1.0)
        return saved > per_token * prompt_tokens

    def observe_join(self, prompt_tokens: int, cost_ns: float) -> None:
        """A round that opened sequences of `prompt_tokens` in all on the drafter, and what that cost it."""
        if prompt_tokens > 0 and cost_ns >= 0:
            self.join_ns_per_token.observe(cost_ns / prompt_tokens)

    def observe_finished(self, output_tokens: int) -> None:
        self.output_tokens.observe(float(output_tokens))

    def observe_follow_through(self, rounds_on_drafter: int, rounds_drafting: int) -> None:
        """A finished sequence that joined the drafter for auto drafts: in how many of its rounds there it drafted."""
        if rounds_on_drafter > 0:
            self.join_follow_through.observe(rounds_drafting / rounds_on_drafter)

    def observe_round(
        self,
        ks: Sequence[int],
        round_ns: int,
        draft_ns: int,
        verify_ns: int,
        drafter_forward_ns: int,
        tokens_emitted: int,
        pre_drafted: Sequence[int] | None = None,
        ahead_drafted: Sequence[int] = (),
        joined_tokens: int = 0,
        join_ns: int = 0,
        verify_reply_ns: int = 0,
        ahead_ns: int = 0,
        ahead_forward_ns: int = 0,
        learn_costs: bool = True,
    ) -> float | None:
        """Learn costs from one round; returns observed rate / predicted target-only rate.

        `ks`: drafts verified per sequence; `pre_drafted`: drafts asked per sequence of the
        exchange before the verify (None: those of `ks`); `ahead_drafted`: of the exchange
        that ran during the verify, whose time `verify_ns` then includes. `joined_tokens`:
        prompt tokens the drafter opened beside the verify, and `join_ns` the round's wait
        for that after the verify (not part of `round_ns`): the join's cost is learnt, and
        the verify's time, which the open may have slowed, teaches nothing else.
        `verify_reply_ns`: the verify exchange alone, request to reply (0: not timed apart);
        `ahead_ns`, `ahead_forward_ns`: the draft exchange beside it, request to reply, and the
        drafter's forward passes in it (0: not timed). `learn_costs`: False for a round whose
        exchanges also carried other work (the drafter prefilling beside the verify): what it
        delivered against its pipeline's model still calibrates that pipeline, but its times
        teach no cost.
        """
        pre = list(ks) if pre_drafted is None else list(pre_drafted)
        self.overlap.age()
        self.calibration.age()
        if learn_costs:
            ahead = [n for n in ahead_drafted if n > 0]
            if joined_tokens:
                slowed = 0.0
                if self.costs.ready and not ahead:
                    slowed = max(0.0, verify_ns - self.costs.verify.predict(verified_positions(ks)))
                self.observe_join(joined_tokens, join_ns + slowed)
            elif ahead:
                # The verify ran beside a draft exchange: `verify_ns` is the two together, which
                # measures the overlap, not the verify alone. The verify's own reply time is what a
                # verify of this size costs beside a draft exchange (`CostModel.verify_beside`).
                positions = verified_positions(ks)
                beside = float(verify_reply_ns) if 0 < verify_reply_ns <= verify_ns else None
                drafting = float(ahead_ns) if 0 < ahead_ns <= verify_ns else None
                if self.costs.ready:
                    if drafting is None:
                        drafting = self.costs.draft_ns(len(ahead), max(ahead), beside=True)
                    verify = beside if beside is not None else self.costs.verify_beside_ns(positions)
                    self.overlap.observe(verify, drafting, verify_ns)
                if beside is not None:
                    self.costs.verify_beside.observe(positions, beside)
                if ahead_forward_ns > 0:
                    self.costs.step_beside.observe(len(ahead), ahead_forward_ns / max(ahead))
            else:
                self.costs.verify.observe(verified_positions(ks), verify_ns)
            longest = max(pre, default=0)
            if longest > 0 and draft_ns > 0:
                drafting = sum(1 for k in pre if k > 0)
                self.costs.step.observe(drafting, drafter_forward_ns / longest)
                self.costs.draft_fixed.observe(max(0, draft_ns - drafter_forward_ns))
            self.costs.overhead.observe(max(0, round_ns - draft_ns - verify_ns))
        choice = self.last_choice
        if choice is None or choice.baseline_rate <= 0 or round_ns <= 0:
            return None
        gain = tokens_emitted / round_ns * 1e9 / choice.baseline_rate
        if math.isfinite(gain):
            self.observed_gain.observe(gain)
        if choice.model_rate > 0:
            self.calibration.observe(
                choice.pipeline, tokens_emitted, choice.model_rate * round_ns / 1e9, len(choice.ks)
            )
        return gain
