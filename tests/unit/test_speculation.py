"""Adaptive speculation: the maths and the choice of k on synthetic costs and acceptance."""

from __future__ import annotations

import itertools
import random

import pytest
from synthetic_costs import MS, costs

from gateway.config import GatewayConfig
from gateway.round import speculation
from gateway.round.acceptance import Acceptance
from gateway.round.costs import CostModel, LinearCost, SizedCost
from gateway.round.pipeline_choice import MODES as PIPELINES
from gateway.round.speculation import (
    HEURISTICS,
    Candidate,
    PolicyConfig,
    SpeculationPolicy,
    choose_ks,
    expected_tokens,
    expected_tokens_table,
    leviathan_speedup,
)
from gateway.round.widths import Ahead, other_verdicts, stands_with


def test_expected_tokens_matches_the_geometric_series() -> None:
    alpha, k = 0.8, 4
    assert expected_tokens([alpha] * k, k) == pytest.approx((1 - alpha ** (k + 1)) / (1 - alpha))
    assert expected_tokens([0.9, 0.5, 0.1], 0) == 1.0
    assert expected_tokens([0.9, 0.5, 0.1], 2) == pytest.approx(1 + 0.9 + 0.45)


def test_leviathan_bound() -> None:
    # Free drafts, free verification: the bound is the expected tokens per round.
    assert leviathan_speedup(0.8, 4, 0.0) == pytest.approx(3.3616)
    # The paper's example shape: alpha 0.8, k 4, c 0.05 -> (1 - 0.8^5) / (0.2 * 1.2).
    assert leviathan_speedup(0.8, 4, 0.05) == pytest.approx(3.3616 / 1.2)
    assert leviathan_speedup(1.0, 3, 0.0, 2.0) == pytest.approx(2.0)
    assert leviathan_speedup(0.5, 0, 0.3) == 1.0


def test_acceptance_counts_conditional_rates() -> None:
    acc = Acceptance(3, 0.5, prior_weight=0.0)
    acc.observe(3, 3)  # all accepted
    acc.observe(3, 1)  # first accepted, second rejected, third never judged
    acc.observe(3, 0)
    assert acc.tried == [3, 2, 1]
    assert acc.accepted == [2, 1, 1]
    assert acc.rates() == pytest.approx([2 / 3, 1 / 2, 1.0])


def test_acceptance_prior_fills_untried_positions() -> None:
    acc = Acceptance(2, [0.9, 0.6], prior_weight=4.0)
    assert acc.rates() == pytest.approx([0.9, 0.6])
    for _ in range(400):
        acc.observe(2, 0)
    assert acc.rate(0) < 0.02
    assert acc.rate(1) == pytest.approx(0.6)


def test_borrowing_acceptance_prices_untried_positions_at_the_rate_before() -> None:
    # Rounds of one draft teach only the first position: borrowed, the later ones are priced
    # as it is, not at the prior; a first position worse than the prior lowers none of them.
    alone, borrowing = Acceptance(4, 0.7, prior_weight=2.0), Acceptance(4, 0.7, prior_weight=2.0, borrow=True)
    for acc in (alone, borrowing):
        for _ in range(100):
            acc.observe(1, 1)
    assert alone.rates()[1:] == pytest.approx([0.7] * 3)
    assert borrowing.rates() == pytest.approx([0.99] * 4, abs=0.01)
    assert borrowing.rate(3) == borrowing.rates()[3]
    poor = Acceptance(3, 0.7, prior_weight=2.0, borrow=True)
    for _ in range(100):
        poor.observe(1, 0)
    assert poor.rate(0) < 0.05
    assert poor.rates()[1:] == pytest.approx([0.7, 0.7])
    for _ in range(200):
        poor.observe(3, 1)  # a position tried learns its own rate
    assert poor.rate(1) < 0.02


def test_linear_cost_recovers_a_line_and_never_goes_negative() -> None:
    fit = LinearCost(forget=1.0)
    for x in range(1, 20):
        fit.observe(x, 3.0 + 2.0 * x)
    w0, w1 = fit.coefficients()
    assert w0 == pytest.approx(3.0, rel=1e-3)
    assert w1 == pytest.approx(2.0, rel=1e-3)
    one = LinearCost()
    one.observe(5, 10.0)  # a single point: flat, the optimistic guess for unseen x
    assert one.predict(50) == pytest.approx(10.0)
    falling = LinearCost(forget=1.0)
    for x in range(1, 10):
        falling.observe(x, 100.0 - x)
    assert falling.coefficients()[1] == 0.0


