"""`--pipeline auto`: the per-pipeline round models and the choice among them, on synthetic costs.

The `check_*` functions state what the choice must do as costs change; each runs as a
test, and again under planted wrong formulas, where at least one of them must fail.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from copy import deepcopy
from dataclasses import replace

import pytest
from synthetic_costs import MS, costs

from gateway.round import pipeline_choice
from gateway.round.costs import CostModel
from gateway.round.observer import offered_text
from gateway.round.pipeline_choice import MODES, Calibration, Overlap, RoundModel, concurrent
from gateway.round.speculation import (
    Candidate,
    Choice,
    HitRate,
    PolicyConfig,
    SpeculationPolicy,
    choose_ks,
    choose_round,
    expected_tokens,
    expected_tokens_table,
)


def batch(n: int, rate: float, cap: int = 4) -> list[Candidate]:
    """n sequences with the same acceptance, in alternating cohorts (as the scheduler assigns them)."""
    return [Candidate(cap=cap, rates=[rate] * 4, cohort=i % 2, guess=rate) for i in range(n)]


def choose(
    model: CostModel, candidates: Sequence[Candidate], overlap: float = 1.0, current: str = "sequential"
) -> Choice:
    return choose_round(candidates, model, 4, overlap, MODES, current, switch_margin=0.03)


def round_model(model: CostModel, candidates: Sequence[Candidate], overlap: float = 1.0) -> RoundModel:
    tables = [expected_tokens_table(c.rates, c.cap) for c in candidates]
    return RoundModel(
        model,
        overlap,
        tables,
        [c.rates for c in candidates],
        [c.cohort for c in candidates],
        [c.guess for c in candidates],
    )


# GPU-like verify: its fixed cost dominates; a drafter whose 4 steps cost as much as one verify.
def expensive_drafter() -> CostModel:
    return costs(verify_fixed_ms=20, verify_per_token_ms=0.1, step_ms=5)


def check_expensive_drafter_with_good_acceptance_overlaps() -> None:
    one = choose(expensive_drafter(), batch(1, 0.95))
    assert one.pipeline == "ahead" and one.ks[0] > 0
    four = choose(expensive_drafter(), batch(4, 0.95))
    assert four.pipeline in ("ahead", "cohort") and all(four.ks)


def check_guesses_that_miss_keep_ahead_blocks_from_standing() -> None:
    # Drafts accepted as often as ever, but the guess at the verifier's token mostly wrong
    # (a sampled request): most ahead blocks are drafted again before the verify. With
    # two services that slow each other a little, that loses to drafting in turn.
    right = batch(1, 0.95)
    wrong = [replace(c, guess=0.3) for c in right]
    assert choose(expensive_drafter(), right, overlap=0.8).pipeline == "ahead"
    assert choose(expensive_drafter(), wrong, overlap=0.8).pipeline == "sequential"
    model = expensive_drafter()
    assert round_model(model, wrong).cycle("ahead", [4])[1] > round_model(model, right).cycle("ahead", [4])[1]


def check_shared_compute_runs_sequential() -> None:
    # Nothing hides behind anything (overlap 0): overlapping only adds thrown-away drafts.
    for n in (1, 4):
        choice = choose(expensive_drafter(), batch(n, 0.95), overlap=0.0, current="ahead")
        assert choice.pipeline == "sequential" and all(choice.ks)


def check_large_batch_prefers_cohort_to_ahead() -> None:
    # With 16 sequences some block almost always misses, and a miss drafts before the verify:
    # draft-ahead then pays the draft and the overlap both; cohorts overlap for sure.
    model = costs(verify_fixed_ms=8, verify_per_token_ms=0.2, step_ms=5)
    candidates = batch(16, 0.8)
    m = round_model(model, candidates)
    ks = [4] * 16
    assert m.rate("ahead", ks) < m.rate("sequential", ks) < m.rate("cohort", ks)
    assert choose(model, candidates).pipeline == "cohort"


def check_negligible_draft_cost_keeps_sequential() -> None:
    model = costs(verify_fixed_ms=20, verify_per_token_ms=0.1, step_ms=0.01)
    choice = choose(model, batch(1, 0.9))
    assert choice.pipeline == "sequential" and choice.ks == [4]
    m = round_model(model, batch(1, 0.9))
    assert m.rate("ahead", [4]) < 1.03 * m.rate("sequential", [4])  # nothing worth a switch


CHECKS: list[Callable[[], None]] = [
    check_expensive_drafter_with_good_acceptance_overlaps,
    check_shared_compute_runs_sequential,
    check_large_batch_prefers_cohort_to_ahead,
    check_negligible_draft_cost_keeps_sequential,
    check_guesses_that_miss_keep_ahead_blocks_from_standing,
]


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_choice_follows_the_costs(check: Callable[[], None]) -> None:
    check()


def _ahead_is_free(self: RoundModel, ks: Sequence[int]) -> tuple[float, float]:
    """Wrong: the drafts made during the verify and the redrafts after a miss cost nothing."""
    return sum(self.tables[i][k] for i, k in enumerate(ks)), self.costs.overhead.get() + self._verify_ns(ks)


def _ahead_never_misses(self: RoundModel, ks: Sequence[int]) -> tuple[float, float]:
    """Wrong: every ahead block assumed to stand, so no draft is ever on the critical path."""
    drafting = sum(1 for k in ks if k > 0)
    ahead = self.costs.draft_ns(drafting, max(ks) + 1)
    ns = self.costs.overhead.get() + concurrent(self._verify_ns(ks), ahead, self.overlap)
    return sum(self.tables[i][k] for i, k in enumerate(ks)), ns


def _guess_taken_as_acceptance(self: RoundModel, ks: Sequence[int]) -> tuple[float, float]:
    """Wrong: the guess at the verifier's token assumed right as often as the next draft is accepted."""
    real = self.guesses
    try:
        object.__setattr__(self, "guesses", [r[min(k, len(r) - 1)] for r, k in zip(self.rates, ks, strict=True)])
        return REAL_AHEAD(self, ks)
    finally:
        object.__setattr__(self, "guesses", real)


