"""Target/draft distributions and the exact rules that accept or reject drafts.

Pure tensor functions: no model, no service. Two exact rules, one per kind of
sampled request:

- unseeded: `rejection_sample` implements Leviathan et al. 2023 (arXiv 2211.17192)
  / Chen et al. 2023: accept draft token x with probability min(1, p(x)/q(x)); at
  the first rejection sample from norm(max(0, p - q)); if all k are accepted,
  sample a bonus token from p. Drafter and verifier draw from independent
  generators.
- seeded: the Gumbel-max coupling. The token at position i is
  argmax(log p_i + g_i), where g_i is Gumbel noise that depends only on (seed, i)
  (`specd.engine.noise`). The drafter proposes argmax(log q_i + g_i) with the same noise;
  the verifier accepts while its own argmax agrees and emits its argmax at the
  first disagreement (or as the bonus). Every emitted token is then the token
  target-only sampling with that seed emits, whatever the drafts were.

Either way the emitted tokens are distributed exactly as sampling from p alone.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specd.engine import noise
from specd.engine.params import SamplingParams

# Where top_p_cut looks for a row's nucleus, in turn, before sorting the whole row.
TOP_P_CANDIDATES = (256, 4096)
# The most likely tokens of a row whose noisy scores bound what the winner's must reach.
GUMBEL_PROBES = 4


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(dim=-1)`: the lowest id among the largest (a NaN counting as the largest),
    on the logits' device. On the CPU through numpy's argmax, which is vectorised where torch's
    CPU argmax is not: over a vocabulary of rows, torch's is most of a verify's work after its
    forward."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(logits.detach().numpy().argmax(axis=-1))
    return logits.argmax(dim=-1)


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """A fresh, nondeterministically seeded generator for an unseeded sampled sequence.

    Greedy sequences need no randomness and seeded ones draw counter-based noise
    (`gumbel_argmax`), so both get None. Each service makes its own, so the
    drafter's draws are independent of the verifier's.
    """
    if params.greedy or params.seeded:
        return None
    gen = torch.Generator(device=device)
    gen.seed()
    return gen


def probabilities(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Turn float logits [N, V] into the distribution each row's request samples from.

    Greedy rows become one-hot on the argmax (ties: lowest id, as torch.argmax and
    HF greedy search). Sampled rows apply temperature, then top-k, then top-p, then
    min-p, in the order and with the tie rules of HF's logits warpers.
    """
    logits = logits.float()
    vocab = logits.shape[-1]
    out = torch.empty_like(logits)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if not sampled:
        # All greedy: a contiguous fill and scatter, not an indexed gather of every row.
        return out.zero_().scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
    if greedy:
        gi = torch.tensor(greedy, device=logits.device)
        out[gi] = 0.0
        out[gi, logits[gi].argmax(dim=-1)] = 1.0
    si = torch.tensor(sampled, device=logits.device)
    x = logits[si] if greedy else logits  # no copy of every row when none is greedy
    temps = torch.tensor([params[i].temperature for i in sampled], device=x.device)
    x = x / temps[:, None]
    top_ks = [params[i].top_k for i in sampled]
    if any(0 < k < vocab for k in top_ks):
        ks = [k if 0 < k < vocab else vocab for k in top_ks]
        # The k-th largest value (ties at it stay, as HF's TopKLogitsWarper keeps them), from a
        # partial selection: sorting every row of the vocabulary cost far more.
        kth = x.topk(max(ks), dim=-1).values.gather(1, torch.tensor(ks, device=x.device)[:, None] - 1)
        x = x.masked_fill(x < kth, float("-inf"))
    nucleus = [r for r, i in enumerate(sampled) if params[i].top_p < 1.0]
    if len(nucleus) == len(sampled):
        x = top_p_cut(x, torch.tensor([params[i].top_p for i in sampled], device=x.device))
    elif nucleus:
        at = torch.tensor(nucleus, device=x.device)
        x[at] = top_p_cut(x[at], torch.tensor([params[sampled[r]].top_p for r in nucleus], device=x.device))
    min_ps = [params[i].min_p for i in sampled]
    if any(p > 0.0 for p in min_ps):
        # As HF's MinPLogitsWarper: against the most likely token's probability, which always stays.
        probs = x.softmax(dim=-1)
        floor = torch.tensor(min_ps, device=x.device)[:, None] * probs.amax(dim=-1, keepdim=True)
        x = x.masked_fill(probs < floor, float("-inf"))
    if not greedy:
        return x.softmax(dim=-1)
    out[si] = x.softmax(dim=-1)
    return out


