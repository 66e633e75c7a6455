"""Exactness in distribution of both verification rules, on a toy autoregressive pair.

The target p and the draft q depend on the position and on the previous token,
as a model's do, and the drafter samples from q truncated to its top SUPPORT
tokens exactly as the drafter service truncates. What is tested is the joint
distribution of the first two emitted tokens across whole speculative rounds
(accepted, corrected and bonus tokens alike). The mutants at the end prove that
these tests can fail: each plants a bug the test must detect.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch
from scipy import stats

from specd.engine import sampling
from specd.engine.noise import noise_key
from specd.engine.sampling import (
    coupled_verdict,
    gumbel_argmax,
    rejection_sample,
    sample,
    sparse_draft,
    sparse_drafts,
    truncate,
)

VOCAB, K, SUPPORT, START = 6, 2, 3, 0
TRIALS = 3000
MIN_P_VALUE = 1e-3  # a correct rule fails this with probability 1e-3 per test: seeds are fixed
DETECTED_P_VALUE = 1e-6  # every mutant lands far below this at these seeds


@dataclass(frozen=True)
class ToyPair:
    p: torch.Tensor  # [K + 2, V, V]: target p(x | position, previous token)
    q: torch.Tensor  # same shape: the draft model's full distribution
    q_sent: torch.Tensor  # q truncated to its top SUPPORT tokens: what the drafter samples and sends

    def joint(self, a: int, b: int) -> float:
        return float(self.p[0, START, a] * self.p[1, a, b])


def make_toy() -> ToyPair:
    gen = torch.Generator().manual_seed(42)
    shape = (K + 2, VOCAB, VOCAB)
    logits = torch.randn(shape, generator=gen) * 1.5
    # p rules out about a fifth of the tokens (as top-k / top-p do), never all of a row.
    logits[torch.rand(shape, generator=gen) < 0.2] = float("-inf")
    logits[..., 0] = torch.where(torch.isinf(logits).all(-1), torch.zeros(()), logits[..., 0])
    p = logits.softmax(-1)
    q = (torch.randn(shape, generator=gen) * 1.5).softmax(-1)
    ids, top = truncate(q.view(-1, VOCAB), SUPPORT)
    q_sent = torch.zeros(q.numel() // VOCAB, VOCAB).scatter_(1, ids, top).view(shape)
    # The test is only as good as its pair: q varies with the position, so using
    # another position's q is a real error, and truncation changes q.
    assert (q[0] - q[1]).abs().sum(-1).min() > 0.3
    assert (q - q_sent).abs().sum(-1).min() > 0.05
    return ToyPair(p, q, q_sent)


@pytest.fixture(scope="module")
def toy() -> ToyPair:
    return make_toy()


def rounds(out: list[list[int]]) -> Iterator[tuple[list[int], torch.Tensor, torch.Tensor]]:
    """Yields (trials still short of two tokens, their positions, their previous tokens) until none are."""
    while pending := [t for t in range(len(out)) if len(out[t]) < 2]:
        pos = torch.tensor([len(out[t]) for t in pending])
        prev = torch.tensor([out[t][-1] if out[t] else START for t in pending])
        yield pending, pos, prev


def leviathan_pairs(toy: ToyPair, trials: int = TRIALS, send_full_q: bool = False) -> Counter[tuple[int, int]]:
    """First two emitted tokens of `trials` sequences under speculation with the Leviathan rule."""
    drafter = torch.Generator().manual_seed(1)
    verifiers = [torch.Generator().manual_seed(1_000_000 + t) for t in range(trials)]  # never the drafter's
    out: list[list[int]] = [[] for _ in range(trials)]
    for pending, pos, prev in rounds(out):
        drafts, sent, target = [], [], [toy.p[pos, prev]]
        for j in range(K):
            d = torch.multinomial(toy.q_sent[pos + j, prev], 1, generator=drafter).squeeze(1)
            drafts.append(d)
            sent.append((toy.q if send_full_q else toy.q_sent)[pos + j, prev])
            target.append(toy.p[pos + j + 1, d])
            prev = d
        block = torch.stack(drafts, 1).tolist()
        for n, t in enumerate(pending):
            rows = torch.stack([r[n] for r in target])
            verdict = rejection_sample(rows, block[n], torch.stack([q[n] for q in sent]), verifiers[t])
            out[t] += [*block[n][: verdict.num_accepted], verdict.next_token]
    return Counter((o[0], o[1]) for o in out)


def joint_p_value(toy: ToyPair, counts: Counter[tuple[int, int]]) -> float:
    """Chi-square of first-two-token counts against p's joint; 0 if an impossible pair was emitted."""
    n = sum(counts.values())
    cells = [(a, b) for a in range(VOCAB) for b in range(VOCAB)]
    if any(toy.joint(a, b) == 0 for a, b in counts):
        return 0.0
    big = [c for c in cells if toy.joint(*c) * n >= 5]
    small = [c for c in cells if 0 < toy.joint(*c) * n < 5]  # pooled, as chi-square needs
    observed = [counts[c] for c in big] + [sum(counts[c] for c in small)]
    expected = [toy.joint(*c) for c in big] + [sum(toy.joint(*c) for c in small)]
    scale = n / sum(expected)
    return float(stats.chisquare(observed, [e * scale for e in expected]).pvalue)