REAL_AHEAD = RoundModel._ahead


def _overlap_assumed_perfect(a: float, b: float, overlap: float) -> float:
    """Wrong: the measured overlap ignored, two exchanges at once always take the longer's time."""
    return max(a, b)


MUTATIONS = [
    (RoundModel, "_ahead", _ahead_is_free),
    (RoundModel, "_ahead", _ahead_never_misses),
    (RoundModel, "_ahead", _guess_taken_as_acceptance),
    (pipeline_choice, "concurrent", _overlap_assumed_perfect),
]


@pytest.mark.parametrize("target, name, wrong", MUTATIONS, ids=lambda m: getattr(m, "__name__", ""))
def test_a_planted_wrong_formula_fails_a_check(
    monkeypatch: pytest.MonkeyPatch, target: object, name: str, wrong: Callable[..., object]
) -> None:
    monkeypatch.setattr(target, name, wrong)
    failed = []
    for check in CHECKS:
        try:
            check()
        except AssertionError:
            failed.append(check.__name__)
    assert failed, f"no check notices {wrong.__name__}"


def test_round_models_agree_on_target_only_and_on_their_formulas() -> None:
    model = expensive_drafter()
    candidates = batch(2, 0.9)
    m = round_model(model, candidates, overlap=0.5)
    target_only = m.rate("sequential", [0, 0])
    assert m.rate("ahead", [0, 0]) == target_only == m.rate("cohort", [0, 0])
    v = model.verify.predict(2 * 5)
    d = 0.5 * MS + 4 * model.step.predict(2)
    assert m.cycle("sequential", [4, 4])[1] == pytest.approx(0.5 * MS + d + v)
    # Draft-ahead: 5 draft steps beside the verify, and a redraft when either block misses.
    stands = 0.9**5
    redraft = 0.5 * MS + 4 * model.step.predict(2 * (1 - stands) / (1 - stands**2))
    ahead = 0.5 * MS + (1 - stands**2) * redraft + concurrent(v, 0.5 * MS + 5 * model.step.predict(2), 0.5)
    assert m.cycle("ahead", [4, 4])[1] == pytest.approx(ahead)
    # Cohort: two phases, each one sequence verified beside the other's 4 draft steps.
    half = 0.5 * MS + concurrent(model.verify.predict(5), 0.5 * MS + 4 * model.step.predict(1), 0.5)
    tokens, ns = m.cycle("cohort", [4, 4])
    assert ns == pytest.approx(2 * half)
    assert tokens == pytest.approx(2 * expected_tokens_table([0.9] * 4, 4)[4])


