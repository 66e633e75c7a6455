from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch
from scipy import stats
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from specd.engine.params import SamplingParams, validate_sampling
from specd.engine.sampling import (
    TOP_P_CANDIDATES,
    Verdict,
    coupled_verdict,
    deferred_verdict,
    greedy_tokens,
    gumbel_argmax,
    make_generator,
    position_keys,
    probabilities,
    rejection_sample,
    residual,
    sample,
    truncate,
)

GREEDY = SamplingParams(temperature=0.0)


def hf_reference(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """HF's warper chain (temperature -> top-k -> top-p -> min-p) on one row, then softmax."""
    scores = logits.float().clone()[None]
    scores = TemperatureLogitsWarper(params.temperature)(None, scores)
    if params.top_k > 0:
        scores = TopKLogitsWarper(params.top_k)(None, scores)
    if params.top_p < 1.0:
        scores = TopPLogitsWarper(params.top_p)(None, scores)
    if params.min_p > 0.0:
        scores = MinPLogitsWarper(params.min_p)(None, scores)
    return scores.softmax(dim=-1)[0]


# -- probabilities -----------------------------------------------------------------


def test_greedy_rows_are_one_hot_argmax_with_lowest_id_on_ties():
    logits = torch.tensor(
        [
            [1.0, 3.0, 3.0, 0.0],
            [5.0, 5.0, 5.0, 5.0],
            [-1.0, -2.0, -3.0, -0.5],
            [0.0, 0.0, 0.0, 7.0],
        ]
    )
    probs = probabilities(logits, [GREEDY] * 4)
    expected = torch.zeros(4, 4)
    expected[0, 1] = expected[1, 0] = expected[2, 3] = expected[3, 3] = 1.0
    assert torch.equal(probs, expected)


def test_greedy_ignores_top_k_top_p_and_min_p():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.0, top_k=5, top_p=0.3, seed=7, min_p=0.5)] * 3
    probs = probabilities(logits, params)
    assert torch.equal(probs.argmax(dim=-1), logits.argmax(dim=-1))
    assert torch.equal(probs.sum(dim=-1), torch.ones(3))
    assert int((probs > 0).sum()) == 3


SAMPLED_PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.6),
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(temperature=1.0, top_k=1000),  # larger than the vocabulary: no-op
    SamplingParams(temperature=0.8, top_p=0.9),
    SamplingParams(temperature=1.0, top_p=0.01),  # only the most likely token survives
    SamplingParams(temperature=0.5, top_k=10, top_p=0.8),
    SamplingParams(temperature=2.0, top_k=50, top_p=0.5),
    SamplingParams(temperature=1.0, top_k=20, top_p=0.95),
    SamplingParams(temperature=1.0, min_p=0.1),
    SamplingParams(temperature=0.7, min_p=0.3),
    SamplingParams(temperature=1.5, min_p=1.0),  # only the most likely token (and its ties) survive
    SamplingParams(temperature=1.2, top_k=30, top_p=0.9, min_p=0.05),
]


# Integer logits make ties at the top-k boundary, which HF keeps. (Top-p is left out
# of the tied cases: see test_top_p_threshold_is_computed_like_hf.)
HF_CASES = [(p, False) for p in SAMPLED_PARAMS] + [(p, True) for p in SAMPLED_PARAMS if p.top_p == 1.0]


@pytest.mark.parametrize(("params", "tied"), HF_CASES, ids=repr)
def test_sampled_rows_match_hf_warpers(params: SamplingParams, tied: bool):
    gen = torch.Generator().manual_seed(1234)
    vocab = 100
    if tied:
        logits = torch.randint(0, 6, (8, vocab), generator=gen).float()
    else:
        logits = torch.randn(8, vocab, generator=gen) * 3
    probs = probabilities(logits, [params] * 8)
    for row in range(8):
        expected = hf_reference(logits[row], params)
        torch.testing.assert_close(probs[row], expected, atol=1e-6, rtol=1e-5)
        assert torch.equal(probs[row] > 0, expected > 0)
    torch.testing.assert_close(probs.sum(dim=-1), torch.ones(8))


