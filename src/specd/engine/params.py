"""What a request asks of the models, as plain data: sampling, penalties and logprobs.

No tensors here: the gateway builds and validates these (and must not import torch); the
services apply them to logits with specd.engine.sampling, specd.engine.logits and specd.engine.logprobs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from specd.engine.ranges import MAX_LOGIT_BIAS_ENTRIES, RANGES

# Temperatures below this are treated as greedy (as vLLM does): dividing float32
# logits by a tinier one overflows to inf and the softmax to NaN.
GREEDY_BELOW_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    # Drop tokens less likely than min_p times the most likely one (after top-k and top-p); 0 disables it.
    min_p: float = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def seeded(self) -> bool:
        """Sampled with a seed: drawn with counter-based noise and verified by the Gumbel-max coupling."""
        return not self.greedy and self.seed is not None


def validate_sampling(params: SamplingParams) -> str | None:
    """Return why `params` are invalid, or None."""
    # The gateway's table (specd.engine.ranges): a value is refused on every side or on none.
    for name in ("temperature", "top_p", "min_p"):
        if problem := RANGES[name].problem(name, getattr(params, name)):
            return problem
    if params.top_k < 0:  # 0 here is the gateway's "off" (it maps -1 to 0)
        return f"top_k must be >= 0, got {params.top_k}"
    return None


@dataclass(frozen=True)
class Penalties:
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    # (token id, bias) pairs, sorted by id, so the dataclass stays hashable and comparable.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # vLLM's min_tokens: `eos` (every end-of-sequence id the gateway stops on) is suppressed at
    # output positions before `min_tokens`.
    min_tokens: int = 0
    eos: tuple[int, ...] = ()

    @property
    def active(self) -> bool:
        suppress = self.min_tokens > 0 and bool(self.eos)
        return bool(self.presence or self.frequency or self.repetition != 1.0 or self.logit_bias or suppress)

    @staticmethod
    def of(
        presence: float = 0.0,
        frequency: float = 0.0,
        repetition: float = 1.0,
        bias: Mapping[int, float] | None = None,
        min_tokens: int = 0,
        eos: Sequence[int] = (),
    ) -> Penalties:
        bias_items = tuple(sorted((bias or {}).items()))
        return Penalties(presence, frequency, repetition, bias_items, min_tokens, tuple(sorted(set(eos))))


def validate_penalties(penalties: Penalties, vocab_size: int) -> str | None:
    """Why `penalties` cannot be applied to a vocabulary of `vocab_size`, or None."""
    for name, value in (
        ("presence_penalty", penalties.presence),
        ("frequency_penalty", penalties.frequency),
        ("repetition_penalty", penalties.repetition),
    ):
        if problem := RANGES[name].problem(name, value):
            return problem
    if len(penalties.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        return f"logit_bias has {len(penalties.logit_bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES} are allowed"
    for token, bias in penalties.logit_bias:
        if not 0 <= token < vocab_size:
            return f"logit_bias: token id {token} is outside the vocabulary [0, {vocab_size})"
        if problem := RANGES["logit_bias"].problem(f"logit_bias[{token}]", bias):
            return problem
    if penalties.min_tokens < 0:
        return f"min_tokens must be >= 0, got {penalties.min_tokens}"
    if any(not 0 <= t < vocab_size for t in penalties.eos):
        return f"min_tokens' end-of-sequence ids must be in the vocabulary [0, {vocab_size})"
    return None


@dataclass(frozen=True)
class LogprobsRequest:
    """What a sequence wants back: `top` alternatives per position, and its prompt's logprobs."""

    top: int = 0
    prompt: bool = False


@dataclass(frozen=True)
class TokenLogprob:
    """The target's log-probability of one chosen token, with the most likely alternatives."""

    token_id: int
    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()
