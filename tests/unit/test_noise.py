"""The counter-based noise behind seeded sampling, and Gumbel-max sampling from it."""

from __future__ import annotations

import random

import pytest
import torch
from scipy import stats

from specd.engine import noise
from specd.engine.sampling import gumbel_argmax, position_keys, spans_keys

MIN_P_VALUE = 1e-3
CPU = torch.device("cpu")


def reference_lowbias32(x: int) -> int:
    """Wellons' lowbias32 in plain Python integers, the definition the tensor version must match."""
    m = 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & m
    x ^= x >> 15
    x = (x * 0x846CA68B) & m
    return x ^ (x >> 16)


def test_tensor_hash_matches_the_reference_definition():
    # Inputs near 2**32 exercise the overflow-free multiply.
    rng = random.Random(0)
    keys = [rng.randrange(2**32) for _ in range(2000)] + [0, 2**32 - 1, 2**31, 2**31 - 1]
    tokens = [rng.randrange(2**20) for _ in range(len(keys) - 4)] + [0, 2**20, 49151, 2**32 - 1]
    got = noise.hash32(torch.tensor(keys), torch.tensor(tokens)).tolist()
    expected = [reference_lowbias32(k ^ reference_lowbias32(t)) for k, t in zip(keys, tokens, strict=True)]
    assert got == expected


def reference_lowbias32_inverse(y: int) -> int:
    """The hash's inverse (it is a bijection): the input that hashes to `y`."""
    m = 0xFFFFFFFF
    y ^= y >> 16
    y = (y * pow(0x846CA68B, -1, 2**32)) & m
    y ^= (y >> 15) ^ (y >> 30)
    y = (y * pow(0x7FEB352D, -1, 2**32)) & m
    return y ^ (y >> 16)


@pytest.mark.parametrize("top", [2**32 - 1, 2**32 - 2**8, 2**31 + 2**8 + 1, 0])
def test_noise_is_finite_and_bounded_at_every_hash(top: int):
    # The largest 24-bit value's uniform rounded to 1.0 in float32, so its Gumbel noise was
    # infinite and that token won whatever its probability (about one row in 340 of a 49,152-token
    # vocabulary). The pair (key 0, a token hash whose hash32 is `top`) reaches each value.
    hashed = reference_lowbias32_inverse(top)
    assert reference_lowbias32(hashed) == top
    g = noise.gumbel_of(torch.tensor([0]), torch.tensor([hashed]))
    assert torch.isfinite(g).all() and float(g) <= noise.GUMBEL_MAX
    if top >= 2**32 - 2**8:
        assert float(g) > noise.GUMBEL_MAX - 0.01  # the bound is tight: the largest hash reaches it


def test_known_values_do_not_change():
    # Every seeded output depends on these: a change here changes what every
    # seed produces, which must be a deliberate, documented decision.
    assert [noise.noise_key(s, p) for s, p in [(0, 0), (1, 0), (0, 1), (2**64 - 1, 7), (12345, 1000)]] == [
        595752380,
        2978611956,
        1155905921,
        570180815,
        4093654062,
    ]
    assert noise.hash32(torch.tensor([0, 1, 2**32 - 1]), torch.tensor([0, 5, 49151])).tolist() == [
        0,
        3631679695,
        1569895100,
    ]


def test_seeds_are_taken_modulo_2_to_the_64():
    assert noise.noise_key(-1, 5) == noise.noise_key(2**64 - 1, 5)
    assert noise.noise_key(2**64 + 3, 5) == noise.noise_key(3, 5)


def test_noise_key_separates_seed_position_and_stream():
    keys = {noise.noise_key(s, p, st) for s in range(20) for p in range(50) for st in range(3)}
    assert len(keys) == 20 * 50 * 3
    assert all(0 <= k < 2**32 for k in keys)


def test_broadcast_equals_elementwise():
    keys = torch.tensor([noise.noise_key(9, p) for p in range(4)])
    tokens = torch.arange(100)
    grid = noise.gumbel(keys[:, None], tokens[None, :])
    flat = noise.gumbel(keys.repeat_interleave(100), tokens.repeat(4)).view(4, 100)
    assert torch.equal(grid, flat)


def test_uniforms_are_uniform_across_tokens_and_across_keys():
    tokens = torch.arange(100_000)
    across_tokens = noise.uniform(torch.tensor(noise.noise_key(1, 2)), tokens)
    keys = torch.tensor([noise.noise_key(s, 0) for s in range(100_000)])
    across_keys = noise.uniform(keys, torch.tensor(17))
    for u in (across_tokens, across_keys):
        assert float(u.min()) > 0.0 and float(u.max()) < 1.0
        counts = torch.histc(u, bins=64, min=0.0, max=1.0)
        assert stats.chisquare(counts.tolist()).pvalue > MIN_P_VALUE


# p has impossible tokens (top-k / top-p cut them) and one rare one.
P = torch.tensor([0.40, 0.0, 0.25, 0.20, 0.10, 0.0, 0.05])
SEEDS = 20_000


def argmax_at(seeds: range, position: int, p: torch.Tensor) -> list[int]:
    keys = torch.tensor([noise.noise_key(s, position) for s in seeds])
    return gumbel_argmax(p.expand(len(seeds), -1).contiguous(), keys).tolist()