@pytest.mark.parametrize(("vocab", "top_p"), [(5, 0.8), (20, 0.85)])
def test_top_p_threshold_is_computed_like_hf(vocab: int, top_p: float):
    # Equal logits: the cumulative probabilities land exactly on 1 - top_p, so the boundary's
    # rounding decides how many stay. Which of the tied tokens stay is arbitrary (HF's sort is
    # not stable either): the kept probabilities must be HF's, whatever their ids.
    logits = torch.zeros(1, vocab)
    params = SamplingParams(temperature=1.0, top_p=top_p)
    expected = hf_reference(logits[0], params)
    assert int((expected > 0).sum()) < vocab
    got = probabilities(logits, [params])[0]
    torch.testing.assert_close(got.sort().values, expected.sort().values)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 4.0])
def test_top_p_finds_the_nucleus_among_candidates_or_sorts_the_row(temperature: float):
    # Low temperatures put the nucleus among the candidates; a high one spreads it past
    # them, which takes the whole row's sort. Both must give HF's set.
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(16, 5000, generator=gen) * 4
    params = SamplingParams(temperature=temperature, top_p=0.9)
    probs = probabilities(logits, [params] * 16)
    kept = (probs > 0).sum(dim=-1)
    if temperature < 1:
        assert (kept < TOP_P_CANDIDATES[0]).all()
    elif temperature > 1:
        assert (kept > TOP_P_CANDIDATES[0]).all()
    for row in range(16):
        expected = hf_reference(logits[row], params)
        assert torch.equal(probs[row] > 0, expected > 0)
        torch.testing.assert_close(probs[row], expected, atol=1e-6, rtol=1e-5)


def test_mixed_batch_of_greedy_and_sampled_rows():
    gen = torch.Generator().manual_seed(99)
    params = [
        GREEDY,
        SamplingParams(temperature=0.8, top_p=0.9),
        GREEDY,
        SamplingParams(temperature=1.3, top_k=5),
        SamplingParams(temperature=1.0),
        GREEDY,
        SamplingParams(temperature=0.5, top_k=10, top_p=0.8),
    ]
    logits = torch.randn(len(params), 64, generator=gen) * 2
    probs = probabilities(logits, params)
    for row, p in enumerate(params):
        if p.greedy:
            expected = torch.zeros(64)
            expected[int(logits[row].argmax())] = 1.0
            assert torch.equal(probs[row], expected)
        else:
            torch.testing.assert_close(probs[row], hf_reference(logits[row], p), atol=1e-6, rtol=1e-5)