def test_leviathan_rule_emits_the_target_joint_distribution(toy: ToyPair):
    assert joint_p_value(toy, leviathan_pairs(toy)) > MIN_P_VALUE


def test_sparse_drafts_draw_each_row_as_sparse_draft_does():
    """Rows drawn together, each with its own generator, are drawn as one at a time: the same
    tokens and sparse q for the same generator states, zero tails dropped (the second row has
    two nonzero tokens under a support of four)."""
    q = torch.tensor([[0.05, 0.30, 0.10, 0.40, 0.15], [0.0, 0.7, 0.0, 0.3, 0.0], [0.2] * 5])
    for seed in range(20):
        together = sparse_drafts(q, 4, [torch.Generator().manual_seed(seed + r) for r in range(3)])
        alone = [sparse_draft(q[r], 4, torch.Generator().manual_seed(seed + r)) for r in range(3)]
        assert together == alone
        for r in range(3):  # each the draw over its row's nonzero head alone
            ids, top = truncate(q[r][None], 4)
            keep = top[0] > 0
            pick = sample(top[0][keep], torch.Generator().manual_seed(seed + r))
            assert together[r] == (int(ids[0][keep][pick]), ids[0][keep].tolist(), top[0][keep].tolist())
    assert sorted(together[1][1]) == [1, 3]


def test_sparse_draft_samples_the_truncated_distribution():
    q = torch.tensor([0.05, 0.30, 0.10, 0.40, 0.15])
    gen = torch.Generator().manual_seed(0)
    counts = Counter(sparse_draft(q, 3, gen)[0] for _ in range(4000))
    assert set(counts) <= {1, 3, 4}
    _, ids, probs = sparse_draft(q, 3, gen)
    assert sorted(ids) == [1, 3, 4]
    assert sum(probs) == pytest.approx(1.0)
    expected = [0.30 / 0.85 * 4000, 0.40 / 0.85 * 4000, 0.15 / 0.85 * 4000]
    assert stats.chisquare([counts[1], counts[3], counts[4]], expected).pvalue > MIN_P_VALUE


# -- the Gumbel-max coupling (seeded requests) -------------------------------------------

SEEDS = range(TRIALS)


def keys_at(seeds: list[int], positions: list[int]) -> torch.Tensor:
    return torch.tensor([noise_key(s, a) for s, a in zip(seeds, positions, strict=True)])


