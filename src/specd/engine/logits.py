"""Penalties and logit bias: what a request does to the target's logits before sampling.

Pure tensor functions, shared by the verifier (on the target's logits at every verified
position) and the model drafter (on its own logits, so its drafts follow the penalised
distribution and keep being accepted). Order and formulas follow vLLM: logit bias first,
then the repetition penalty (HF's: divide a positive logit, multiply a negative one, for
every token of the prompt or the output), then OpenAI's frequency and presence penalties
over the output tokens only, and last vLLM's min_tokens (end-of-sequence ids at -inf until
that many tokens were generated).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specd.engine.params import Penalties


def penalize(
    logits: torch.Tensor,
    penalties: Penalties,
    prompt: Sequence[int],
    output: Sequence[int],
    drafts: Sequence[int] = (),
) -> torch.Tensor:
    """Apply `penalties` to float logits [n, V]; row j counts output + drafts[:j] as generated.

    The verifier passes the k+1 rows of one block with its k drafts, so each position is
    penalised for exactly the tokens that would precede it if the drafts before it are
    accepted, which is the only case in which that position's token is used.
    """
    if not penalties.active:
        return logits
    n, vocab = logits.shape
    device = logits.device
    x = logits.float().clone()
    if penalties.logit_bias:
        ids = torch.tensor([t for t, _ in penalties.logit_bias], dtype=torch.long, device=device)
        bias = torch.tensor([b for _, b in penalties.logit_bias], dtype=x.dtype, device=device)
        x[:, ids] += bias
    counts = torch.bincount(torch.tensor(list(output), dtype=torch.long, device=device), minlength=vocab)
    counts = counts.to(x.dtype)[None, :].repeat(n, 1)
    if n > 1:
        step = torch.zeros((n, vocab), dtype=x.dtype, device=device)
        rows = torch.arange(1, n, device=device)
        step[rows, torch.tensor(list(drafts[: n - 1]), dtype=torch.long, device=device)] = 1.0
        counts += step.cumsum(0)
    if penalties.repetition != 1.0:
        seen = counts > 0
        if prompt:
            seen[:, torch.tensor(list(prompt), dtype=torch.long, device=device)] = True
        scaled = torch.where(x > 0, x / penalties.repetition, x * penalties.repetition)
        x = torch.where(seen, scaled, x)
    if penalties.frequency:
        x -= penalties.frequency * counts
    if penalties.presence:
        x -= penalties.presence * (counts > 0).to(x.dtype)
    # min_tokens: row j is output position len(output) + j; before min_tokens no eos may end it.
    early = max(0, min(n, penalties.min_tokens - len(output)))
    if early and penalties.eos:
        x[:early, torch.tensor(penalties.eos, dtype=torch.long, device=device)] = float("-inf")
    return x