def test_cohort_needs_drafting_sequences_in_both_cohorts() -> None:
    model = expensive_drafter()
    alone = [
        Candidate(cap=4, rates=[0.95] * 4, cohort=0, guess=0.95),
        Candidate(cap=4, rates=[0.95] * 4, cohort=0, guess=0.95),
    ]
    m = round_model(model, alone)
    assert not m.paired([4, 4])
    assert m.rate("cohort", [4, 4]) == m.rate("sequential", [4, 4])
    assert choose(model, alone).pipeline != "cohort"
    one_drafts = batch(2, 0.95)
    assert not round_model(model, one_drafts).paired([4, 0])


@pytest.mark.parametrize("overlap", [0.0, 1.0])
@pytest.mark.parametrize("n", [1, 2, 8])
def test_poor_acceptance_runs_target_only_in_any_pipeline(overlap: float, n: int) -> None:
    for current in MODES:
        choice = choose(expensive_drafter(), batch(n, 0.02), overlap, current)
        assert choice.ks == [0] * n and choice.pipeline == "sequential"
        assert choice.predicted_rate == pytest.approx(choice.baseline_rate)
        for mode in MODES:  # a request that names its pipeline keeps it, and still gets k = 0
            only = choose_round(batch(n, 0.02), expensive_drafter(), 4, overlap, (mode,), mode)
            assert only.ks == [0] * n


def test_the_margin_never_keeps_drafts_that_lose_to_target_only() -> None:
    # Acceptance where drafting barely loses: the last round's ahead must not be kept for the margin.
    model = costs(verify_fixed_ms=20, verify_per_token_ms=0.1, step_ms=8)
    choice = choose(model, batch(1, 0.3), overlap=1.0, current="ahead")
    m = round_model(model, batch(1, 0.3))
    if any(choice.ks):
        assert choice.predicted_rate >= m.rate("sequential", [0])
    else:
        assert choice.pipeline == "sequential"


def test_overlap_is_learnt_from_rounds_and_starts_optimistic() -> None:
    fresh = Overlap()
    assert fresh.value == 1.0
    shared = Overlap()
    for _ in range(3):
        shared.observe(20 * MS, 20 * MS, 40 * MS)  # the two took as long as one after the other
    assert shared.value < 0.15
    apart = Overlap()
    for _ in range(3):
        apart.observe(20 * MS, 15 * MS, 20 * MS)
    assert apart.value == pytest.approx(1.0)
    half = Overlap(prior_weight=0.0)
    half.observe(20 * MS, 10 * MS, 25 * MS)
    assert half.value == pytest.approx(0.5)


def test_policy_runs_sequential_until_both_services_are_timed() -> None:
    policy = SpeculationPolicy(PolicyConfig(k_max=4))
    assert policy.choose(batch(4, 0.95), 4, MODES) == [4] * 4
    assert policy.last_pipeline == "sequential"


def test_policy_learns_the_overlap_without_polluting_the_verify_cost() -> None:
    policy = SpeculationPolicy(PolicyConfig(k_max=4))
    policy.costs = expensive_drafter()
    assert policy.choose(batch(1, 0.95), 1, MODES) and policy.last_pipeline == "ahead"
    verify_samples = policy.costs.verify.samples
    predicted_verify = policy.costs.verify.predict(5)
    # Shared compute: the verify and the 5-step draft beside it took as long as both in turn.
    ahead_ns = 0.5 * MS + 5 * policy.costs.step.predict(1)
    for _ in range(4):
        policy.observe_round([4], int(60 * MS), 0, int(predicted_verify + ahead_ns), 0, 5, [], [5])
    assert policy.costs.verify.samples == verify_samples  # the phase is not a verify alone
    assert policy.overlap.value < 0.15
    policy.choose(batch(1, 0.95), 1, MODES)
    assert policy.last_pipeline == "sequential"