# A CPU verifier's cost (ms) by positions checked, one sequence: not a line (two or three
# positions cost about as much as five, where the LM head's product over a few rows is slow).
HUMPED_VERIFY_MS = {1: 59.0, 2: 81.0, 3: 93.0, 4: 86.0, 5: 93.0}


def humped_costs(verify: SizedCost | LinearCost, step_ms: float) -> CostModel:
    """What a policy has measured on that verifier: mostly 1 and 5 positions, a few rounds of 2 and 3."""
    model = CostModel()
    model.verify = verify  # type: ignore[assignment]  # LinearCost: the line alone, to compare
    for _ in range(30):
        for n in (1, 5):
            model.verify.observe(n, HUMPED_VERIFY_MS[n] * MS)
    for _ in range(3):
        for n in (2, 3):
            model.verify.observe(n, HUMPED_VERIFY_MS[n] * MS)
    for _ in range(5):
        model.step.observe(1, step_ms * MS)
    model.draft_fixed.observe(0.5 * MS)
    model.overhead.observe(0.5 * MS)
    return model


def true_rate(rates: list[float], k: int, step_ms: float) -> float:
    draft = 0.5 + k * step_ms if k else 0.0
    return expected_tokens_table(rates, 4)[k] / (HUMPED_VERIFY_MS[k + 1] + draft + 0.5)


def test_sized_cost_learns_each_measured_size_and_fits_a_line_elsewhere() -> None:
    sized = humped_costs(SizedCost(), step_ms=10).verify
    line = humped_costs(LinearCost(), step_ms=10).verify
    for n in (1, 5):
        assert sized.predict(n) == pytest.approx(HUMPED_VERIFY_MS[n] * MS, rel=0.03)
    for n in (2, 3):
        # The line underprices the sizes between the two it mostly sees; the sizes' own rounds correct it.
        assert line.predict(n) < 0.9 * HUMPED_VERIFY_MS[n] * MS
        assert sized.predict(n) == pytest.approx(HUMPED_VERIFY_MS[n] * MS, rel=0.06)
    assert sized.predict(4) == pytest.approx(line.predict(4))  # never measured: the line
    assert sized.coefficients() == line.coefficients()
    one_slow = SizedCost()
    for _ in range(20):
        one_slow.observe(8, 10.0)
        one_slow.observe(24, 30.0)
    one_slow.observe(16, 60.0)  # one slow round at a new size: halfway, not taken as its price
    assert one_slow.line.predict(16) < 25.0
    assert 35.0 < one_slow.predict(16) < 45.0
    assert SizedCost.key(32) == 32 and SizedCost.key(33) == 32
    assert SizedCost.key(1000) < 64  # large sizes share buckets: the table stays small


@pytest.mark.parametrize(
    ("step_ms", "acceptance", "want"),
    [(15.0, [0.5] * 4, 0), (10.0, [0.8, 0.7, 0.6, 0.5], 3), (5.0, [0.9, 0.7, 0.5, 0.3], 3)],
)
def test_per_size_verify_costs_choose_the_k_that_is_fastest(step_ms: float, acceptance: list[float], want: int) -> None:
    """With a humped verify cost, the line alone picks a k of 1 or 2 that is slower than the best
    (or than target-only, below the 0.95x floor); the per-size costs pick the best."""
    rates = [true_rate(acceptance, k, step_ms) for k in range(5)]
    assert max(range(5), key=rates.__getitem__) == want
    candidate = [Candidate(4, acceptance)]
    assert choose_ks(candidate, humped_costs(SizedCost(), step_ms), 4).ks == [want]
    line_k = choose_ks(candidate, humped_costs(LinearCost(), step_ms), 4).ks[0]
    assert line_k in (1, 2) and rates[line_k] < 0.96 * rates[want]