def test_probabilities_accepts_half_precision_logits():
    logits = torch.randn(2, 32, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    params = [GREEDY, SamplingParams(temperature=0.9, top_k=8)]
    probs = probabilities(logits, params)
    assert probs.dtype == torch.float32
    assert int(probs[0].argmax()) == int(logits[0].float().argmax())
    torch.testing.assert_close(probs[1], hf_reference(logits[1].float(), params[1]), atol=1e-6, rtol=1e-5)


# -- rejection_sample: greedy tables ------------------------------------------------


def one_hot_rows(argmaxes: list[int], vocab: int) -> torch.Tensor:
    out = torch.zeros(len(argmaxes), vocab)
    out[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 1.0
    return out


TARGET_ARGMAX = [3, 5, 1, 7, 2]  # k = 4 draft positions plus the bonus position

GREEDY_TABLE = [
    # draft tokens, expected verdict
    ([3, 5, 0, 7], Verdict(2, 1)),
    ([3, 5, 1, 7], Verdict(4, 2)),
    ([0, 5, 1, 7], Verdict(0, 3)),
    ([3, 0, 1, 7], Verdict(1, 5)),
    ([3, 5, 1, 0], Verdict(3, 7)),
]


@pytest.mark.parametrize("with_draft_probs", [False, True], ids=["no_q", "with_q"])
@pytest.mark.parametrize(("draft", "expected"), GREEDY_TABLE)
def test_greedy_rejection_table(draft: list[int], expected: Verdict, with_draft_probs: bool):
    vocab = 8
    p = one_hot_rows(TARGET_ARGMAX, vocab)
    q = None
    if with_draft_probs:
        # A full-support q: every draft token has positive draft probability.
        q = torch.softmax(torch.randn(len(draft), vocab, generator=torch.Generator().manual_seed(5)), dim=-1)
    assert rejection_sample(p, draft, q, None) == expected


@pytest.mark.parametrize("with_draft_probs", [False, True], ids=["no_q", "with_q"])
def test_greedy_rejection_when_draft_puts_all_mass_on_the_target_token(with_draft_probs: bool):
    # The residual max(0, p - q) vanishes when q is (numerically) one-hot on the
    # target's argmax; the correction must still be the argmax, not NaN.
    vocab = 8
    p = one_hot_rows([4, 6], vocab)
    q = None
    if with_draft_probs:
        q = torch.zeros(1, vocab)
        q[0, 4] = 1.0
        q[0, 2] = 1e-4
    assert rejection_sample(p, [2], q, None) == Verdict(0, 4)


def test_greedy_k0_returns_argmax_of_first_row():
    p = one_hot_rows([6], 8)
    assert rejection_sample(p, [], None, None) == Verdict(0, 6)
    assert rejection_sample(p, [], torch.zeros(0, 8), None) == Verdict(0, 6)


def test_rejection_sample_checks_row_count():
    p = one_hot_rows(TARGET_ARGMAX, 8)
    with pytest.raises(ValueError):
        rejection_sample(p, [3, 5, 1, 7, 2], None, None)
    with pytest.raises(ValueError):
        rejection_sample(p, [3, 5], None, None)


def test_greedy_pipeline_from_logits():
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(4, 30, generator=gen)
    argmax = logits.argmax(dim=-1).tolist()
    probs = probabilities(logits, [GREEDY] * 4)
    wrong = (argmax[1] + 1) % 30
    assert rejection_sample(probs, [argmax[0], wrong, argmax[2]], None, None) == Verdict(1, argmax[1])
    assert rejection_sample(probs, argmax[:3], None, None) == Verdict(3, argmax[3])


def test_a_deferred_verdict_is_the_verdict_left_on_the_device():
    """What the verifier reads back once per batch: the same verdict, drawn from the same generator."""
    gen = torch.Generator().manual_seed(5)
    p = torch.softmax(torch.randn(4, 12, generator=gen), dim=-1)
    q = torch.softmax(torch.randn(3, 12, generator=gen), dim=-1)
    draft = [1, 7, 3]
    for seed in range(20):
        deferred = deferred_verdict(p, torch.tensor(draft), q, torch.Generator().manual_seed(seed))
        assert isinstance(deferred, torch.Tensor) and deferred.shape == (2,)
        assert Verdict(*deferred.tolist()) == rejection_sample(p, draft, q, torch.Generator().manual_seed(seed))
    # Past the last draft (every draft accepted) the residual is p itself: the bonus token's distribution.
    assert torch.allclose(residual(p, draft, q, torch.tensor(3)), p[3])
    assert torch.allclose(residual(p, draft, None, 3), p[3])
    one_hot = residual(p, draft, None, torch.tensor(1))
    assert one_hot[7] == 0 and torch.allclose(one_hot.sum(), torch.tensor(1.0))


# -- rejection_sample: exactness in distribution ---------------------------------------

# p has one impossible token (5); q puts most of its mass where p has little or nothing.
P = torch.tensor([0.35, 0.25, 0.20, 0.15, 0.05, 0.00])
Q = torch.tensor([0.02, 0.03, 0.05, 0.10, 0.30, 0.50])
K = 3
TRIALS = 20_000
MIN_P_VALUE = 1e-3


def chi_square_against_p(counts: Counter[int], label: str) -> None:
    n = sum(counts.values())
    assert n > 500, f"{label}: too few samples ({n}) for the test"
    for t in range(len(P)):
        if P[t] == 0:
            assert counts.get(t, 0) == 0, f"{label}: token {t} has p=0 but was emitted {counts[t]} times"
    support = [t for t in range(len(P)) if P[t] > 0]
    observed = [counts.get(t, 0) for t in support]
    expected = [float(P[t]) * n for t in support]
    result = stats.chisquare(observed, expected)
    assert result.pvalue > MIN_P_VALUE, f"{label}: observed {observed}, expected {expected}, p={result.pvalue:.2e}"


def test_rejection_sampling_emits_target_distribution_with_a_far_draft():
    target = P.expand(K + 1, -1).contiguous()
    draft_probs = Q.expand(K, -1).contiguous()
    by_position: list[Counter[int]] = [Counter() for _ in range(K + 1)]
    accepted: Counter[int] = Counter()
    for trial in range(TRIALS):
        gen = torch.Generator().manual_seed(trial)
        draft = torch.multinomial(Q, K, replacement=True, generator=gen).tolist()
        verdict = rejection_sample(target, draft, draft_probs, gen)
        assert 0 <= verdict.num_accepted <= K
        emitted = [*draft[: verdict.num_accepted], verdict.next_token]
        for pos, token in enumerate(emitted):
            by_position[pos][token] += 1
        accepted[verdict.num_accepted] += 1
    # The draft is bad: it is accepted with probability sum(min(p, q)) = 0.25 per position.
    acceptance = sum(min(float(a), float(b)) for a, b in zip(P, Q, strict=True))
    assert accepted[0] / TRIALS == pytest.approx(1 - acceptance, abs=0.02)
    assert sum(by_position[0].values()) == TRIALS
    chi_square_against_p(by_position[0], "first emitted token")
    chi_square_against_p(by_position[1], "second emitted token")
    chi_square_against_p(by_position[2], "third emitted token")


@pytest.mark.parametrize("draft_token", [4, 5, 0])
def test_rejection_sampling_with_a_deterministic_draft_emits_target_distribution(draft_token: int):
    # draft_probs=None: every draft token had probability 1 (q one-hot).
    target = P.expand(K + 1, -1).contiguous()
    draft = [draft_token] * K
    first: Counter[int] = Counter()
    trials = TRIALS // 2
    for trial in range(trials):
        gen = torch.Generator().manual_seed(trial)
        verdict = rejection_sample(target, draft, None, gen)
        if P[draft_token] == 0:
            assert verdict.num_accepted == 0
        first[draft[0] if verdict.num_accepted else verdict.next_token] += 1
    chi_square_against_p(first, f"first emitted token, draft always {draft_token}")


def test_rejection_sampling_when_draft_equals_target_accepts_everything():
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(K + 1, 10, generator=gen), dim=-1)
    for trial in range(200):
        g = torch.Generator().manual_seed(trial)
        draft = [int(torch.multinomial(p[i], 1, generator=g)) for i in range(K)]
        verdict = rejection_sample(p, draft, p[:K].clone(), g)
        assert verdict.num_accepted == K
        assert 0 <= verdict.next_token < 10


# -- seeded determinism -----------------------------------------------------------


def run_seeded(seed: int, ks: list[int]) -> list[int]:
    """Tokens of one seeded sequence verified in blocks of ks[r] drafts with the Gumbel-max coupling.

    p and q at output position i depend on i and on the previous token, as a
    model's would; the drafts come from q with the same keyed noise.
    """
    setup = torch.Generator().manual_seed(2024)  # fixed tables, independent of `seed`
    vocab, length = 12, 40
    p = torch.softmax(torch.randn(length + 9, vocab, vocab, generator=setup) * 2, dim=-1)
    q = torch.softmax(torch.randn(length + 9, vocab, vocab, generator=setup) * 2, dim=-1)
    out: list[int] = []
    for k in ks:
        if len(out) >= length:
            break
        pos, prev = len(out), out[-1] if out else 0
        draft: list[int] = []
        for j in range(k):
            keys = position_keys(seed, pos + j, 1, torch.device("cpu"))
            draft.append(int(gumbel_argmax(q[pos + j, prev][None], keys)[0]))
            prev = draft[-1]
        rows = torch.stack([p[pos + j, t] for j, t in enumerate([out[-1] if out else 0, *draft])])
        targets = gumbel_argmax(rows, position_keys(seed, pos, k + 1, torch.device("cpu"))).tolist()
        verdict = coupled_verdict(targets, draft)
        out += [*draft[: verdict.num_accepted], verdict.next_token]
    return out[:length]


def test_same_seed_gives_the_same_tokens_whatever_the_block_sizes():
    rng = random.Random(0)
    target_only = run_seeded(7, [0] * 40)
    assert len(target_only) == 40
    for ks in ([1] * 40, [4] * 40, [8] * 40, [rng.randint(0, 8) for _ in range(40)]):
        assert run_seeded(7, ks) == target_only
    assert run_seeded(123456789, [3] * 40) == run_seeded(123456789, [0] * 40)


def test_different_seeds_give_different_tokens():
    base = run_seeded(7, [2] * 40)
    assert run_seeded(8, [2] * 40) != base
    assert run_seeded(9, [2] * 40) != base


@pytest.mark.parametrize(
    ("targets", "draft", "expected"),
    [
        ([3, 5, 1], [3, 5], Verdict(2, 1)),
        ([3, 5, 1], [3, 4], Verdict(1, 5)),
        ([3, 5, 1], [2, 5], Verdict(0, 3)),
        ([6], [], Verdict(0, 6)),
    ],
)
def test_coupled_verdict(targets: list[int], draft: list[int], expected: Verdict):
    assert coupled_verdict(targets, draft) == expected


def test_coupled_verdict_checks_row_count():
    with pytest.raises(ValueError):
        coupled_verdict([1, 2], [1, 2])


def test_make_generator():
    cpu = torch.device("cpu")
    assert make_generator(GREEDY, cpu) is None
    assert make_generator(SamplingParams(temperature=0.0, seed=3), cpu) is None
    # Seeded sequences draw keyed noise, not from a generator.
    assert make_generator(SamplingParams(seed=5), cpu) is None
    # Unseeded: each call (each service) gets its own independent stream.
    c = make_generator(SamplingParams(seed=None), cpu)
    d = make_generator(SamplingParams(seed=None), cpu)
    assert c is not None and d is not None
    assert not torch.equal(torch.rand(16, generator=c), torch.rand(16, generator=d))


def test_seeded_property():
    assert SamplingParams(seed=0).seeded
    assert not SamplingParams().seeded
    assert not SamplingParams(temperature=0.0, seed=3).seeded


def test_sample_greedy_and_seeded():
    probs = torch.tensor([0.1, 0.6, 0.3])
    assert sample(probs, None) == 1
    draws = [sample(probs, torch.Generator().manual_seed(s)) for s in range(300)]
    assert set(draws) == {0, 1, 2}
    assert draws == [sample(probs, torch.Generator().manual_seed(s)) for s in range(300)]
    assert sample(torch.tensor([0.0, 0.0, 1.0]), torch.Generator().manual_seed(0)) == 2


# -- truncate --------------------------------------------------------------------


@pytest.mark.parametrize("max_support", [1, 3, 10, 40, 1000])
def test_truncate_keeps_top_n_renormalised(max_support: int):
    gen = torch.Generator().manual_seed(17)
    vocab = 40
    probs = torch.softmax(torch.randn(5, vocab, generator=gen) * 2, dim=-1)
    ids, top = truncate(probs, max_support)
    s = min(max_support, vocab)
    assert ids.shape == top.shape == (5, s)
    torch.testing.assert_close(top.sum(dim=-1), torch.ones(5))
    for row in range(5):
        expected_ids = set(probs[row].argsort(descending=True)[:s].tolist())
        assert set(ids[row].tolist()) == expected_ids
        # Proportional to the original probabilities.
        kept = probs[row, ids[row]]
        torch.testing.assert_close(top[row], kept / kept.sum())
        # Sorted by decreasing probability.
        assert torch.all(top[row][:-1] >= top[row][1:])


def test_truncate_of_one_hot_has_zero_tail():
    probs = torch.zeros(1, 10)
    probs[0, 7] = 1.0
    ids, top = truncate(probs, 3)
    assert int(ids[0, 0]) == 7
    assert top[0].tolist() == [1.0, 0.0, 0.0]


# -- validate_sampling ----------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=2.5, top_p=1.0, top_k=0),
        SamplingParams(temperature=0.7, top_p=0.01, top_k=1),
        SamplingParams(temperature=1.0, top_p=0.9, top_k=100000, seed=-1),
        SamplingParams(temperature=1.0, min_p=0.0),
        SamplingParams(temperature=1.0, min_p=1.0),
    ],
    ids=repr,
)
def test_validate_sampling_accepts(params: SamplingParams):
    assert validate_sampling(params) is None


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (SamplingParams(temperature=-0.1), "temperature"),
        (SamplingParams(temperature=-math.inf), "temperature"),
        (SamplingParams(temperature=math.nan), "temperature"),
        (SamplingParams(top_p=0.0), "top_p"),
        (SamplingParams(top_p=-0.5), "top_p"),
        (SamplingParams(top_p=1.0001), "top_p"),
        (SamplingParams(top_p=math.nan), "top_p"),
        (SamplingParams(top_k=-1), "top_k"),
        (SamplingParams(min_p=-0.1), "min_p"),
        (SamplingParams(min_p=1.5), "min_p"),
        (SamplingParams(min_p=math.nan), "min_p"),
    ],
    ids=repr,
)
def test_validate_sampling_rejects(params: SamplingParams, field: str):
    reason = validate_sampling(params)
    assert reason is not None
    assert field in reason


