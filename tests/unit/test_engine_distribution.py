"""End-to-end exactness in distribution through the real drafter and verifier engines.

A tiny random-weight target with a 12-token vocabulary and a perturbed copy as
the drafter, top-k 4 so that the first two tokens have 16 possible values, and a
drafter that keeps only its 2 most likely tokens (its q is truncated, as with
--max-support). Thousands of sequences run the gateway's rounds (draft 2,
verify, repeat until two tokens are out); their first two tokens must follow
the target's own two-token distribution, computed exactly from the target model.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
import tinymodels
import torch
from scipy import stats

from drafter_service.engine import ModelDrafter
from specd.engine import sampling
from specd.engine.kvcache import BatchedCausalLM
from specd.engine.params import SamplingParams
from specd.engine.sampling import probabilities
from specd.engine.tasks import DraftTask, SequenceSpec, VerifyTask
from verifier_service.engine import VerifierEngine

CPU = torch.device("cpu")
VOCAB = 12
PROMPT = [2, 5, 7]
K = 2
MAX_SUPPORT = 2
SEQUENCES = 3000
BATCH = 500
MIN_P_VALUE = 1e-3
DETECTED_P_VALUE = 1e-6

Pairs = list[tuple[int, int]]


@pytest.fixture(scope="module")
def small_target():
    return tinymodels.build_model(0, VOCAB, 0, 1)


@pytest.fixture(scope="module")
def small_draft(small_target):
    return tinymodels.perturbed(small_target, 0.2, seed=1)


def params_for(i: int, seeded: bool) -> SamplingParams:
    return SamplingParams(temperature=1.5, top_k=4, seed=i if seeded else None)


def next_token_probs(model, context: list[int]) -> torch.Tensor:
    """The model's distribution of the token after `context` under the sequences' sampling parameters."""
    with torch.no_grad():
        logits = model(torch.tensor([context])).logits[0, -1:].float()
    return probabilities(logits, [params_for(0, seeded=False)])[0]


def target_joint(small_target) -> dict[tuple[int, int], float]:
    """P(first two tokens = (a, b)) under target-only sampling, from the model itself."""
    out = {}
    first = next_token_probs(small_target, PROMPT)
    for a in first.nonzero().flatten().tolist():
        second = next_token_probs(small_target, [*PROMPT, a])
        for b in second.nonzero().flatten().tolist():
            out[(a, b)] = float(first[a] * second[b])
    assert len(out) == 16
    return out


@pytest.fixture(scope="module")
def joint(small_target) -> dict[tuple[int, int], float]:
    return target_joint(small_target)


def engines(target, draft, max_draft_tokens: int = K) -> tuple[VerifierEngine, ModelDrafter]:
    """`max_draft_tokens`: the drafter's limit, one more than K where it guesses before its drafts."""
    verifier = VerifierEngine(BatchedCausalLM(target, CPU, torch.float32), None, BATCH, 16, K)
    drafter = ModelDrafter(BatchedCausalLM(draft, CPU, torch.float32), None, BATCH, 16, max_draft_tokens, MAX_SUPPORT)
    return verifier, drafter


def open_batch(
    verifier: VerifierEngine, drafter: ModelDrafter, start: int, seeded: bool, shared_stream: bool = False
) -> list[str]:
    """Open sequences start .. start + BATCH - 1 on both services (sequence i seeded with i when seeded).

    Unseeded sequences get fixed, independent generators on each service so the
    test is deterministic; shared_stream gives both the same one, which is the
    bug this suite must catch.
    """
    ids = [f"s{i}" for i in range(start, start + BATCH)]
    specs = [SequenceSpec(sid, list(PROMPT), params_for(start + n, seeded)) for n, sid in enumerate(ids)]
    assert verifier.open(specs)[0] == drafter.open(specs)[0] == [None] * BATCH
    if not seeded:
        for n, sid in enumerate(ids):
            drafter.table.get(sid).generator = torch.Generator().manual_seed(start + n)
            other = start + n if shared_stream else 10**7 + start + n
            verifier.table.get(sid).generator = torch.Generator().manual_seed(other)
    return ids