def test_cheap_verification_and_good_acceptance_draft_the_most() -> None:
    # GPU-like: verifying 5 tokens costs about as much as 1; the drafter is 1/10 of the target.
    model = costs(verify_fixed_ms=20, verify_per_token_ms=0.05, step_ms=2)
    choice = choose_ks([Candidate(cap=6, rates=[0.9] * 6)], model, 6)
    assert choice.ks == [6]
    assert choice.predicted_gain > 2.5


def test_poor_acceptance_stops_drafting() -> None:
    model = costs(verify_fixed_ms=20, verify_per_token_ms=0.05, step_ms=6)
    choice = choose_ks([Candidate(cap=4, rates=[0.1] * 4)], model, 4)
    assert choice.ks == [0]
    assert choice.predicted_gain == pytest.approx(1.0)


def test_compute_bound_verification_shrinks_k_as_the_batch_grows() -> None:
    # CPU-like: every verified token costs; the drafter step is 1/3 of a target step at batch 1.
    model = costs(verify_fixed_ms=20, verify_per_token_ms=6, step_ms=8, step_per_seq_ms=1)
    good = [0.9] * 4
    chosen = []
    for batch in (1, 4, 16, 32):
        choice = choose_ks([Candidate(cap=4, rates=good)] * batch, model, 4)
        assert len(set(choice.ks)) == 1  # identical sequences get identical k
        chosen.append(choice.ks[0])
        assert choice.predicted_rate >= choice.baseline_rate
    assert chosen[0] >= 3
    assert chosen == sorted(chosen, reverse=True)
    assert chosen[-1] == 0  # at high concurrency drafting no longer pays


def test_verify_cost_counts_padded_rows() -> None:
    model = costs(verify_fixed_ms=20, verify_per_token_ms=2, step_ms=4)
    # One sequence drafting 4 makes every row 5 positions long.
    assert model.round_ns([4, 0, 0]) - model.round_ns([4, 4, 4]) == pytest.approx(0)
    assert model.round_ns([0, 0, 0]) < model.round_ns([1, 0, 0])


def test_sequences_are_chosen_by_their_own_acceptance() -> None:
    # The verifier pads rows to the longest block, so a sequence's drafts cost only
    # the drafter's work for it: a sequence whose drafts fail stops drafting once that costs.
    model = costs(verify_fixed_ms=20, verify_per_token_ms=0.5, step_ms=1, step_per_seq_ms=1)
    candidates = [Candidate(cap=4, rates=[0.95] * 4), Candidate(cap=4, rates=[0.05] * 4), Candidate(cap=0, rates=[])]
    ks = choose_ks(candidates, model, 4).ks
    assert ks[0] >= 3
    assert ks[1] == 0
    assert ks[2] == 0


def test_fixed_candidates_keep_their_k() -> None:
    # The verifier pads rows to the longest block, so only the drafter's work for the other
    # sequence (its cost per sequence) keeps its hopeless drafts from paying.
    model = costs(verify_fixed_ms=20, verify_per_token_ms=6, step_ms=8, step_per_seq_ms=2)
    ks = choose_ks([Candidate(cap=4, rates=[0.05] * 4, fixed=3), Candidate(cap=4, rates=[0.05] * 4)], model, 4).ks
    assert ks == [3, 0]


@pytest.mark.parametrize("seed", range(6))
def test_choice_is_near_the_brute_force_optimum(seed: int) -> None:
    rng = random.Random(seed)
    model = costs(
        verify_fixed_ms=rng.uniform(5, 40),
        verify_per_token_ms=rng.uniform(0.01, 8),
        step_ms=rng.uniform(1, 20),
        step_per_seq_ms=rng.uniform(0, 2),
    )
    k_max = 3
    candidates = [
        Candidate(cap=rng.randint(0, k_max), rates=[rng.uniform(0.05, 0.99) for _ in range(k_max)]) for _ in range(3)
    ]

    def rate(ks: tuple[int, ...]) -> float:
        tokens = sum(expected_tokens(c.rates, k) for c, k in zip(candidates, ks, strict=True))
        return tokens / model.round_ns(list(ks))

    best = max(
        rate(ks)
        for ks in itertools.product(range(k_max + 1), repeat=3)
        if all(k <= c.cap for k, c in zip(ks, candidates, strict=True))
    )
    choice = choose_ks(candidates, model, k_max)
    assert all(k <= c.cap for k, c in zip(choice.ks, candidates, strict=True))
    assert rate(tuple(choice.ks)) >= 0.97 * best