def test_greedy_property():
    assert SamplingParams(temperature=0.0).greedy
    # Below 1e-5 float32 logits / temperature would overflow: treated as greedy, as vLLM does.
    assert SamplingParams(temperature=1e-6).greedy
    assert SamplingParams(temperature=1e-38).greedy
    assert not SamplingParams(temperature=1e-4).greedy
    assert not SamplingParams().greedy


def test_every_sampling_field_crosses_the_wire():
    from specd.rpc.serving import sampling_from_pb, sampling_pb

    params = SamplingParams(temperature=0.75, top_p=0.875, top_k=12, seed=99, min_p=0.25)
    assert sampling_from_pb(sampling_pb(params)) == params


def test_sample_draws_from_p_and_never_a_zero_probability_token():
    gen = torch.Generator().manual_seed(11)
    p = torch.rand(60, generator=gen) ** 3
    p[[0, 7, 30, 58, 59]] = 0.0
    p /= p.sum()
    draws = Counter(sample(p, gen) for _ in range(30000))
    assert not {0, 7, 30, 58, 59} & set(draws)
    support = (p > 0).nonzero().flatten().tolist()
    observed = [draws.get(t, 0) for t in support]
    expected = [float(p[t]) * 30000 for t in support]
    assert stats.chisquare(observed, [e * sum(observed) / sum(expected) for e in expected]).pvalue > 1e-4