def first_two(target, draft, seeded: bool, k: int = K, shared_stream: bool = False) -> tuple[Pairs, float]:
    """First two tokens of SEQUENCES sequences in sequential rounds, and the acceptance rate."""
    verifier, drafter = engines(target, draft)
    pairs: Pairs = []
    drafted = accepted = 0
    for start in range(0, SEQUENCES, BATCH):
        ids = open_batch(verifier, drafter, start, seeded, shared_stream)
        out: dict[str, list[int]] = {sid: [] for sid in ids}
        while pending := [sid for sid in ids if len(out[sid]) < 2]:
            n_of = {sid: len(PROMPT) + len(out[sid]) for sid in pending}
            drafts, _ = drafter.draft(
                [DraftTask(sid, out[sid][-1:] if out[sid] else [], n_of[sid], k) for sid in pending]
            )
            tasks = [VerifyTask(sid, n_of[sid], d.tokens, d.dists) for sid, d in zip(pending, drafts, strict=True)]
            results, _ = verifier.verify(tasks)
            for task, result in zip(tasks, results, strict=True):
                assert result.error is None, result.error
                out[task.sequence_id] += [*task.draft_tokens[: result.num_accepted], result.next_token]
                drafted += len(task.draft_tokens)
                accepted += result.num_accepted
        verifier.close(ids)
        drafter.close(ids)
        pairs += [(out[sid][0], out[sid][1]) for sid in ids]
    return pairs, accepted / max(drafted, 1)


def p_value(joint: dict[tuple[int, int], float], pairs: Pairs) -> float:
    """Chi-square of the observed pairs against the joint; 0 when an impossible pair appears."""
    counts = Counter(pairs)
    if any(pair not in joint for pair in counts):
        return 0.0
    cells = sorted(joint)
    scale = len(pairs) / sum(joint.values())
    return float(stats.chisquare([counts[c] for c in cells], [joint[c] * scale for c in cells]).pvalue)


def test_leviathan_rule_through_the_engines_emits_the_target_joint(small_target, small_draft, joint):
    pairs, acceptance = first_two(small_target, small_draft, seeded=False)
    assert p_value(joint, pairs) > MIN_P_VALUE
    assert 0.2 < acceptance < 0.8  # both branches exercised, and the residual matters


def test_coupling_through_the_engines_emits_the_target_only_tokens_of_each_seed(small_target, small_draft, joint):
    speculative, acceptance = first_two(small_target, small_draft, seeded=True)
    target_only, _ = first_two(small_target, small_draft, seeded=True, k=0)
    assert speculative == target_only
    assert p_value(joint, target_only) > MIN_P_VALUE
    assert 0.2 < acceptance < 0.8


# -- the same test, proven able to fail -------------------------------------------------


def draft_row_of_position_0(original: Callable) -> Callable:
    def mutant(target_probs, draft_tokens, draft_probs, position):
        rows = None if draft_probs is None else draft_probs[[0] * len(draft_probs)]
        return original(target_probs, draft_tokens, rows, position)

    return mutant


def test_a_residual_at_the_wrong_position_is_detected_through_the_engines(
    small_target, small_draft, joint, monkeypatch
):
    monkeypatch.setattr(sampling, "residual", draft_row_of_position_0(sampling.residual))
    pairs, _ = first_two(small_target, small_draft, seeded=False)
    assert p_value(joint, pairs) < DETECTED_P_VALUE


def test_a_drafter_sharing_the_verifiers_random_stream_is_detected(small_target, small_draft, joint):
    # The bug of issue 13: both services seeded identical generators from the request's seed.
    pairs, _ = first_two(small_target, small_draft, seeded=False, shared_stream=True)
    assert p_value(joint, pairs) < DETECTED_P_VALUE
