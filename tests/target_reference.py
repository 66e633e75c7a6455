"""Target-only references computed with plain HF forwards: what the services must reproduce.

Written independently of specd's own code: OpenAI's published formula for presence and
frequency penalties, HF's RepetitionPenaltyLogitsProcessor itself, and a plain loop for
the bias, in vLLM's order (bias, repetition, frequency and presence).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from transformers import RepetitionPenaltyLogitsProcessor


def adjust(
    logits: torch.Tensor,
    prompt: Sequence[int],
    output: Sequence[int],
    presence: float = 0.0,
    frequency: float = 0.0,
    repetition: float = 1.0,
    bias: Mapping[int, float] | None = None,
) -> torch.Tensor:
    """One position's logits [V] after the request's bias and penalties."""
    x = logits.float().clone()
    for token, b in (bias or {}).items():
        x[token] += b
    if repetition != 1.0:
        seen = torch.tensor([[*prompt, *output]])
        x = RepetitionPenaltyLogitsProcessor(repetition)(seen, x[None])[0]
    # OpenAI: mu[j] -= c[j] * alpha_frequency + float(c[j] > 0) * alpha_presence
    for token, count in Counter(output).items():
        x[token] -= count * frequency + (1.0 if count > 0 else 0.0) * presence
    return x


@torch.inference_mode()
def penalized_greedy(model: Any, prompt: Sequence[int], max_tokens: int, **penalties: Any) -> list[int]:
    """Greedy decoding of the target alone, one full forward per token."""
    output: list[int] = []
    for _ in range(max_tokens):
        logits = model(torch.tensor([[*prompt, *output]])).logits[0, -1]
        output.append(int(adjust(logits, prompt, output, **penalties).argmax()))
    return output


@torch.inference_mode()
def raw_logprobs(model: Any, tokens: Sequence[int]) -> torch.Tensor:
    """log-softmax of the target's raw logits at every position of `tokens` [len, V], float32."""
    return model(torch.tensor([list(tokens)])).logits[0].float().log_softmax(dim=-1)
