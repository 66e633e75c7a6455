"""Stop strings' hold-back: the tail that could still become a stop string, found in linear time."""

from __future__ import annotations

import random
import time

from gateway.round.detokenize import TextStream


class Chars:
    """Token i is the character chr(97 + i)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(97 + i) for i in ids)


def naive_held_back(text: str, stops: list[str]) -> int:
    return max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)


def test_the_hold_back_is_the_longest_tail_that_begins_a_stop_string() -> None:
    rng = random.Random(7)
    for _ in range(300):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 3))]
        stream = TextStream(Chars(), stops)
        for _ in range(rng.randint(1, 30)):
            stream.add(rng.randint(0, 2))
            if stream.stopped:
                assert any(s in "".join(Chars().decode(stream.ids)) for s in stops)
                break
            assert stream._held_back() == naive_held_back(stream.text, stops), (stream.text, stops)


def test_long_stop_strings_cost_each_token_little() -> None:
    # No tail of the output begins any of them: every candidate length must be ruled out.
    stops = ["b" * 4000 + "c", "bc" * 2000, "bd" * 2000, "be" * 2000]
    stream = TextStream(Chars(), stops)
    start = time.perf_counter()
    for _ in range(2000):
        stream.add(0)
        stream.take()
    per_token_ms = (time.perf_counter() - start) / 2000 * 1e3
    assert not stream.stopped and len(stream.text) == 2000
    assert per_token_ms < 0.2, per_token_ms  # the quadratic scan took milliseconds a token here