def test_policy_disables_by_batch_size_and_drafts_fully_until_timed() -> None:
    policy = SpeculationPolicy(PolicyConfig(k_max=4, disable_by_batch_size=3))
    two = [Candidate(cap=4, rates=[0.9] * 4), Candidate(cap=2, rates=[0.9] * 4)]
    assert policy.choose(two, batch_size=2) == [4, 2]  # no costs measured yet: full k
    assert policy.choose([*two, Candidate(cap=4, rates=[0.9] * 4, fixed=4)], batch_size=3) == [0, 0, 0]


def test_policy_learns_from_rounds_and_reports_gain() -> None:
    policy = SpeculationPolicy(PolicyConfig(k_max=4))
    # Target-only and speculative rounds on a machine where verification is nearly free.
    for ks in ([0], [4], [0], [4], [2]):
        tokens = 1 + sum(ks)
        verify_ns = int((20 + 0.1 * tokens) * MS)
        draft_ns = int((1 + 2 * max(ks)) * MS) if max(ks) else 0
        policy.observe_round(ks, draft_ns + verify_ns + int(0.5 * MS), draft_ns, verify_ns, 2 * max(ks) * MS, tokens)
    assert policy.costs.ready
    ks = policy.choose([Candidate(cap=4, rates=[0.9] * 4)], batch_size=1)
    assert ks == [4]
    assert policy.last_choice is not None and policy.last_choice.predicted_gain > 2.0
    gain = policy.observe_round([4], int(30 * MS), int(9 * MS), int(20.5 * MS), int(8 * MS), 5)
    assert gain == pytest.approx(5 / 30e6 / policy.last_choice.baseline_rate * 1e9)


def test_an_untimed_policy_drafts_only_in_rounds_it_can_learn_from() -> None:
    policy = SpeculationPolicy(PolicyConfig(k_max=4))
    batch = [Candidate(cap=4, rates=[0.9] * 4), Candidate(cap=4, rates=[0.9] * 4, fixed=2)]
    assert policy.choose(batch, batch_size=2) == [4, 2]  # drafts to time the services
    assert policy.choose(batch, batch_size=2, measurable=False) == [0, 2]  # a prefill round: no use


def test_a_probe_drafts_one_token_for_one_sequence_only() -> None:
    policy = SpeculationPolicy(PolicyConfig(k_max=4, probe_every=3))
    policy.costs = costs(verify_fixed_ms=20, verify_per_token_ms=20, step_ms=20)
    batch = [Candidate(cap=0, rates=[0.05] * 4)] + [Candidate(cap=4, rates=[0.05] * 4)] * 7
    picks = [policy.choose(batch, batch_size=8) for _ in range(3)]
    assert picks[:2] == [[0] * 8] * 2
    assert picks[2] == [0, 1, 0, 0, 0, 0, 0, 0]  # the first that may draft


def test_policy_probes_after_a_long_stretch_without_drafts() -> None:
    policy = SpeculationPolicy(PolicyConfig(k_max=4, probe_every=5))
    policy.costs = costs(verify_fixed_ms=20, verify_per_token_ms=20, step_ms=20)
    bad = [Candidate(cap=4, rates=[0.05] * 4)]
    picks = [policy.choose(bad, batch_size=1)[0] for _ in range(10)]
    assert picks == [0, 0, 0, 0, 1, 0, 0, 0, 0, 1]


