"""The drafter's prefill budget: what it can prefill behind one verify."""

from __future__ import annotations

from gateway.round.prefill_budget import FIRST_CHUNK, MIN_CHUNK, DrafterPrefillBudget

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


def test_drafts_beside_the_verify_leave_the_prefill_only_what_is_left_of_it():
    budget = DrafterPrefillBudget(512)
    budget.observe_verify(200 * MS)
    budget.observe_prefill(32, (50 + 32) * MS)
    budget.observe_prefill(64, (50 + 64) * MS)  # 50 ms an exchange, 1 ms a token
    assert budget.tokens(busy_ns=0) == 150
    # 80 ms left: (80 - 50) / 1 by the fit, but never below what the mean (2 ms a token) fits.
    assert budget.tokens(busy_ns=120 * MS) == 39
    # Drafts outlast the verify: every chunk stalls the round by its 50 ms fixed cost at least, so a
    # chunk may take twice that (50 tokens), not the minimum, which would make 6 times as many rounds pay it.
    assert budget.tokens(busy_ns=250 * MS) == 50


def test_a_very_slow_drafter_still_makes_progress():
    budget = DrafterPrefillBudget(512)
    budget.observe_verify(10 * MS)
    budget.observe_prefill(100, 10_000 * MS)
    assert budget.tokens() == MIN_CHUNK


def test_the_exchange_fixed_cost_is_not_charged_per_token():
    budget = DrafterPrefillBudget(512)
    budget.observe_verify(200 * MS)
    budget.observe_prefill(32, (50 + 32) * MS)  # 50 ms an exchange, 1 ms a token
    # One size seen: no slope yet, so every token is charged the mean, fixed cost included.
    assert budget.tokens() == int(200 / (82 / 32))
    budget.observe_prefill(64, (50 + 64) * MS)
    assert budget.tokens() == 150  # (200 - 50) / 1


def test_an_exchange_dearer_than_a_verify_still_prefills_a_fair_chunk():
    """A fixed cost above the verify's time is paid whatever the chunk: the budget is the mean's,
    not the minimum, which would only make more rounds pay it."""
    budget = DrafterPrefillBudget(0)
    budget.observe_verify(3 * MS)
    budget.observe_prefill(32, (4 + 32 * 0.01) * MS)
    budget.observe_prefill(16, (4 + 16 * 0.01) * MS)
    assert budget.tokens() >= 16


def test_a_flat_slope_from_chunks_of_nearly_one_size_grows_the_budget_a_step_at_a_time():
    budget = DrafterPrefillBudget(0)
    budget.observe_verify(200 * MS)
    budget.observe_prefill(40, 100 * MS)
    budget.observe_prefill(41, 100.01 * MS)  # noise: a slope of 0.01 ms a token
    # The slope alone would allow (200 - 100) / 0.01 = 10,000; twice what the mean (2.5 ms a token) fits is 160.
    assert 150 <= budget.tokens() <= 170


def test_the_budget_keeps_following_a_drafter_whose_chunks_are_small():
    """Chunks of any size are measured: a drafter that slows down after its budget fell below the
    first chunk's size gets a smaller budget, not the one its first chunk measured."""
    budget = DrafterPrefillBudget(512)
    budget.observe_verify(40 * MS)
    budget.observe_prefill(FIRST_CHUNK, 2 * FIRST_CHUNK * MS)  # 2 ms a token: 20 fit
    assert budget.tokens() == 20
    for _ in range(30):
        n = budget.tokens()
        budget.observe_prefill(n, 4 * n * MS)  # now 4 ms a token
    assert budget.tokens() == 10


def test_without_a_chunk_cap_the_drafter_still_prefills_only_what_fits_behind_a_verify():
    """Whole-prompt prefill on the verifier (--prefill-chunk-tokens 0) leaves the drafter chunked by time."""
    budget = DrafterPrefillBudget(0)
    assert budget.tokens() == FIRST_CHUNK
    budget.observe_verify(200 * MS)
    budget.observe_prefill(512, 2200 * MS)
    assert 40 <= budget.tokens() <= 50


def test_beside_the_verifiers_open_the_drafter_prefills_what_fits_in_it():
    budget = DrafterPrefillBudget(512)
    assert budget.fits_beside_open(100) == 0  # nothing timed: no sequence joins at its open
    budget.observe_open(100, 300 * MS)
    assert budget.fits_beside_open(100) == 0  # the drafter's prefill not timed yet
    budget.observe_prefill(40, 100 * MS)  # 2.5 ms a token, fixed cost included
    assert budget.fits_beside_open(100) == 120  # a 300 ms open fits 120 of the drafter's tokens
    assert budget.fits_beside_open(10) == 12
    slow = DrafterPrefillBudget(512)
    slow.observe_open(100, 300 * MS)
    slow.observe_prefill(8, 2000 * MS)  # a drafter whose prefill costs seconds whatever its size
    assert slow.fits_beside_open(100) == 0


def test_a_fixed_cost_above_the_verify_grows_the_chunks_to_twice_it_not_down_to_the_minimum():
    """Shaped as a GPU stack traced (an H200, MPS): a 4 ms verify, the drafter's eager prefill 14 ms
    whatever its length (0.01 ms a token). Chunks sized to the verify fell to the minimum and stayed
    there, each stalling its round by 10 ms; they now double until twice the fixed cost."""
    budget = DrafterPrefillBudget(0)
    sizes = []
    for _ in range(40):
        n = budget.tokens()
        sizes.append(n)
        budget.observe_verify(4 * MS)
        budget.observe_prefill(n, (14 + 0.01 * n) * MS)
    assert sizes[0] == FIRST_CHUNK and min(sizes) >= MIN_CHUNK
    assert all(n <= 2 * max(sizes[:i]) for i, n in enumerate(sizes) if i)  # never past twice those measured
    assert sizes[3] > FIRST_CHUNK and sorted(sizes[1:]) == sizes[1:]  # growing from the second chunk on
    assert sizes[-1] == 1400  # 14 ms / 0.01 ms: a chunk of 28 ms


def test_a_drafter_slow_per_token_is_still_sized_to_the_verify():
    """Where the per-token cost dominates (a CPU), chunks stay what fits behind the verify."""
    budget = DrafterPrefillBudget(0)
    for _ in range(12):
        n = budget.tokens()
        budget.observe_verify(40 * MS)
        budget.observe_prefill(n, (2 + 1.5 * n) * MS)
    assert 20 <= budget.tokens() <= 26  # (40 - 2) / 1.5 = 25
