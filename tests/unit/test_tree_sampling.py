"""Exactness in distribution of the token-tree rules (specd.engine.tree_sampling), on a toy
autoregressive pair as test_sampling_stats' chain tests use.

Each round's tree has three siblings at the root (the draft's likeliest token as a point mass, a
draw from q and a draw from another draft distribution), and two siblings below the second:
the joint distribution of the first two emitted tokens must be the target's. The mutants at
the end prove that the test can fail.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from scipy import stats

from specd.engine import tree_sampling, trees
from specd.engine.sampling import rejection_sample
from specd.engine.tree_sampling import TreeVerdict, coupled_tree_verdict, tree_rejection_sample

VOCAB, DEPTH, START = 6, 2, 0
TRIALS = 3000
MIN_P_VALUE = 1e-3  # a correct rule fails this with probability 1e-3 per test: seeds are fixed
DETECTED_P_VALUE = 1e-6  # every mutant lands far below this at these seeds
# Nodes: 0 the draft's likeliest (a point mass), 1 drawn from q, 2 drawn from q_alt; 3 below 0;
# 4 (from q) and 5 (from q_alt) below 1.
TREE = [-1, -1, -1, 0, 1, 1]
ALT = {2, 5}
POINT = {0}


def toy() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """p, q and q_alt [DEPTH + 2, V, V]: each distribution of the next token given the position and
    the previous token; p rules out some tokens, and they differ with the position."""
    gen = torch.Generator().manual_seed(7)
    shape = (DEPTH + 2, VOCAB, VOCAB)
    logits = torch.randn(shape, generator=gen) * 1.5
    logits[torch.rand(shape, generator=gen) < 0.2] = float("-inf")
    logits[..., 0] = torch.where(torch.isinf(logits).all(-1), torch.zeros(()), logits[..., 0])
    p = logits.softmax(-1)
    q = (torch.randn(shape, generator=gen) * 1.5).softmax(-1)
    q_alt = (torch.randn(shape, generator=gen) * 1.5).softmax(-1)
    assert (p[0] - p[1]).abs().sum(-1).min() > 0.3  # the position matters
    return p, q, q_alt


def draw(dist: torch.Tensor, gen: torch.Generator) -> int:
    return int(torch.multinomial(dist, 1, generator=gen))


def tree_round(
    p: torch.Tensor, q: torch.Tensor, q_alt: torch.Tensor, pos: int, prev: int, drafter, verifier
) -> list[int]:
    """One round of TREE at `pos` after `prev`: the tokens it commits."""
    tokens: list[int] = []
    sent: list[torch.Tensor] = []
    for i, parent in enumerate(TREE):
        depth = trees.depths(TREE)[i]
        before = prev if parent < 0 else tokens[parent]
        source = (q_alt if i in ALT else q)[pos + depth, before]
        tokens.append(int(source.argmax()) if i in POINT else draw(source, drafter))
        sent.append(torch.zeros(VOCAB) if i in POINT else source)
    rows = [p[pos, prev]] + [p[pos + trees.depths(TREE)[i] + 1, t] for i, t in enumerate(tokens)]
    verdict = tree_rejection_sample(torch.stack(rows), tokens, TREE, torch.stack(sent), verifier)
    assert all(TREE[b] == a for a, b in zip((-1, *verdict.path), verdict.path, strict=False))
    return [tokens[i] for i in verdict.path] + [verdict.next_token]


def first_two(trials: int = TRIALS) -> Counter[tuple[int, int]]:
    p, q, q_alt = toy()
    drafter = torch.Generator().manual_seed(1)
    verifier = torch.Generator().manual_seed(2)
    pairs: Counter[tuple[int, int]] = Counter()
    for _ in range(trials):
        out: list[int] = []
        while len(out) < 2:
            out += tree_round(p, q, q_alt, len(out), out[-1] if out else START, drafter, verifier)
        pairs[(out[0], out[1])] += 1
    return pairs


def p_value(pairs: Counter[tuple[int, int]]) -> float:
    """Chi-square of first-two-token counts against p's joint; 0 if an impossible pair was emitted."""
    p, _, _ = toy()
    joint = {(a, b): float(p[0, START, a] * p[1, a, b]) for a in range(VOCAB) for b in range(VOCAB)}
    if any(joint[c] == 0 for c in pairs):
        return 0.0
    n = sum(pairs.values())
    big = [c for c in joint if joint[c] * n >= 5]
    small = [c for c in joint if 0 < joint[c] * n < 5]  # pooled, as chi-square needs
    observed = [pairs[c] for c in big] + [sum(pairs[c] for c in small)]
    expected = [joint[c] for c in big] + [sum(joint[c] for c in small)]
    scale = n / sum(expected)
    return float(stats.chisquare(observed, [e * scale for e in expected]).pvalue)