def test_a_batch_is_drafted_for_where_the_policy_s_choice_for_a_typical_one_drafts() -> None:
    """What an auto request joining the drafter at its open goes by: the choice the policy would
    make for a batch of that size, all free to draft the full k at the acceptance seen so far."""
    policy = SpeculationPolicy(PolicyConfig(k_max=4))
    assert policy.drafts_for(32)  # untimed: the rounds draft the full k to time the services
    # Every verified token costs: drafting pays for a few sequences, not for 32.
    policy.costs = costs(verify_fixed_ms=20, verify_per_token_ms=6, step_ms=8, step_per_seq_ms=1)
    assert policy.drafts_for(1) and policy.drafts_for(2)
    assert not policy.drafts_for(4) and not policy.drafts_for(32)
    assert not policy.drafts_for(0)
    # Each pipeline's calibration counts: rounds of 2 that delivered a fifth of their promise.
    for pipeline in PIPELINES:
        policy.calibration.observe(pipeline, 20.0, 1000.0, batch=2)
    assert not policy.drafts_for(2) and policy.drafts_for(1)
    # So does the acceptance seen: drafts that are always refused stop paying at any size.
    for _ in range(50):
        policy.overall.observe(4, 0)
    assert not policy.drafts_for(1)
    assert not SpeculationPolicy(PolicyConfig(k_max=0)).drafts_for(1)
    capped = SpeculationPolicy(PolicyConfig(k_max=4, disable_by_batch_size=3))
    capped.costs = costs(verify_fixed_ms=20, verify_per_token_ms=0.1, step_ms=2)
    assert capped.drafts_for(2) and not capped.drafts_for(3)


def test_a_join_must_repay_its_cost_within_the_sequence_s_expected_output() -> None:
    policy = SpeculationPolicy(PolicyConfig(k_max=4))
    # Verify 20 ms + 1 ms per position, draft steps 4 ms: drafting 4 at acceptance 0.9 pays about 2.8x.
    policy.costs = costs(verify_fixed_ms=20, verify_per_token_ms=1, step_ms=4)
    one = [Candidate(cap=4, rates=[0.9] * 4)]
    assert policy.choose(one, batch_size=1) == [4]
    choice = policy.last_choice
    assert choice is not None and choice.predicted_gain > 2.0
    assert policy.join_pays(generated=1, left=100, prompt_tokens=50)  # untimed joins are tried
    # Target-only rounds take 21.5 ms, so 100 tokens left save about 100 * 21.5 * (1 - 1/gain) ms.
    saved_ms = 100 * 21.5 * (1 - 1 / choice.predicted_gain)
    policy.observe_join(50, (saved_ms * 1.1) * MS)  # a join dearer than that, per its 50 tokens
    assert not policy.join_pays(generated=1, left=100, prompt_tokens=50)
    assert policy.join_pays(generated=1, left=100, prompt_tokens=40)  # a shorter prompt costs less
    # Sequences are expected to emit what finished ones did: 30 tokens, so few remain to repay it.
    policy.join_ns_per_token.value = saved_ms * 0.5 * MS / 50
    assert policy.join_pays(generated=1, left=100, prompt_tokens=50)
    for _ in range(50):
        policy.observe_finished(30)
    assert not policy.join_pays(generated=1, left=100, prompt_tokens=50)
    # Nothing repays a join while drafting is not predicted to pay at all.
    policy.join_ns_per_token.value = 0.0
    policy.costs = costs(verify_fixed_ms=20, verify_per_token_ms=20, step_ms=20)
    assert policy.choose(one, batch_size=1) == [0]
    assert not policy.join_pays(generated=1, left=100, prompt_tokens=1)


def test_a_round_with_a_join_teaches_the_join_s_cost_and_not_the_verify_s() -> None:
    policy = SpeculationPolicy(PolicyConfig(k_max=4))
    policy.costs = costs(verify_fixed_ms=20, verify_per_token_ms=1, step_ms=4)
    before = policy.costs.verify.predict(1)
    # The open took 30 ms after the verify and slowed the verify beside it from 21 ms to 61 ms.
    policy.observe_round([0], int(62 * MS), 0, int(61 * MS), 0, 1, joined_tokens=10, join_ns=int(30 * MS))
    assert policy.costs.verify.predict(1) == pytest.approx(before)
    assert policy.join_ns_per_token.get() == pytest.approx((30 + 40) * MS / 10, rel=0.01)