def coupled_pairs(
    toy: ToyPair, k: int, draft_offset: int = 0, verify_at: Callable[[int, int], int] | None = None
) -> tuple[list[tuple[int, int]], float]:
    """First two tokens of one sequence per seed, and the acceptance rate.

    draft_offset shifts the drafter's noise (a drafter out of step with the
    verifier); verify_at(pos, j) replaces the position whose noise the verifier
    uses for row j of a block starting at pos.
    """
    out: list[list[int]] = [[] for _ in SEEDS]
    drafted = accepted = 0
    for pending, pos, prev in rounds(out):
        starts = pos.tolist()
        drafts, target = [], [toy.p[pos, prev]]
        for j in range(k):
            d = gumbel_argmax(toy.q[pos + j, prev], keys_at(pending, [a + j + draft_offset for a in starts]))
            drafts.append(d)
            target.append(toy.p[pos + j + 1, d])
            prev = d
        block = torch.stack(drafts, 1).tolist() if k else [[] for _ in pending]
        # All rows of all pending seeds in one call, row j of seed n at n * (k + 1) + j.
        rows = torch.stack(target, 1).view(-1, VOCAB)
        at = [a + j if verify_at is None else verify_at(a, j) for a in starts for j in range(k + 1)]
        tokens = gumbel_argmax(rows, keys_at([s for s in pending for _ in range(k + 1)], at)).view(-1, k + 1)
        for n, s in enumerate(pending):
            verdict = coupled_verdict(tokens[n].tolist(), block[n])
            out[s] += [*block[n][: verdict.num_accepted], verdict.next_token]
            drafted += k
            accepted += verdict.num_accepted
    return [(o[0], o[1]) for o in out], accepted / max(drafted, 1)


@pytest.fixture(scope="module")
def target_only(toy: ToyPair) -> list[tuple[int, int]]:
    pairs, _ = coupled_pairs(toy, 0)
    return pairs


def test_coupled_target_only_sampling_emits_the_target_joint_distribution(toy: ToyPair, target_only):
    assert joint_p_value(toy, Counter(target_only)) > MIN_P_VALUE


@pytest.mark.parametrize("k", [1, 2])
def test_coupled_speculation_emits_exactly_the_target_only_tokens_of_each_seed(toy: ToyPair, target_only, k: int):
    pairs, acceptance = coupled_pairs(toy, k)
    assert pairs == target_only
    assert 0.2 < acceptance < 0.9  # both outcomes were exercised


def test_coupled_speculation_stays_exact_with_a_drafter_out_of_step(toy: ToyPair, target_only):
    # A drafter that keys its noise one position late (as the old lagging stream
    # did) only costs acceptance: the verifier alone decides what is emitted.
    pairs, acceptance = coupled_pairs(toy, 2, draft_offset=1)
    _, in_step = coupled_pairs(toy, 2)
    assert pairs == target_only
    assert acceptance < in_step - 0.05


# -- mutants: each must be detected ------------------------------------------------------


def draft_row_of_position_0(target_probs, draft_tokens, draft_probs, position):
    rows = None if draft_probs is None else draft_probs[[0] * len(draft_probs)]
    return ORIGINAL_RESIDUAL(target_probs, draft_tokens, rows, position)


def target_row_of_position_0(target_probs, draft_tokens, draft_probs, position):
    return ORIGINAL_RESIDUAL(target_probs[[0] * len(target_probs)], draft_tokens, draft_probs, position)


def correction_from_p(target_probs, draft_tokens, draft_probs, position):
    return target_probs[position]


ORIGINAL_RESIDUAL = sampling.residual


@pytest.mark.parametrize(
    "mutant", [draft_row_of_position_0, target_row_of_position_0, correction_from_p], ids=lambda f: f.__name__
)
def test_a_residual_mutant_is_detected(toy: ToyPair, monkeypatch, mutant):
    monkeypatch.setattr(sampling, "residual", mutant)
    assert joint_p_value(toy, leviathan_pairs(toy)) < DETECTED_P_VALUE


def test_verifying_against_the_untruncated_draft_distribution_is_detected(toy: ToyPair):
    # The drafter samples from its top-SUPPORT q; the verifier must use that q.
    assert joint_p_value(toy, leviathan_pairs(toy, send_full_q=True)) < DETECTED_P_VALUE


def test_noise_keyed_by_round_instead_of_position_is_detected(toy: ToyPair, target_only):
    # Every row of a block reusing the block's first noise: k-dependent and biased.
    pairs, _ = coupled_pairs(toy, 2, verify_at=lambda pos, j: pos)
    assert pairs != target_only
    assert joint_p_value(toy, Counter(pairs)) < DETECTED_P_VALUE
