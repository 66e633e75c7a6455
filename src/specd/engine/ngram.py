"""Model-free prompt-lookup proposals: continue the latest earlier match of the suffix."""

from __future__ import annotations

from collections.abc import Sequence


def propose(tokens: Sequence[int], k: int, min_n: int = 1, max_n: int = 4) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the
    longest suffix n-gram (n from max_n down to min_n); [] when none matches."""
    if min_n < 1:
        raise ValueError(f"min_n must be >= 1, got {min_n}")
    length = len(tokens)
    if k <= 0:
        return []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = list(tokens[length - n :])
        first = suffix[0]
        # Scan backwards so the most recent match wins: recent context predicts best.
        for start in range(length - n - 1, -1, -1):
            if tokens[start] == first and list(tokens[start : start + n]) == suffix:
                follow = tokens[start + n : start + n + k]
                if follow:
                    return list(follow)
    return []