def test_joins_that_are_not_followed_by_drafts_stop() -> None:
    policy = SpeculationPolicy(PolicyConfig(k_max=4))
    policy.costs = costs(verify_fixed_ms=20, verify_per_token_ms=1, step_ms=4)
    assert policy.choose([Candidate(cap=4, rates=[0.9] * 4)], batch_size=1) == [4]
    choice = policy.last_choice
    assert choice is not None
    saved_ms = 100 * 21.5 * (1 - 1 / choice.predicted_gain)
    policy.join_ns_per_token.value = saved_ms * 0.5 * MS / 50  # half of what a join that drafts saves
    assert policy.join_pays(generated=1, left=100, prompt_tokens=50)
    for _ in range(30):
        policy.observe_follow_through(rounds_on_drafter=20, rounds_drafting=2)  # joined, then hardly drafted
    assert not policy.join_pays(generated=1, left=100, prompt_tokens=50)
    policy.observe_follow_through(rounds_on_drafter=0, rounds_drafting=0)  # never got there: nothing learnt
    assert policy.join_follow_through.get() == pytest.approx(0.1)


def test_a_round_that_prefilled_on_the_drafter_calibrates_its_pipeline_and_teaches_no_cost() -> None:
    """The drafter prefilled a joining sequence beside the verify: the round's times are not its
    drafts' and verify's alone, so they teach no cost; but what the round delivered against
    its pipeline's model still counts, or a batch joining the drafter round after round would
    keep a choice its rounds never bear out."""
    policy = SpeculationPolicy(PolicyConfig(k_max=4))
    policy.costs = costs(verify_fixed_ms=20, verify_per_token_ms=1, step_ms=4)
    ks = policy.choose([Candidate(cap=4, rates=[0.9] * 4)], batch_size=1)
    choice = policy.last_choice
    assert choice is not None and choice.model_rate > 0 and ks == [4]
    learnt = (policy.costs.verify.predict(5), policy.costs.step.predict(1), policy.costs.overhead.get())
    factor = policy.calibration.factor(choice.pipeline)
    # Four times the round its model predicts, and one token.
    gain = policy.observe_round(ks, int(160 * MS), int(60 * MS), int(90 * MS), int(50 * MS), 1, learn_costs=False)
    assert gain is not None and gain < 0.5
    assert policy.calibration.factor(choice.pipeline) < factor
    assert (policy.costs.verify.predict(5), policy.costs.step.predict(1), policy.costs.overhead.get()) == learnt


def test_a_round_chosen_again_for_the_sequences_ready_replaces_the_first_choice() -> None:
    """Four of eight sequences are still getting ready on the drafter. The first choice offers
    them as if ready (should they get ready?); the round is then chosen again without their
    drafts, and that second choice is the one the round runs and is measured against. It must
    not teach what the first did (the predicted gain, the probe's count)."""
    policy = SpeculationPolicy(PolicyConfig(k_max=4))
    policy.costs = costs(verify_fixed_ms=20, verify_per_token_ms=1, step_ms=4)
    everyone = [Candidate(cap=4, rates=[0.9] * 4) for _ in range(8)]
    ks = policy.choose(everyone, batch_size=8, pipelines=PIPELINES)
    first = policy.last_choice
    assert first is not None and all(k > 0 for k in ks)
    gain_learnt = policy.predicted_gain.value
    ready = everyone[:4] + [Candidate(cap=0, rates=[0.9] * 4) for _ in range(4)]
    again = policy.choose(ready, batch_size=8, pipelines=PIPELINES, again=True)
    second = policy.last_choice
    assert second is not None and second.ks == again and again[4:] == [0] * 4 and all(again[:4])
    assert 0 < second.model_rate < first.model_rate
    assert second.predicted_gain != first.predicted_gain
    assert policy.predicted_gain.value == gain_learnt  # taught once, by the first choice
    # Measured against the choice it ran, a round that delivers its model's rate keeps the factor.
    round_ns = int(50 * MS)
    policy.observe_round(again, round_ns, 0, round_ns, 0, second.model_rate * round_ns / 1e9)
    assert policy.calibration.factor(second.pipeline, 8) == pytest.approx(1.0)
    # The pipeline kept against the switch margin is the last round's, not the first choice's.
    policy.last_pipeline = "sequential"
    policy.choose(everyone, batch_size=8, pipelines=PIPELINES)
    policy.choose(ready, batch_size=8, pipelines=PIPELINES, again=True)
    assert policy._previous_pipeline == "sequential"


