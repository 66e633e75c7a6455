"""The drafter's prefill budget: what it can prefill behind one verify."""

from __future__ import annotations

from gateway.prefill_budget import FIRST_CHUNK, MIN_CHUNK, DrafterPrefillBudget

MS = 1e6


def test_before_any_measurement_a_small_first_chunk():
    assert DrafterPrefillBudget(512).tokens() == FIRST_CHUNK
    assert DrafterPrefillBudget(16).tokens() == 16  # never above --prefill-chunk-tokens


def test_a_slow_drafter_prefills_what_fits_behind_a_verify():
    budget = DrafterPrefillBudget(512)
    budget.observe_verify(200 * MS)
    budget.observe_prefill(512, 2200 * MS)  # an int8 copy: ~4.3 ms a prompt token
    assert 40 <= budget.tokens() <= 50
    fast = DrafterPrefillBudget(512)
    fast.observe_verify(200 * MS)
    fast.observe_prefill(64, 20 * MS)  # 0.3 ms a token: the whole --prefill-chunk-tokens fits
    assert fast.tokens() == 512


def test_a_very_slow_drafter_still_makes_progress_and_few_token_exchanges_are_not_costs():
    budget = DrafterPrefillBudget(512)
    budget.observe_verify(10 * MS)
    budget.observe_prefill(100, 10_000 * MS)
    assert budget.tokens() == MIN_CHUNK
    before = budget.tokens()
    budget.observe_prefill(2, 50 * MS)  # a short prompt's open: mostly fixed cost, not measured
    assert budget.tokens() == before


def test_without_a_chunk_cap_the_drafter_still_prefills_only_what_fits_behind_a_verify():
    """Whole-prompt prefill on the verifier (--prefill-chunk-tokens 0) leaves the drafter chunked by time."""
    budget = DrafterPrefillBudget(0)
    assert budget.tokens() == FIRST_CHUNK
    budget.observe_verify(200 * MS)
    budget.observe_prefill(512, 2200 * MS)
    assert 40 <= budget.tokens() <= 50