def test_policy_learns_how_often_a_sequences_guess_is_right() -> None:
    policy = SpeculationPolicy(PolicyConfig(k_max=4))
    policy.costs = expensive_drafter()
    policy.overlap = Overlap(prior=0.8)
    for _ in range(20):
        policy.overall.observe(4, 4)  # drafts nearly always accepted
    rates = policy.overall.rates()

    def one(guess: HitRate) -> list[Candidate]:
        return [Candidate(cap=4, rates=rates, guess=policy.guess_rate(guess))]

    greedy, sampled = policy.new_guess_rate(), policy.new_guess_rate()
    # Before any guess is seen: right as often as a first draft is accepted, so ahead is tried.
    assert policy.guess_rate(sampled) == pytest.approx(rates[0])
    policy.choose(one(sampled), 1, MODES)
    assert policy.last_pipeline == "ahead"
    for i in range(12):
        policy.observe_guess(greedy, True)
        policy.observe_guess(sampled, i % 4 == 0)
    assert policy.guess_rate(sampled) < 0.45 < 0.9 < policy.guess_rate(greedy)
    policy.choose(one(sampled), 1, MODES)
    assert policy.last_pipeline == "sequential"
    policy.choose(one(greedy), 1, MODES)
    assert policy.last_pipeline == "ahead"
    # A new sequence starts from what all sequences' guesses did.
    overall = policy.guess_rate(policy.new_guess_rate())
    assert 0.45 < overall < 0.9


def test_policy_keeps_a_single_offered_pipeline() -> None:
    policy = SpeculationPolicy(PolicyConfig(k_max=4))
    policy.costs = expensive_drafter()
    policy.choose(batch(1, 0.95), 1, ("cohort",))
    assert policy.last_pipeline == "cohort"  # the request named it; the policy chose k only
    fixed = [Candidate(cap=4, rates=[0.95] * 4, fixed=3, guess=0.95)]
    assert policy.choose(fixed, 1, MODES) == [3]
    assert policy.last_pipeline == "ahead" and policy.last_choice is None


def test_calibration_lowers_a_pipeline_that_delivers_less_than_its_model_and_forgets_slowly() -> None:
    calibration = Calibration(prior_tokens=32.0, forget=0.99)
    assert calibration.factor("cohort") == 1.0  # trusted until measured
    for _ in range(40):
        calibration.observe("cohort", 12.0, 20.0)  # its rounds emit 0.6 of what the model said
        calibration.observe("ahead", 30.0, 20.0)  # better than its model: never raised above it
        calibration.age()
    assert calibration.factor("cohort") == pytest.approx(0.6, abs=0.05)
    assert calibration.factor("ahead") == 1.0 and calibration.factor("sequential") == 1.0
    for _ in range(500):
        calibration.age()  # rounds in which cohort is not chosen
    assert 0.9 < calibration.factor("cohort") < 1.0  # tried again, a few hundred rounds on


def test_calibration_keeps_batches_of_different_sizes_apart() -> None:
    """Traced with a bfloat16 verifier at 8 clients: draft-ahead delivered what its model said for
    the two sequences left at the end of a wave, and half of it for 8, where the drafter beside
    the verify slows it most. One factor for both sizes would be pulled up by the small batches
    and keep the pipeline tried at 8."""
    calibration = Calibration(prior_tokens=32.0, forget=0.99)
    for _ in range(40):
        calibration.observe("ahead", 3.0, 3.0, batch=2)
        calibration.observe("ahead", 6.0, 12.0, batch=8)
        calibration.age()
    assert calibration.factor("ahead", 2) == 1.0
    assert calibration.factor("ahead", 8) == pytest.approx(0.5, abs=0.05)
    assert calibration.factor("ahead", 7) == calibration.factor("ahead", 5) == calibration.factor("ahead", 8)
    assert calibration.factor("ahead", 9) == 1.0  # a larger class: not measured