def test_the_drafter_s_start_up_step_timings_price_batches_not_drafted_for_yet() -> None:
    """On a CPU the drafter's step grows with the batch (here 14 + 5 ms a sequence) while a verify
    of a few more positions costs little. Rounds so far drafted for one sequence only: priced from
    that, drafting for 16 looks like it pays; priced from the step the drafter timed at start-up
    for batches of 1 to 32, it does not, as with the true step it does not."""

    def model(seeded: bool) -> CostModel:
        m = CostModel()
        for n in range(1, 129):
            m.verify.observe(n, (40 + 1.5 * n) * MS)
        m.step.observe(1, 14 * MS)
        if seeded:
            m.seed_steps([(b, (14 + 5 * b) * MS) for b in (1, 2, 4, 8, 16, 32)])
        m.draft_fixed.observe(1 * MS)
        m.overhead.observe(0.5 * MS)
        return m

    batch = [Candidate(cap=4, rates=[0.9] * 4) for _ in range(16)]
    assert any(choose_ks(batch, model(seeded=False), 4).ks)
    seeded = model(seeded=True)
    assert seeded.step.predict(16) == pytest.approx(94 * MS, rel=0.1)
    assert not any(choose_ks(batch, seeded, 4).ks)
    assert any(choose_ks(batch[:1], seeded, 4).ks)  # one sequence's drafts still pay


def test_each_heuristic_switched_off_changes_what_the_policy_does(monkeypatch) -> None:
    """`--policy-off` for A/B runs: every name is a real switch, and an unknown one is refused."""
    with pytest.raises(ValueError, match="unknown policy heuristics"):
        GatewayConfig(policy_off="borrow,nope").validate()
    assert GatewayConfig(policy_off=" borrow, calibration").heuristics_off == {"borrow", "calibration"}
    on = SpeculationPolicy(PolicyConfig(k_max=4))
    assert on.overall.borrow and on.overlap.value == 1.0 and on.calibrated is on.calibration
    off = SpeculationPolicy(PolicyConfig(k_max=4, off=frozenset(HEURISTICS)))
    assert not off.overall.borrow and off.overlap.value == 0.5 and off.calibrated is None
    # Calibrated down to a fifth, drafting for two stops paying; with calibration off it still pays.
    for policy in (on, off):
        policy.costs = costs(verify_fixed_ms=20, verify_per_token_ms=6, step_ms=8, step_per_seq_ms=1)
        for pipeline in PIPELINES:
            policy.calibration.observe(pipeline, 20.0, 1000.0, batch=2)
    assert not on.drafts_for(2) and off.drafts_for(2)
    # The switching margin reaches the round's choice as 0.
    margins = []
    real = speculation.choose_round
    monkeypatch.setattr(speculation, "choose_round", lambda *a, **kw: margins.append(a[6]) or real(*a, **kw))
    one = [Candidate(cap=4, rates=[0.9] * 4)]
    for policy in (on, off):
        policy.choose(one, batch_size=1, pipelines=PIPELINES)
    assert margins == [on.config.switch_margin, 0.0] and on.config.switch_margin > 0
    # A join that costs more than it saves is refused, unless join-cost is off.
    for policy in (on, off):
        policy.costs = costs(verify_fixed_ms=20, verify_per_token_ms=20, step_ms=20)
        policy.choose(one, batch_size=1)
        policy.observe_join(50, 1e12)
    assert not on.join_pays(generated=1, left=100, prompt_tokens=50)
    assert off.join_pays(generated=1, left=100, prompt_tokens=50)


def timed_policy(verify_ms_per_position: float) -> SpeculationPolicy:
    """A policy that has timed both services: a 20 ms verify plus this much per position checked."""
    policy = SpeculationPolicy(PolicyConfig(k_max=4))
    for ks in ([0], [4], [0], [4], [2], [6]):
        positions = 1 + max(ks)
        verify_ns = int((20 + verify_ms_per_position * positions) * MS)
        draft_ns = int((1 + 2 * max(ks)) * MS) if max(ks) else 0
        policy.observe_round(ks, draft_ns + verify_ns, draft_ns, verify_ns, 2 * max(ks) * MS, 1 + max(ks))
    return policy