def top_p_cut(x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Nucleus sampling on logits [N, V] with top_p [N] in (0, 1): a token stays while the
    probability of the tokens more likely than it is below top_p (so the most likely always
    stays; HF's TopPLogitsWarper's set, which it reaches from the least likely up).

    Each row's nucleus is looked for among its most likely tokens, TOP_P_CANDIDATES of them
    and then more; only a row whose candidates hold less than top_p sorts its whole vocabulary.
    """
    probs = x.softmax(dim=-1)
    keep = torch.zeros_like(x, dtype=torch.bool)
    rows = torch.arange(x.shape[0], device=x.device)
    for size in (*TOP_P_CANDIDATES, x.shape[-1]):
        candidates, ids = probs[rows].topk(min(size, x.shape[-1]), dim=-1)
        mass = candidates.cumsum(dim=-1)
        stays = (mass - candidates) < top_p[rows, None]
        keep[rows] = torch.zeros((len(rows), x.shape[-1]), dtype=torch.bool, device=x.device).scatter_(1, ids, stays)
        if size >= x.shape[-1]:
            break
        rows = rows[mass[:, -1] < top_p[rows]]  # the nucleus may reach past these candidates
        if not len(rows):
            break
    return x.masked_fill(~keep, float("-inf"))


def truncate(probs: torch.Tensor, max_support: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep the `max_support` most likely tokens of each row [N, V], renormalised.

    Returns (ids [N, s], probs [N, s]) with zero-probability entries possible at
    the tail; the draft then samples from exactly this sparse distribution, so the
    verifier's rule stays exact.
    """
    s = min(max_support, probs.shape[-1])
    top, ids = probs.topk(s, dim=-1)
    top = top / top.sum(dim=-1, keepdim=True)
    return ids, top


def sparse_draft(
    probs: torch.Tensor, max_support: int, generator: torch.Generator
) -> tuple[int, list[int], list[float]]:
    """Sample a draft token from the `max_support` most likely tokens of `probs` [V].

    Returns (token, ids, probs) of the sparse distribution the token was drawn
    from, zero tail dropped: the q the verifier needs for an unseeded request.
    """
    return sparse_drafts(probs[None], max_support, [generator])[0]


def sparse_drafts(
    probs: torch.Tensor, max_support: int, generators: Sequence[torch.Generator]
) -> list[tuple[int, list[int], list[float]]]:
    """`sparse_draft` for every row of `probs` [R, V], row r drawn with `generators[r]`; what
    is read back to the host is read once for all rows, not once a row (on a GPU, each read
    waits for the device)."""
    ids, top = truncate(probs, max_support)
    # The truncated rows sorted most likely first: a zero tail adds nothing to a row's CDF,
    # so the draw over the whole row is the draw over its nonzero head.
    picks = torch.stack([sample_tensor(row, g) for row, g in zip(top, generators, strict=True)])
    rows_ids, rows_top, rows_pick = ids.tolist(), top.tolist(), picks.tolist()
    out = []
    for row_ids, row_top, pick in zip(rows_ids, rows_top, rows_pick, strict=True):
        kept = sum(1 for p in row_top if p > 0)
        out.append((row_ids[pick], row_ids[:kept], row_top[:kept]))
    return out


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from a distribution [V]; without a generator, its argmax (greedy)."""
    return int(sample_tensor(probs, generator))


def sample_tensor(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """`sample`, as a 0-d tensor on the probabilities' device: nothing is read back to the host."""
    if generator is None:
        return probs.argmax()
    # Inverse CDF: one uniform and a binary search (torch.multinomial took a millisecond a row of
    # the vocabulary). A token of probability 0 adds nothing to the CDF, so the search never
    # lands on one; only where rounding puts u at the total does it fall past the end, and then
    # the last token of nonzero probability is taken.
    cdf = probs.cumsum(dim=0)
    u = torch.rand((), generator=generator, device=probs.device) * cdf[-1]
    token = torch.searchsorted(cdf, u[None], right=True)[0]
    last = probs.shape[0] - 1 - (probs > 0).flip(0).to(torch.float32).argmax()
    return torch.where(token >= probs.shape[0], last, token)


def position_keys(seed: int, start: int, count: int, device: torch.device) -> torch.Tensor:
    """Noise keys [count] of positions start, start + 1, ... for one seeded sequence."""
    return spans_keys([(seed, start, count)], device)


def spans_keys(spans: Sequence[tuple[int, int, int]], device: torch.device) -> torch.Tensor:
    """`position_keys` of every (seed, start, count) span, concatenated: one copy to the device
    for a whole batch of seeded sequences, not one each."""
    keys = [noise.noise_key(seed, start + i) for seed, start, count in spans for i in range(count)]
    return torch.tensor(keys, dtype=torch.int64, device=device)


def gumbel_argmax(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """argmax over tokens of log p + g(key, token) for each row of probs [R, V]; keys [R].

    Exactly a sample from each row's p (Gumbel-max), so temperature, top-k, top-p and
    min-p compose by being already in p. Noise is hashed only at tokens that could win
    (hashing the whole vocabulary for every row was most of a seeded round's cost): the
    noise never exceeds GUMBEL_MAX, so a token whose log p lies more than that below some
    token's noisy score cannot win, and the row's few most likely tokens give such a
    score. The argmax, ties included, is the one over every token.
    """
    return _noisy_scores(probs, keys, 1).argmax(dim=-1)


def gumbel_top(probs: torch.Tensor, keys: torch.Tensor, m: int) -> torch.Tensor:
    """The m best tokens of each row of probs [R, V] by log p + g(key, token), best first, as
    `gumbel_argmax` scores them (its first is gumbel_argmax's); keys [R]. Where fewer than m
    tokens have p > 0, the rest are tokens of p = 0."""
    return _noisy_scores(probs, keys, m).topk(m, dim=-1).indices


def _noisy_scores(probs: torch.Tensor, keys: torch.Tensor, m: int) -> torch.Tensor:
    """log p + g(key, token) at every token that could be among a row's m best, -inf elsewhere:
    the m best probes' m-th noisy score bounds the m-th best from below, and no token's noisy
    score exceeds its log p + GUMBEL_MAX."""
    logp = probs.log()  # -inf where p = 0: those never win
    hashed = _vocabulary_hashes(probs.shape[-1], probs.device)
    probes_logp, probes = logp.topk(min(max(GUMBEL_PROBES, m), probs.shape[-1]), dim=-1)
    probed = probes_logp + noise.gumbel_of(keys[:, None], hashed[probes])
    reached = probed.amax(dim=-1) if m == 1 else probed.topk(m, dim=-1).values[:, -1]
    could = logp >= (reached - noise.GUMBEL_MAX)[:, None]
    if m > 1:
        could &= logp > float("-inf")  # a row with fewer than m possible tokens reaches -inf
    rows, tokens = could.nonzero(as_tuple=True)
    scores = torch.full_like(logp, float("-inf"))
    scores[rows, tokens] = logp[rows, tokens] + noise.gumbel_of(keys[rows], hashed[tokens])
    return scores


@functools.lru_cache(maxsize=8)
def _vocabulary_hashes(vocab: int, device: torch.device) -> torch.Tensor:
    """`noise.token_hashes` of ids 0 .. vocab - 1 (never written to: callers only read it)."""
    return noise.token_hashes(torch.arange(vocab, device=device))


@dataclass(frozen=True)
class Verdict:
    num_accepted: int
    next_token: int


def rejection_sample(
    target_probs: torch.Tensor,
    draft_tokens: Sequence[int] | torch.Tensor,
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None,
) -> Verdict:
    """Verify one sequence's k draft tokens against the target.

    target_probs: [k + 1, V], p at each draft position plus the bonus position.
    draft_tokens: the k proposed ids.
    draft_probs:  [k, V], the q each draft token was drawn from; None when every
                  draft token had probability 1 (greedy or deterministic drafter).
    generator:    the sequence's generator; None for greedy sequences, whose p is
                  one-hot, so acceptance and the correction need no randomness.
    """
    num, token = deferred_verdict(target_probs, draft_tokens, draft_probs, generator).tolist()
    return Verdict(num, token)


def deferred_verdict(
    target_probs: torch.Tensor,
    draft_tokens: Sequence[int] | torch.Tensor,
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """`rejection_sample`'s verdict as a tensor [num_accepted, next_token] on the probabilities'
    device, computed without reading anything back to the host: a batch's verdicts are read back
    together, once. `draft_tokens` may already be a tensor on that device (a list is copied there)."""
    k = len(draft_tokens)
    if target_probs.shape[0] != k + 1:
        raise ValueError(f"target_probs has {target_probs.shape[0]} rows for {k} draft tokens")
    device = target_probs.device
    idx = _ids(draft_tokens, device)
    if k:
        p = target_probs[:k].gather(1, idx[:, None]).squeeze(1)
        q = draft_probs[:k].gather(1, idx[:, None]).squeeze(1) if draft_probs is not None else torch.ones_like(p)
        if generator is None:
            # u = 0: accept iff p(x) > 0, which for a one-hot p means x is the argmax.
            accept = p > 0
        else:
            u = torch.rand(k, generator=generator, device=device)
            accept = u * q < p  # u < p/q without dividing by a tiny q
        num = accept.to(torch.int64).cumprod(0).sum()
    else:
        num = torch.zeros((), dtype=torch.int64, device=device)
    # At the first rejection the correction; with every draft accepted (num = k) the bonus, from p.
    return torch.stack([num, sample_tensor(residual(target_probs, idx, draft_probs, num), generator)])


def residual(
    target_probs: torch.Tensor,
    draft_tokens: Sequence[int] | torch.Tensor,
    draft_probs: torch.Tensor | None,
    position: int | torch.Tensor,
) -> torch.Tensor:
    """norm(max(0, p - q)) at the rejected `position`: where the correction is drawn from; at
    position k, past the last draft, p itself (the bonus token's distribution).

    A function of its own so that tests can swap in a wrong position and check
    that the statistical tests notice. `position` may be a 0-d tensor, so that
    nothing is read back to the host.
    """
    k = target_probs.shape[0] - 1
    out = target_probs[position].clone()
    if draft_probs is not None:
        rows = torch.cat([draft_probs[:k], torch.zeros_like(target_probs[:1])])  # no q past the drafts
        out = (out - rows[position]).clamp_(min=0.0)
    else:
        ids = _ids(draft_tokens, target_probs.device)
        padded = torch.cat([ids, ids.new_zeros(1)])
        drafted = torch.arange(out.shape[0], device=out.device) == padded[position]
        out = out.masked_fill(drafted & (torch.as_tensor(position, device=out.device) < k), 0.0)
    total = out.sum()
    # Only when p == q exactly can the residual vanish, and then rejection had
    # probability 0; fall back to p rather than divide by zero.
    return torch.where(total > 0, out / torch.where(total > 0, total, 1.0), target_probs[position])


def _ids(tokens: Sequence[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    if isinstance(tokens, torch.Tensor):
        return tokens.to(device=device, dtype=torch.long)
    return torch.tensor(list(tokens), dtype=torch.long, device=device)


def coupled_verdict(target_tokens: Sequence[int], draft_tokens: Sequence[int]) -> Verdict:
    """The Gumbel-max coupling's verdict: accept drafts while they equal the target's own tokens.

    target_tokens: [k + 1], the target's argmax(log p + g) at each draft position
    and the bonus position (`gumbel_argmax`); the emitted token at the first
    disagreement is the target's, so no draft distribution is needed.
    """
    k = len(draft_tokens)
    if len(target_tokens) != k + 1:
        raise ValueError(f"{len(target_tokens)} target tokens for {k} draft tokens")
    num = 0
    while num < k and draft_tokens[num] == target_tokens[num]:
        num += 1
    return Verdict(num, int(target_tokens[num]))