def test_a_pipeline_whose_rounds_fall_short_of_its_model_stops_being_chosen() -> None:
    """The floor under auto: whatever a round model leaves out, rounds that deliver less than
    target-only teach the policy to leave the pipeline, here for target-only."""
    policy = SpeculationPolicy(PolicyConfig(k_max=4))
    policy.costs = costs(verify_fixed_ms=8, verify_per_token_ms=0.2, step_ms=5)
    candidates = batch(16, 0.8)
    assert any(policy.choose(candidates, 16, MODES)) and policy.last_pipeline == "cohort"
    first = policy.last_choice
    assert first is not None and first.model_rate == pytest.approx(first.predicted_rate)
    for _ in range(60):
        choice = policy.last_choice
        if choice is None or not any(choice.ks):
            break
        # The round took as long as modelled but emitted no more than a target-only round would.
        round_ns = 40 * MS
        emitted = int(choice.baseline_rate * round_ns / 1e9 * 0.9)
        policy.observe_round(choice.ks, round_ns, 0, round_ns, 0, emitted, [0] * 16, choice.ks)
        policy.choose(candidates, 16, MODES)
    assert not any(policy.choose(candidates, 16, MODES))
    assert policy.calibration.factor("cohort", 16) < first.baseline_rate / first.model_rate
    assert policy.calibration.factor("cohort", 2) == 1.0  # learnt for batches of its size only


def steep_line_costs() -> CostModel:
    """Verifies timed alone at 1 position (60 ms) and 10 (330 ms, a batch of two) only: the line
    through them charges 30 ms a position; a 10 ms drafter step."""
    model = CostModel()
    for _ in range(20):
        model.verify.observe(1, 60 * MS)
    model.verify.observe(10, 330 * MS)
    model.step.observe(1, 10 * MS)
    model.draft_fixed.observe(1 * MS)
    model.overhead.observe(0.5 * MS)
    return model


@pytest.mark.parametrize("timed_apart", [True, False])
def test_draft_ahead_prices_its_blocks_as_timed_beside_the_drafter(timed_apart: bool) -> None:
    """Rounds alone timed the verify at sizes 1 and 10 only (a batch of two), and on this device
    a block's extra positions cost little at one sequence (as on a CPU, where the verify's
    fixed cost dominates): the line through those sizes overprices every block. Draft-ahead
    rounds time their own verifies (request to reply) and price the sizes they run from that,
    so k grows to what pays; priced from the line alone it stays small."""
    policy = SpeculationPolicy(PolicyConfig(k_max=4))
    policy.costs = steep_line_costs()
    candidates = [Candidate(cap=4, rates=[0.7] * 4, guess=0.9)]

    def beside_ms(positions: int) -> float:
        return 60 + 2 * positions  # the verify as it runs beside the drafter, at one sequence

    for _ in range(30):
        ks = policy.choose(candidates, 1, MODES)
        assert policy.last_pipeline == "ahead" and ks[0] > 0
        verify = beside_ms(ks[0] + 1) * MS
        draft = (1 + (ks[0] + 1) * 10) * MS
        phase = max(verify, draft) + 1 * MS
        emitted = round(expected_tokens([0.7] * 4, ks[0]))
        reply = int(verify) if timed_apart else 0
        policy.observe_round(
            ks, int(phase + 0.5 * MS), 0, int(phase), 0, emitted, [], [ks[0] + 1], verify_reply_ns=reply
        )
    if timed_apart:
        assert ks[0] >= 3  # 4 stands less often: a miss drafts again before the verify
        assert policy.costs.verify_beside_ns(5) == pytest.approx(beside_ms(5) * MS, rel=0.05)
    else:
        assert ks[0] <= 2  # the line's price: what the verify beside the drafter costs is never learnt
        assert policy.costs.verify_beside.samples == 0


