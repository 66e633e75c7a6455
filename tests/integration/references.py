"""Prompts and the target model's own greedy continuations, which every exactness check compares to."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "Translate to French: good morning",
    '{"name": "specd", "version":',
    "1, 2, 3, 4, 5,",
    "Speculative decoding makes large models",
    "Q: What is 2 + 2?\nA:",
    "a",
    "Hello",
)


def greedy_references(tok: Any, model: Any, prompts: Sequence[str], max_tokens: int) -> dict[str, list[int]]:
    """Target-only greedy tokens of each prompt, ignoring EOS (a prefix serves shorter max_tokens)."""
    refs = {}
    for prompt in prompts:
        ids = tok.encode(prompt)
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        refs[prompt] = out[0, len(ids) :].tolist()
    return refs


def api_text(tok: Any, ids: Sequence[int]) -> str:
    """The text the API returns for these generated ids: their decoding, less a character the last
    ids leave incomplete. The gateway streams a character once its last byte has come (as vLLM and
    TGI do), so one the output ends in the middle of is never sent."""
    return tok.decode(ids, skip_special_tokens=True).rstrip("\ufffd")
