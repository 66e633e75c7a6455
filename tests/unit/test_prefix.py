"""common_prefix against the plain loop it replaces."""

from __future__ import annotations

import random

import pytest

from specd.engine.prefix import common_prefix


def loop(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_common_prefix_is_the_loop_s_wherever_the_lists_part():
    rng = random.Random(3)
    for _ in range(2000):
        a = [rng.randrange(4) for _ in range(rng.randrange(0, 300))]
        b = list(a[: rng.randrange(0, len(a) + 1)])
        b += [rng.randrange(4) for _ in range(rng.randrange(0, 40))]  # parts anywhere, or never
        assert common_prefix(a, b) == loop(a, b) == common_prefix(b, a)


@pytest.mark.parametrize(
    ("a", "b", "want"),
    [([], [], 0), ([1], [], 0), ([1, 2, 3], [1, 2, 3], 3), ([1, 2, 3], (1, 2, 9), 2), (list(range(50)), [0], 1)],
)
def test_common_prefix_edges(a, b, want):
    assert common_prefix(a, b) == want