def traced_drafter_costs(model: CostModel) -> None:
    """The int4 drafter's step for one and two sequences, its fixed cost and the gateway's, as
    traced beside the fused float32 verifier on a 2-core EPYC."""
    model.step.observe(1, 16 * MS)
    model.step.observe(2, 30 * MS)
    model.draft_fixed.observe(2 * MS)
    model.overhead.observe(1 * MS)


def test_draft_ahead_reaches_the_long_block_a_humped_verify_hides() -> None:
    """Shaped as traced on a 2-core EPYC (float32 target, fused forward): beside the drafter, a
    verify of 2 positions took 76 ms, of 3 about 118 and of 5 only 80 (the CPU's products over 3
    rows are slow ones); every draft is accepted. From the prior acceptance (0.7) the policy
    starts at k = 1; with the positions it has not tried left at that prior, it stays at k = 3
    here (at k = 1 in the trace): k = 4 is never tried, so its acceptance is never learnt.
    Untried positions borrowing the rate before them, it reaches k = 4 and learns what 5
    positions cost."""
    beside_ms = {1: 53.0, 2: 76.0, 3: 118.0, 4: 95.0, 5: 80.0}
    policy = SpeculationPolicy(PolicyConfig(k_max=4))
    model = policy.costs
    for _ in range(30):  # warm-up and target-only rounds: one sequence and two, alone
        model.verify.observe(1, 54 * MS)
        model.verify.observe(2, 78 * MS)
    traced_drafter_costs(model)
    chosen = []
    for _ in range(40):
        rates = policy.overall.rates()
        candidates = [Candidate(cap=4, rates=rates, guess=policy.guess_rate(policy.new_guess_rate()))]
        ks = policy.choose(candidates, 1, MODES)
        chosen.append(ks[0])
        k = ks[0]
        if k:
            policy.overall.observe(k, k)
        verify = beside_ms[k + 1] * MS
        draft = (2 + (k + 1) * 18) * MS if k else 0.0
        phase = max(verify, draft) + 1 * MS
        policy.observe_round(
            ks, int(phase), 0, int(phase), 0, k + 1, [], [k + 1] if k else [], verify_reply_ns=int(verify)
        )
    assert chosen[0] == 1  # where the prior starts it
    assert chosen[-10:] == [4] * 10
    assert policy.costs.verify_beside_ns(5) == pytest.approx(80 * MS, rel=0.1)


def test_the_search_scores_every_uniform_k_where_the_price_line_misses_it() -> None:
    """The traced state itself: verifies beside the drafter timed at 2 positions (78 ms, many
    rounds) and 3 (101 and 134 ms, twice); acceptance near 1 at every position. Under the line
    through those sizes each verified position costs about 40 ms, so the search's marginal price
    makes k = 1 look as good as anything longer, and it never scores k = 4, which the round
    model (5 positions priced at the 3 measured, at most) predicts 1.6x faster."""
    policy = SpeculationPolicy(PolicyConfig(k_max=4))
    model = policy.costs
    for _ in range(300):
        model.verify.observe(1, 54 * MS)
    for _ in range(100):
        model.verify.observe(2, 78 * MS)
        model.verify_beside.observe(2, 78 * MS)
        model.step_beside.observe(1, 18 * MS)
    model.verify_beside.observe(3, 101 * MS)
    model.verify_beside.observe(3, 134 * MS)
    traced_drafter_costs(model)
    candidates = [Candidate(cap=4, rates=[0.995] * 4, guess=0.99)]
    assert policy.choose(candidates, 1, MODES) == [4]
    assert policy.last_pipeline == "ahead"
    offered = dict((mode, rate) for mode, rate, _ in policy.last_choice.offered)
    rounds = RoundModel(model, 1.0, [expected_tokens_table([0.995] * 4, 4)], [[0.995] * 4], [0], [0.99])
    assert offered["ahead"] == pytest.approx(rounds.rate("ahead", [4]))
    assert rounds.rate("ahead", [4]) > 1.5 * rounds.rate("ahead", [1])


