"""The accepted range of every request parameter: one definition for every API and service.

The gateway's HTTP and gRPC APIs check requests against this table (gateway.api.validation)
and the engines check what reaches them against the same bounds, so a value is refused
everywhere or nowhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class Range:
    """A closed or half-open numeric interval; `integer` refuses non-integral numbers."""

    low: float
    high: float
    integer: bool = False
    low_open: bool = False
    # Human-readable meaning of the bounds, appended to the refusal.
    note: str = ""

    def problem(self, name: str, value: object) -> str | None:
        """Why `value` is not acceptable for `name`, or None."""
        if isinstance(value, bool) or not isinstance(value, int | float):
            return f"{name} must be {'an integer' if self.integer else 'a number'}, got {value!r}"
        if self.integer and not isinstance(value, int):
            return f"{name} must be an integer, got {value!r}"
        if isinstance(value, float) and not math.isfinite(value):
            return f"{name} must be a finite number, got {value!r}"
        below = value <= self.low if self.low_open else value < self.low
        if below or value > self.high:
            return f"{name} must be in {self.describe()}, got {value!r}{self.note}"
        return None

    def describe(self) -> str:
        def fmt(x: float) -> str:
            return str(int(x)) if self.integer or float(x).is_integer() else f"{x:g}"

        return f"{'(' if self.low_open else '['}{fmt(self.low)}, {fmt(self.high)}]"


# Each parameter's range. Where OpenAI documents one, it is OpenAI's; temperature's
# ceiling is generous (OpenAI stops at 2) but finite, so Infinity and 1e300 are
# refused rather than turned into a uniform distribution or a float32 overflow.
RANGES: dict[str, Range] = {
    "max_tokens": Range(1, INT32_MAX, integer=True),
    "temperature": Range(0.0, 100.0),
    "top_p": Range(0.0, 1.0, low_open=True),
    "top_k": Range(-1, INT32_MAX, integer=True, note=" (0 and -1 disable it)"),
    "min_p": Range(0.0, 1.0),
    "seed": Range(0, 2**64 - 1, integer=True),
    "presence_penalty": Range(-2.0, 2.0),
    "frequency_penalty": Range(-2.0, 2.0),
    "repetition_penalty": Range(0.0, 100.0, low_open=True),
    "logit_bias": Range(-100.0, 100.0),
    # Chat's top_logprobs, and the gRPC API's.
    "top_logprobs": Range(0, 20, integer=True),
    # Completions' logprobs: the number of alternatives, as in OpenAI's legacy API.
    "completion_logprobs": Range(0, 5, integer=True),
    # Bounded above by the gateway's --max-n (gateway.api.validation.choices).
    "n": Range(1, INT32_MAX, integer=True),
    "best_of": Range(1, INT32_MAX, integer=True),
}
MAX_STOP_SEQUENCES = 4
# OpenAI caps logit_bias at 300 entries; more is refused rather than silently cut.
MAX_LOGIT_BIAS_ENTRIES = 300
# A guided_choice is compiled into one grammar at admission: bounded, so that compiling it is quick
# and stays inside the grammar engine's limits.
MAX_GUIDED_CHOICES = 1024
MAX_GUIDED_CHOICE_CHARS = 65536
# Messages of one chat request, counted before each is validated (the context window bounds them too).
MAX_MESSAGES = 8192