def chi_square_p(observed: list[float], expected: list[float]) -> float:
    # float32 probabilities do not sum to exactly 1: rescale to the observed total.
    scale = sum(observed) / sum(expected)
    return float(stats.chisquare(observed, [e * scale for e in expected]).pvalue)


@pytest.mark.parametrize("position", [0, 1, 977])
def test_gumbel_argmax_samples_p_across_seeds(position: int):
    tokens = argmax_at(range(SEEDS), position, P)
    counts = [tokens.count(t) for t in range(len(P))]
    assert counts[1] == counts[5] == 0
    support = [t for t in range(len(P)) if P[t] > 0]
    assert chi_square_p([counts[t] for t in support], [float(P[t]) * SEEDS for t in support]) > MIN_P_VALUE


def test_gumbel_argmax_samples_p_along_one_sequence():
    keys = position_keys(31337, 0, SEEDS, CPU)
    tokens = gumbel_argmax(P.expand(SEEDS, -1).contiguous(), keys).tolist()
    support = [t for t in range(len(P)) if P[t] > 0]
    counts = [tokens.count(t) for t in support]
    assert chi_square_p(counts, [float(P[t]) * SEEDS for t in support]) > MIN_P_VALUE


def joint_p_value(first: list[int], second: list[int]) -> float:
    """Chi-square of the joint counts against the product of P with itself (independence and marginals)."""
    support = [t for t in range(len(P)) if P[t] > 0]
    pairs = list(zip(first, second, strict=True))
    observed = [pairs.count((a, b)) for a in support for b in support]
    expected = [float(P[a] * P[b]) * len(pairs) for a in support for b in support]
    return chi_square_p(observed, expected)


def test_consecutive_positions_of_one_seed_are_independent():
    # The bug this replaces: the drafter's stream lagged the verifier's by one
    # draw, so neighbouring draws were coupled. Keyed noise has no stream to lag.
    first = argmax_at(range(SEEDS), 5, P)
    second = argmax_at(range(SEEDS), 6, P)
    assert joint_p_value(first, second) > MIN_P_VALUE


def test_consecutive_seeds_at_one_position_are_independent():
    first = argmax_at(range(0, 2 * SEEDS, 2), 3, P)
    second = argmax_at(range(1, 2 * SEEDS, 2), 3, P)
    assert joint_p_value(first, second) > MIN_P_VALUE


def test_the_joint_test_detects_dependent_draws():
    # The independence tests above can fail: the same noise at both positions is caught.
    same = argmax_at(range(SEEDS), 5, P)
    assert joint_p_value(same, same) < 1e-100


def test_gumbel_argmax_sparse_and_dense_paths_agree():
    gen = torch.Generator().manual_seed(4)
    probs = torch.softmax(torch.randn(6, 300, generator=gen) * 2, dim=-1)
    keys = position_keys(5, 40, 6, CPU)
    dense = gumbel_argmax(probs, keys)
    # A cut that keeps each row's winner leaves the winner unchanged.
    cut = probs.clone()
    cut[probs < probs.gather(1, dense[:, None]) / 4] = 0.0
    assert bool((cut == 0).any())
    assert torch.equal(gumbel_argmax(cut, keys), dense)


def brute_force_gumbel_argmax(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The definition: the noise at every token of every row, one row at a time."""
    tokens = torch.arange(probs.shape[-1])
    return torch.stack([(row.log() + noise.gumbel(key, tokens)).argmax() for row, key in zip(probs, keys, strict=True)])


@pytest.mark.parametrize("temperature", [0.3, 1.0, 3.0, 30.0])
def test_gumbel_argmax_hashes_only_what_can_win_and_picks_what_the_definition_picks(temperature: float):
    gen = torch.Generator().manual_seed(int(temperature * 10))
    logits = torch.randn(400, 2000, generator=gen) * 4
    logits[::7, 100:] = -torch.inf  # rows with a cut support
    logits[::11, 3] = logits[::11, 5] = 50.0  # rows with a tie at the top
    probs = torch.softmax(logits / temperature, dim=-1)
    keys = position_keys(9, 0, probs.shape[0], CPU)
    assert torch.equal(gumbel_argmax(probs, keys), brute_force_gumbel_argmax(probs, keys))


def test_gumbel_argmax_of_a_one_hot_row_is_its_token():
    probs = torch.zeros(3, 50)
    probs[0, 7] = probs[1, 0] = probs[2, 49] = 1.0
    assert gumbel_argmax(probs, position_keys(1, 0, 3, CPU)).tolist() == [7, 0, 49]


def test_spans_keys_are_each_spans_position_keys_in_order():
    spans = [(5, 40, 3), (9, 0, 1), (5, 43, 2)]
    expected = torch.cat([position_keys(seed, start, count, CPU) for seed, start, count in spans])
    assert torch.equal(spans_keys(spans, CPU), expected)
    # The same seed and position give the same key wherever the span starts (5 at 42, twice).
    assert spans_keys(spans, CPU)[2] == spans_keys([(5, 42, 1)], CPU)[0]