def test_the_search_keeps_the_best_ks_it_scored_when_its_price_is_off() -> None:
    """Priced at a steep verify (30 ms a position) while the round it scores verifies nearly
    for free, the search swings between k = 1 and k = 0: the k = 1 it scored must win over
    the target-only round it ends on."""
    model = steep_line_costs()
    candidates = [Candidate(cap=1, rates=[0.7], guess=0.9)]

    def nearly_free(ks: list[int]) -> float:
        return (1.0 + 0.7 * ks[0]) / ((60 + 2 * ks[0]) * MS) * 1e9

    choice = choose_ks(candidates, model, 1, nearly_free)
    assert choice.ks == [1]
    assert choice.predicted_rate == pytest.approx(nearly_free([1]))


@pytest.mark.parametrize("timed_beside", [True, False])
def test_draft_ahead_prices_its_drafting_as_timed_beside_the_verify(timed_beside: bool) -> None:
    """Costs shaped as measured on a 2-core EPYC at one sequence. The drafter's step was timed
    alone only in exchanges drafting right after a missed block, which first catch up on the
    verdict's tokens (33 ms a step); the blocks drafted beside the verify take 25 ms a step.
    Timed there, draft-ahead's block grows past 2 drafts; priced at the step timed alone, it
    does not."""
    policy = SpeculationPolicy(PolicyConfig(k_max=4))
    model = CostModel()
    for _ in range(20):
        model.verify.observe(1, 68 * MS)
    model.step.observe(1, 33 * MS)
    model.draft_fixed.observe(1 * MS)
    model.overhead.observe(0.5 * MS)
    policy.costs = model
    beside_ms = {2: 90.0, 3: 103.0, 4: 99.0, 5: 104.0}  # the verify, by positions
    rates = [0.95] * 4
    candidates = [Candidate(cap=4, rates=rates, guess=0.95)]
    for _ in range(20):
        ks = policy.choose(candidates, 1, MODES)
        assert policy.last_pipeline == "ahead" and ks[0] > 0
        verify = beside_ms[ks[0] + 1] * MS
        draft = (1 + (ks[0] + 1) * 25) * MS
        phase = max(verify, draft) + 1 * MS
        emitted = round(expected_tokens(rates, ks[0]))
        ahead = [ks[0] + 1]
        timed = (int(draft), int(draft - 1 * MS)) if timed_beside else (0, 0)
        policy.observe_round(
            ks,
            int(phase + 0.5 * MS),
            0,
            int(phase),
            0,
            emitted,
            [],
            ahead,
            verify_reply_ns=int(verify),
            ahead_ns=timed[0],
            ahead_forward_ns=timed[1],
        )
    if timed_beside:
        assert ks[0] >= 3
        assert policy.costs.step_beside_ns(1) == pytest.approx(25 * MS, rel=0.01)
    else:
        assert ks == [2]


def test_the_choice_records_every_pipeline_it_weighed() -> None:
    candidates = batch(4, 0.9)
    chosen = choose(expensive_drafter(), candidates)
    assert [mode for mode, _, _ in chosen.offered] == list(MODES)
    rates = {mode: rate for mode, rate, _ in chosen.offered}
    assert chosen.predicted_rate == max(rates.values())
    alone = {mode: choose_round(candidates, expensive_drafter(), 4, 1.0, (mode,), mode) for mode in MODES}
    for mode, rate, mean_k in chosen.offered:
        assert rate == pytest.approx(alone[mode].predicted_rate)
        assert mean_k == pytest.approx(sum(alone[mode].ks) / len(candidates))
    text = offered_text([("sequential", 63.04, 0.0), ("ahead", 111.06, 2.25)])
    assert text == "sequential 63.0/k0.0, ahead 111.1/k2.2"