def test_sample_at_the_top_of_the_uniform_lands_on_the_last_possible_token(monkeypatch):
    p = torch.tensor([0.25, 0.5, 0.25, 0.0, 0.0])
    # The largest uniform below 1, times a total that rounds to it: past the CDF's end.
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.tensor(1.0))
    assert sample(p, torch.Generator()) == 2


def test_greedy_tokens_are_torchs_argmax_ties_nan_and_views_included() -> None:
    """The verifier's greedy verdicts through numpy on the CPU: the same ids as torch's argmax,
    the first of tied maxima and the first NaN included, on rows that are views of a block."""
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        logits = torch.randn(6, 4099, generator=g).to(dtype)
        logits[1, [5, 900, 4000]] = logits[1].max() + 1  # a three-way tie for the largest
        logits[2, [17, 3000]] = float("nan")
        logits[3] = float("-inf")
        logits[3, [8, 9]] = 0.0
        logits[4, :] = 1.0  # every id ties
        for block in (logits, logits[1:5], logits[:, :4000], logits.t().contiguous().t()):
            got = greedy_tokens(block)
            assert got.dtype == torch.int64 and got.device == block.device
            assert got.tolist() == block.argmax(dim=-1).tolist()
        assert greedy_tokens(logits).tolist()[1:5] == [5, 17, 8, 0]
