"""The target's log-probabilities of chosen tokens, with the most likely alternatives."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specd.engine.params import TokenLogprob


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """Log-softmax of raw logits [n, V] at the n positions whose chosen tokens are `tokens`.

    Raw means before penalties, bias, temperature and truncation: the model's own
    distribution, as vLLM's default `raw_logprobs`; a greedy request then gets the
    real values, not the 0.0 of its one-hot sampling distribution.
    """
    if not tokens:
        return []
    lp = logits[: len(tokens)].float().log_softmax(dim=-1)
    chosen = lp.gather(1, torch.tensor(list(tokens), dtype=torch.long, device=lp.device)[:, None])[:, 0].tolist()
    if top <= 0:
        return [TokenLogprob(t, v) for t, v in zip(tokens, chosen, strict=True)]
    values, ids = lp.topk(min(top, lp.shape[-1]), dim=-1)
    return [
        TokenLogprob(t, v, tuple(i), tuple(p))
        for t, v, i, p in zip(tokens, chosen, ids.tolist(), values.tolist(), strict=True)
    ]