def cpu_costs_after_small_batches_beside() -> tuple[CostModel, CostModel]:
    """Shaped as traced at 32 clients on a 2-core EPYC: target-only rounds have timed the verify
    alone at every batch up to 64 positions; the overlapped pipelines have run only at two
    sequences (a verify of 8 positions, drafts for 2). Returns that model and the same one told
    what every size costs beside the other service (5% above alone)."""
    model = CostModel()
    for n in range(1, 65):
        model.verify.observe(n, (40 + 5 * n) * MS)
    for b in (1, 2):
        model.step.observe(b, (20 + 2 * b) * MS)
    model.verify_beside.observe(8, 1.05 * (40 + 5 * 8) * MS)
    model.step_beside.observe(2, 1.05 * 24 * MS)
    model.draft_fixed.observe(1 * MS)
    model.overhead.observe(0.5 * MS)
    informed = deepcopy(model)
    for n in range(1, 129):
        informed.verify_beside.observe(n, 1.05 * informed.verify.predict(n))
    for b in range(1, 33):
        informed.step_beside.observe(b, 1.05 * informed.step.predict(b))
    return model, informed


def test_a_batch_far_beyond_the_sizes_run_beside_is_priced_no_lower_than_alone() -> None:
    """A verify of 62 positions beside the drafter had been priced at the 8 positions measured
    there (the optimistic guess for an untried size): auto chose draft-ahead and cohort for 31
    sequences at twice target-only's predicted rate, and ran them below it. Floored by what the
    rounds alone measured, the choice's prediction holds when the sizes are known."""
    model, informed = cpu_costs_after_small_batches_beside()
    assert model.verify_beside_ns(62) == pytest.approx(model.verify.predict(62), rel=0.02)
    assert model.verify_beside_ns(12) >= model.verify.lower_bound(12)  # near the sizes run: the next one up
    candidates = batch(31, 0.95)
    chosen = choose(model, candidates)
    truth = RoundModel(
        informed,
        1.0,
        [expected_tokens_table(c.rates, c.cap) for c in candidates],
        [c.rates for c in candidates],
        [c.cohort for c in candidates],
        [c.guess for c in candidates],
    )
    assert chosen.predicted_rate <= 1.1 * truth.rate(chosen.pipeline, chosen.ks)
    assert chosen.predicted_gain < 1.3


def test_one_sequence_gets_the_k_its_round_model_rates_best() -> None:
    """Alone, every k it may draft is scored: the choice is the best of them under each pipeline."""
    rng = random.Random(7)
    chosen_ks = set()
    for _ in range(40):
        model = costs(rng.uniform(1, 30), rng.uniform(0.05, 3), rng.uniform(0.2, 20))
        (one,) = candidates = batch(1, rng.uniform(0.3, 0.99), cap=rng.randint(1, 4))
        for mode in MODES:
            chosen = choose_round(candidates, model, 4, 0.8, (mode,), mode)
            rates = [round_model(model, candidates, 0.8).rate(mode, [k]) for k in range(one.cap + 1)]
            assert rates[chosen.ks[0]] == pytest.approx(max(rates))
            chosen_ks.add(chosen.ks[0])
    assert chosen_ks == {0, 1, 2, 3, 4}  # the draws reach every k


def test_cohorts_that_cannot_take_turns_are_not_weighed_and_change_nothing() -> None:
    """One sequence, or all in one cohort, or the other cohort unable to draft: a cohort round would
    be a sequential one, so it is not searched, and the choice is the one without it."""
    unpaired = [
        batch(1, 0.95),
        [replace(c, cohort=0) for c in batch(4, 0.95)],
        [replace(c, cap=0) if c.cohort else c for c in batch(4, 0.95)],
    ]
    for candidates in unpaired:
        chosen = choose(expensive_drafter(), candidates)
        assert [mode for mode, _, _ in chosen.offered] == ["sequential", "ahead"]
        without = choose_round(candidates, expensive_drafter(), 4, 1.0, ("sequential", "ahead"), "sequential", 0.03)
        assert (chosen.ks, chosen.pipeline, chosen.predicted_rate) == (
            without.ks,
            without.pipeline,
            without.predicted_rate,
        )
    assert [mode for mode, _, _ in choose(expensive_drafter(), batch(2, 0.95)).offered] == list(MODES)
