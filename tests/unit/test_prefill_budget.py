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


def test_chunks_settle_where_the_whole_exchange_takes_one_verify():
    """A drafter whose exchange costs a fixed 50 ms plus 5.5 ms a prompt token, behind 100 ms
    verifies: the chunk that fits is (100 - 50) / 5.5 = 9 tokens, though a 32-token first chunk
    reads 7.1 ms a token (14 tokens). It settles there from above, and from below after a slow
    start (a loaded machine's first measurement), because small chunks are measured too."""

    def run(budget: DrafterPrefillBudget, rounds: int) -> int:
        for _ in range(rounds):
            n = budget.tokens()
            budget.observe_verify(100 * MS)
            budget.observe_prefill(n, (50 + 5.5 * n) * MS)
        return budget.tokens()

    assert 8 <= run(DrafterPrefillBudget(0), 30) <= 10
    slow_start = DrafterPrefillBudget(0)
    slow_start.observe_verify(100 * MS)
    slow_start.observe_prefill(32, 3200 * MS)  # 100 ms a token while something else ran
    assert slow_start.tokens() == MIN_CHUNK
    assert 8 <= run(slow_start, 30) <= 10
    for _ in range(40):
        n = slow_start.tokens()
        slow_start.observe_verify(300 * MS)  # verifies got longer (more clients): more fits
        slow_start.observe_prefill(n, (50 + 5.5 * n) * MS)
    assert 40 <= slow_start.tokens() <= 46  # (300 - 50) / 5.5 = 45