def test_the_multi_candidate_rule_emits_the_target_joint_distribution():
    pairs = first_two()
    assert p_value(pairs) > MIN_P_VALUE


def test_on_a_chain_it_is_the_chain_rule_for_one_hot_targets():
    """With a one-hot p (greedy) nothing is drawn, so both rules must agree exactly."""
    gen = torch.Generator().manual_seed(3)
    for _ in range(200):
        k = int(torch.randint(0, 4, (), generator=gen))
        p = torch.nn.functional.one_hot(torch.randint(0, VOCAB, (k + 1,), generator=gen), VOCAB).float()
        q = torch.rand((k, VOCAB), generator=gen).softmax(-1)
        drafts = torch.randint(0, VOCAB, (k,), generator=gen).tolist()
        chain = rejection_sample(p, drafts, q, None)
        got = tree_rejection_sample(p, drafts, trees.chain(k), q, None)
        assert (got.num_accepted, got.next_token) == (chain.num_accepted, chain.next_token)
        assert got.path == tuple(range(chain.num_accepted))


def test_on_a_chain_a_rejection_draws_from_the_residual():
    """One draft certainly rejected (p(x) = 0): the token is drawn from norm(max(p - q, 0))."""
    p = torch.tensor([[0.0, 0.5, 0.5], [1.0, 0.0, 0.0]])
    q = torch.tensor([[0.5, 0.5, 0.0]])
    gen = torch.Generator().manual_seed(0)
    seen = Counter(tree_rejection_sample(p, [0], [-1], q, gen).next_token for _ in range(400))
    assert set(seen) == {2}  # p - q leaves only token 2; p alone would give token 1 half the time


def test_coupled_walk_follows_the_first_matching_sibling():
    # Root's target token 7: node 1 (the second sibling) matches, node 2 too but comes later.
    drafts = [5, 7, 7, 9, 3]
    parents = [-1, -1, -1, 0, 1]
    target = [7, 9, 3, 0, 0, 8]  # rows: root, nodes 0..4
    assert coupled_tree_verdict(target, drafts, parents) == TreeVerdict((1, 4), 8)
    assert coupled_tree_verdict([4, 0, 0, 0, 0, 0], drafts, parents) == TreeVerdict((), 4)
    assert coupled_tree_verdict([5, 9, 0, 0, 1, 0], drafts, parents) == TreeVerdict((0, 3), 1)
    with pytest.raises(ValueError):
        coupled_tree_verdict([1, 2], drafts, parents)


def test_row_depths_key_each_row_by_the_token_it_decides():
    assert trees.row_depths([-1, -1, 0, 2, 1]) == [0, 1, 1, 2, 3, 2]
    assert trees.row_depths(trees.chain(3)) == [0, 1, 2, 3]


# -- the same test, proven able to fail -------------------------------------------------


def test_a_sibling_judged_against_the_unupdated_p_is_detected(monkeypatch):
    monkeypatch.setattr(tree_sampling, "after_rejection", lambda p, token, q: p)
    assert p_value(first_two()) < DETECTED_P_VALUE


def test_a_residual_that_takes_every_sibling_for_a_point_mass_is_detected(monkeypatch):
    right = tree_sampling.after_rejection
    monkeypatch.setattr(tree_sampling, "after_rejection", lambda p, token, q: right(p, token, None))
    assert p_value(first_two()) < DETECTED_P_VALUE


def test_a_sibling_accepted_as_if_drawn_from_a_point_mass_is_detected(monkeypatch):
    right = tree_sampling.accepts
    monkeypatch.setattr(tree_sampling, "accepts", lambda p, token, q, generator: right(p, token, None, generator))
    assert p_value(first_two()) < DETECTED_P_VALUE
