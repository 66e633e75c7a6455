"""The common prefix of two token lists, compared in C."""

from __future__ import annotations

from collections.abc import Sequence

# Below this many tokens the search steps one token at a time.
_STEP = 8


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share.

    Every round each sequence's cache, grammar and kept state is checked against its context,
    thousands of tokens that usually differ, if at all, near the end: slices compare in C, a
    whole prefix at once and then halving toward the first difference, where a Python loop
    would visit every token."""
    # Slices of a list and a tuple never compare equal: both as lists (a list is not copied).
    a = a if isinstance(a, list) else list(a)
    b = b if isinstance(b, list) else list(b)
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    # a[:lo] == b[:lo] and a[:hi] != b[:hi] throughout.
    while hi - lo > _STEP:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    while a[lo] == b[lo]:
        lo += 1
    return lo