@pytest.mark.parametrize(("per_position_ms", "hits", "want"), [(0.1, 0.3, 2), (8.0, 0.3, 0), (0.1, 0.0, 0)])
def test_siblings_are_added_where_their_hits_pay_for_the_wider_verify(
    per_position_ms: float, hits: float, want: int
) -> None:
    policy = timed_policy(per_position_ms)
    ks = policy.choose([Candidate(cap=4, rates=[0.8] * 4)], batch_size=1)
    assert ks[0] > 0
    for i in range(400):  # the hit rate measured: `hits` of the siblings sent ended the path
        policy.observe_siblings(1, i % 100 < hits * 100)
    assert policy.siblings(ks, most=2) == want


def test_siblings_are_sent_as_asked_until_timed_and_never_without_drafts() -> None:
    policy = SpeculationPolicy(PolicyConfig(k_max=4))
    assert policy.siblings([4, 0], most=2) == 2  # untimed: the verify's width gets measured
    assert policy.siblings([0, 0], most=2) == 0
    assert policy.siblings([4], most=0) == 0
    policy.observe_siblings(3, True)  # one hit of three siblings sent
    assert policy.sibling_hits.value(0.0) == pytest.approx(1 / (3 + 2), rel=0.01)  # two prior weights


def test_the_verdicts_other_than_the_main_block_s_are_all_the_rest() -> None:
    others = other_verdicts([0.9, 0.5], 2, 0.6)
    # Rejected at the first draft, at the second, then both accepted with the guess wrong.
    assert others == pytest.approx([0.1, 0.45, 0.45 * 0.4])
    assert sum(others) + 0.9 * 0.5 * 0.6 == pytest.approx(1.0)
    seq = Ahead(2, [0.9, 0.5], 0.6)
    assert stands_with(seq, 0.5, 0) == pytest.approx(0.27)
    # The likeliest other verdict first (a rejection at the second draft), at the branch hit rate.
    assert stands_with(seq, 0.5, 1) == pytest.approx(0.27 + 0.5 * 0.45)
    assert stands_with(seq, 1.0, 3) == pytest.approx(1.0)


def branch_policy(step_per_seq_ms: float) -> SpeculationPolicy:
    """Timed services: a 20 ms verify plus 1 ms a position, a 1 ms draft step plus this much a row."""
    policy = SpeculationPolicy(PolicyConfig(k_max=4))
    policy.costs = costs(verify_fixed_ms=20, verify_per_token_ms=1, step_ms=1, step_per_seq_ms=step_per_seq_ms)
    return policy


@pytest.mark.parametrize(
    ("step_per_seq_ms", "hits", "want"), [(0.05, 0.5, 2), (2.0, 0.5, 1), (10.0, 0.5, 0), (2.0, 0.0, 0)]
)
def test_branches_are_drafted_where_the_drafts_they_save_pay_for_the_wider_ahead_exchange(
    step_per_seq_ms: float, hits: float, want: int
) -> None:
    """Rows hidden behind the verify are free; rows that outlast it are paid for by the pre-verify
    drafts the branches' hits save, or not."""
    policy = branch_policy(step_per_seq_ms)
    for i in range(400):  # the hit rate measured: `hits` of the branches whose verdict came
        policy.observe_branch(i % 100 < hits * 100)
    assert policy.branches([4], [Ahead(4, [0.8] * 4, 0.5)], most=2) == want


def test_branches_are_asked_as_named_until_timed_and_never_without_a_draft_ahead() -> None:
    policy = SpeculationPolicy(PolicyConfig(k_max=4))
    ahead = [Ahead(4, [0.8] * 4, 0.5)]
    assert policy.branches([4], ahead, most=2) == 2  # untimed: the wider exchange gets measured
    assert policy.branches([4], [], most=2) == 0
    assert policy.branches([4], ahead, most=0) == 0
    policy.observe_branch(True)
    assert policy.branch_hits.value(0.0) == pytest.approx(1 / (1 + 2))  # two prior weights


def test_a_size_costs_what_it_was_last_seen_to_cost_after_each_observation() -> None:
    """Predictions are kept between observations: each observation moves them."""
    cost = SizedCost()
    cost.observe(4, 10 * MS)
    assert cost.predict(4) == pytest.approx(10 * MS)
    cost.observe(4, 30 * MS)
    assert cost.predict(4) > 10 * MS
    before = cost.predict(9)
    cost.observe(9, 90 * MS)
    assert cost.predict(9) != pytest.approx(before) and cost.predict(4) != pytest.approx(before)
