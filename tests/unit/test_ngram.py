from __future__ import annotations

import pytest

from specd.engine.ngram import propose


@pytest.mark.parametrize(
    ("tokens", "k", "kwargs", "expected"),
    [
        # The suffix bigram [1, 2] occurred at the start: continue from there.
        ([1, 2, 3, 1, 2], 3, {}, [3, 1, 2]),
        # Most recent earlier match wins: [1, 2] was followed by 9, then later by 8.
        ([1, 2, 9, 1, 2, 8, 1, 2], 1, {}, [8]),
        ([1, 2, 9, 1, 2, 8, 1, 2], 2, {}, [8, 1]),
        # Longest n first: the trigram [5, 1, 2] beats the more recent unigram [2].
        ([5, 1, 2, 7, 9, 2, 6, 5, 1, 2], 2, {}, [7, 9]),
        # ... unless max_n excludes it.
        ([5, 1, 2, 7, 9, 2, 6, 5, 1, 2], 2, {"max_n": 1}, [6, 5]),
        ([5, 1, 2, 7, 9, 2, 6, 5, 1, 2], 2, {"max_n": 2}, [7, 9]),
        # No earlier occurrence of any suffix.
        ([1, 2, 3, 4], 3, {}, []),
        ([4, 4, 1, 2, 3], 2, {}, []),
        # min_n excludes a unigram-only match.
        ([3, 8, 5, 3], 2, {}, [8, 5]),
        ([3, 8, 5, 3], 2, {"min_n": 2}, []),
        # k caps the output; the sequence end caps it too.
        ([1, 2, 3, 4, 5, 6, 1], 3, {}, [2, 3, 4]),
        ([1, 2, 3, 4, 5, 6, 1], 10, {}, [2, 3, 4, 5, 6, 1]),
        ([1, 2, 3, 1, 2], 10, {}, [3, 1, 2]),
        ([1, 2, 3, 1, 2], 1, {}, [3]),
        # Overlapping matches.
        ([7, 7, 7], 3, {}, [7]),
        ([7, 7, 7, 7], 5, {}, [7]),
        ([1, 2, 1, 2, 1], 4, {}, [2, 1]),
        # Too short to have an earlier occurrence; nothing asked for.
        ([], 3, {}, []),
        ([5], 3, {}, []),
        ([1, 2, 3, 1, 2], 0, {}, []),
        ([1, 2, 3, 1, 2], -1, {}, []),
    ],
)
def test_propose(tokens, k, kwargs, expected):
    assert propose(tokens, k, **kwargs) == expected


def test_propose_accepts_any_sequence_and_returns_a_new_list():
    tokens = (1, 2, 3, 1, 2)
    out = propose(tokens, 2)
    assert out == [3, 1]
    assert isinstance(out, list)
    source = [1, 2, 3, 1, 2]
    out = propose(source, 2)
    out.append(99)
    assert source == [1, 2, 3, 1, 2]


def test_propose_longest_match_is_at_most_max_n():
    # A 6-gram repeats, but with max_n=4 the 4-gram suffix decides; its most recent
    # earlier occurrence is the start of the sequence either way.
    tokens = [1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 5, 6]
    assert propose(tokens, 3) == [0, 1, 2]
    assert propose(tokens, 3, max_n=6) == [0, 1, 2]
