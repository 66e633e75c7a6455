from __future__ import annotations

import math

import pytest
import torch
from tinymodels import backed_kv_bytes, device_under_test

from drafter_service.engine import ModelDrafter, default_branch_slots
from drafter_service.ngram_engine import NgramDrafter
from drafter_service.suffix_engine import SuffixDrafter
from specd.engine.errors import EngineError, ErrorKind
from specd.engine.params import SamplingParams
from specd.engine.tasks import DraftTask, SequenceSpec, SparseDist, VerifyTask
from verifier_service.engine import PROB_SUM_TOLERANCE, VerifierEngine

GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, seed=1)
MAX_SEQUENCES = 3
MAX_CONTEXT = 64
MAX_DRAFT = 8
ENGINE_KINDS = ["verifier", "drafter", "ngram", "suffix"]
PROMPT = [11, 22, 33, 44, 55, 11, 22]

Engine = VerifierEngine | ModelDrafter | NgramDrafter | SuffixDrafter


@pytest.fixture
def engines(make_verifier, make_drafter, make_ngram, make_suffix) -> dict[str, Engine]:
    limits = {"max_sequences": MAX_SEQUENCES, "max_context": MAX_CONTEXT, "max_draft_tokens": MAX_DRAFT}
    return {
        "verifier": make_verifier(**limits),
        "drafter": make_drafter(**limits),
        "ngram": make_ngram(**limits),
        "suffix": make_suffix(**limits),
    }


def open_ok(engine: Engine, *specs: SequenceSpec) -> None:
    errors, _ = engine.open(list(specs))
    assert errors == [None] * len(specs)


def snapshot(engine: Engine, sid: str) -> tuple[list[int], list[int], int]:
    state = engine.table.get(sid)
    return list(state.committed), list(state.cached), state.slot


def run_round(engine: Engine, tasks: list[tuple[str, int, list[int]]]) -> list[EngineError | None]:
    """One round; each task is (sequence_id, num_committed, tokens), where tokens are the
    draft tokens for the verifier and the new committed tokens for a drafter (which is
    asked for 2 draft tokens)."""
    if isinstance(engine, VerifierEngine):
        results, _ = engine.verify([VerifyTask(sid, n, list(tokens)) for sid, n, tokens in tasks])
        return [r.error for r in results]
    proposals, _ = engine.draft([DraftTask(sid, list(tokens), n, 2) for sid, n, tokens in tasks])
    return [p.error for p in proposals]


def kind_of(error: EngineError | None) -> ErrorKind | None:
    return None if error is None else error.kind


# -- per-sequence errors in a round ----------------------------------------------------


@pytest.mark.parametrize("kind", ENGINE_KINDS)
def test_unknown_sequence_is_not_found_and_others_proceed(engines, kind):
    engine = engines[kind]
    open_ok(engine, SequenceSpec("a", PROMPT, GREEDY))
    errors = run_round(engine, [("nope", 1, []), ("a", len(PROMPT), [])])
    assert [kind_of(e) for e in errors] == [ErrorKind.NOT_FOUND, None]
    assert isinstance(errors[0], EngineError) and "nope" in errors[0].message


@pytest.mark.parametrize("kind", ENGINE_KINDS)
def test_duplicate_sequence_in_one_round_fails_only_the_duplicate(engines, kind):
    engine = engines[kind]
    open_ok(engine, SequenceSpec("a", PROMPT, GREEDY), SequenceSpec("b", PROMPT[:3], GREEDY))
    errors = run_round(engine, [("a", len(PROMPT), []), ("a", len(PROMPT), []), ("b", 3, [])])
    assert [kind_of(e) for e in errors] == [None, ErrorKind.INVALID_ARGUMENT, None]
    committed = engine.table.get("a").committed
    if kind == "verifier":
        assert len(committed) == len(PROMPT) + 1  # advanced once, by the first task only
    else:
        assert committed == PROMPT


def test_duplicate_in_one_round_the_first_task_gets_the_proposal(engines):
    drafter = engines["drafter"]
    open_ok(drafter, SequenceSpec("a", PROMPT, GREEDY))
    proposals, timing = drafter.draft([DraftTask("a", [], len(PROMPT), 3), DraftTask("a", [], len(PROMPT), 3)])
    assert len(proposals[0].tokens) == 3 and proposals[0].error is None
    assert proposals[1].tokens == [] and kind_of(proposals[1].error) == ErrorKind.INVALID_ARGUMENT
    assert timing.batch_size == 1


@pytest.mark.parametrize("kind", ENGINE_KINDS)
@pytest.mark.parametrize("delta", [-1, 1, 5])
def test_wrong_num_committed_is_failed_precondition_and_changes_nothing(engines, kind, delta):
    engine = engines[kind]
    open_ok(engine, SequenceSpec("a", PROMPT, GREEDY))
    new = [] if kind == "verifier" else [7, 8]
    expected_n = len(PROMPT) + len(new)
    before = snapshot(engine, "a")
    errors = run_round(engine, [("a", expected_n + delta, new)])
    assert kind_of(errors[0]) == ErrorKind.FAILED_PRECONDITION
    assert snapshot(engine, "a") == before
    # The sequence is still usable with the right count.
    assert run_round(engine, [("a", expected_n, new)]) == [None]


@pytest.mark.parametrize("kind", ENGINE_KINDS)
@pytest.mark.parametrize("bad", ["vocab", "negative"])
def test_token_out_of_vocabulary_is_invalid(engines, vocab_size, kind, bad):
    engine = engines[kind]
    token = vocab_size if bad == "vocab" else -1
    open_ok(engine, SequenceSpec("a", PROMPT, GREEDY))
    before = snapshot(engine, "a")
    n = len(PROMPT) + (0 if kind == "verifier" else 2)
    errors = run_round(engine, [("a", n, [5, token])])
    assert kind_of(errors[0]) == ErrorKind.INVALID_ARGUMENT
    assert snapshot(engine, "a") == before
    # And in a prompt.
    errors, _ = engine.open([SequenceSpec("b", [1, token, 2], GREEDY)])
    assert kind_of(errors[0]) == ErrorKind.INVALID_ARGUMENT
    assert len(engine.table) == 1


def test_verifier_rejects_more_draft_tokens_than_the_limit(engines):
    verifier = engines["verifier"]
    open_ok(verifier, SequenceSpec("a", PROMPT, GREEDY), SequenceSpec("b", PROMPT, GREEDY))
    results, _ = verifier.verify(
        [VerifyTask("a", len(PROMPT), [5] * (MAX_DRAFT + 1)), VerifyTask("b", len(PROMPT), [5] * MAX_DRAFT)]
    )
    assert kind_of(results[0].error) == ErrorKind.INVALID_ARGUMENT
    assert results[1].error is None
    assert len(verifier.table.get("a").committed) == len(PROMPT)


@pytest.mark.parametrize("kind", ["drafter", "ngram", "suffix"])
def test_drafter_rejects_more_draft_tokens_than_the_limit(engines, kind):
    drafter = engines[kind]
    open_ok(drafter, SequenceSpec("a", PROMPT, GREEDY), SequenceSpec("b", PROMPT, GREEDY))
    proposals, _ = drafter.draft(
        [DraftTask("a", [1], len(PROMPT) + 1, MAX_DRAFT + 1), DraftTask("b", [], len(PROMPT), MAX_DRAFT)]
    )
    assert kind_of(proposals[0].error) == ErrorKind.INVALID_ARGUMENT
    assert proposals[1].error is None
    assert drafter.table.get("a").committed == PROMPT
    if kind == "drafter":
        assert len(proposals[1].tokens) == MAX_DRAFT


def test_verifier_rejects_drafts_beyond_the_context_window(engines):
    verifier = engines["verifier"]
    prompt = list(range(10, 10 + MAX_CONTEXT - 3))
    open_ok(verifier, SequenceSpec("a", prompt, GREEDY))
    results, _ = verifier.verify([VerifyTask("a", len(prompt), [5, 6, 7, 8])])
    assert kind_of(results[0].error) == ErrorKind.INVALID_ARGUMENT
    results, _ = verifier.verify([VerifyTask("a", len(prompt), [5, 6, 7])])
    assert results[0].error is None


@pytest.mark.parametrize("kind", ["drafter", "ngram", "suffix"])
def test_drafter_rejects_drafts_beyond_the_context_window(engines, kind):
    drafter = engines[kind]
    prompt = list(range(10, 10 + MAX_CONTEXT - 4))
    open_ok(drafter, SequenceSpec("a", prompt, GREEDY))
    proposals, _ = drafter.draft([DraftTask("a", [1], len(prompt) + 1, 4)])
    assert kind_of(proposals[0].error) == ErrorKind.INVALID_ARGUMENT
    assert drafter.table.get("a").committed == prompt
    proposals, _ = drafter.draft([DraftTask("a", [1], len(prompt) + 1, 3)])
    assert proposals[0].error is None


# -- sparse draft distributions ---------------------------------------------------------

T0, T1 = 100, 200  # the draft tokens
VALID = SparseDist([T1, 300], [0.6, 0.4])


@pytest.mark.parametrize(
    "dists",
    [
        pytest.param([SparseDist([T0, T0], [0.5, 0.5]), VALID], id="repeated-id"),
        pytest.param([SparseDist([T0, 7], [0.7, 0.4]), VALID], id="sum-above-1"),
        pytest.param([SparseDist([T0, 7], [1.0, 0.0]), VALID], id="zero-prob"),
        pytest.param([SparseDist([T0, 7], [1.1, -0.1]), VALID], id="negative-prob"),
        pytest.param([SparseDist([T0], [1.5]), VALID], id="prob-above-1"),
        pytest.param([SparseDist([T0, 7], [0.5, math.nan]), VALID], id="nan-prob"),
        pytest.param([VALID, SparseDist([7, 8], [0.5, 0.5])], id="draft-token-absent"),
        pytest.param([SparseDist([], []), VALID], id="empty"),
        pytest.param([SparseDist([T0, 7], [1.0]), VALID], id="ids-probs-length-mismatch"),
        pytest.param([SparseDist([T0, 7], [0.5, 0.3, 0.2]), VALID], id="probs-ids-length-mismatch"),
        pytest.param([SparseDist([T0, 10**9], [0.5, 0.5]), VALID], id="id-outside-vocab"),
        pytest.param([SparseDist([T0, -3], [0.5, 0.5]), VALID], id="negative-id"),
        pytest.param([SparseDist([T0], [1.0])], id="fewer-dists-than-tokens"),
        pytest.param([SparseDist([T0], [1.0]), VALID, VALID], id="more-dists-than-tokens"),
    ],
)
def test_invalid_sparse_distribution_is_invalid_argument(engines, dists):
    verifier = engines["verifier"]
    open_ok(verifier, SequenceSpec("a", PROMPT, SAMPLED), SequenceSpec("b", PROMPT, SAMPLED))
    before = snapshot(verifier, "a")
    good = VerifyTask("b", len(PROMPT), [T0, T1], [SparseDist([T0], [1.0]), VALID])
    results, _ = verifier.verify([VerifyTask("a", len(PROMPT), [T0, T1], dists), good])
    assert kind_of(results[0].error) == ErrorKind.INVALID_ARGUMENT
    assert results[1].error is None
    assert snapshot(verifier, "a") == before


@pytest.mark.parametrize(
    "first",
    [
        SparseDist([T0], [1.0]),
        SparseDist([7, T0, 9], [0.2, 0.3, 0.5]),
        SparseDist([T0, 7], [0.5, 0.5 + PROB_SUM_TOLERANCE / 2]),  # float slack from another host
    ],
    ids=["one-hot", "three", "within-tolerance"],
)
def test_valid_sparse_distribution_is_accepted(engines, first):
    verifier = engines["verifier"]
    open_ok(verifier, SequenceSpec("a", PROMPT, SAMPLED))
    results, _ = verifier.verify([VerifyTask("a", len(PROMPT), [T0, T1], [first, VALID])])
    assert results[0].error is None
    assert 0 <= results[0].num_accepted <= 2


def test_tiny_positive_temperature_fails_at_most_its_own_sequence(engines):
    verifier = engines["verifier"]
    tiny = SamplingParams(temperature=1e-38, seed=1)
    errors, _ = verifier.open([SequenceSpec("ok", PROMPT, SAMPLED), SequenceSpec("tiny", PROMPT, tiny)])
    assert errors[0] is None
    if errors[1] is not None:  # refusing it at open is a fine fix too
        assert errors[1].kind == ErrorKind.INVALID_ARGUMENT
    tasks = [VerifyTask("ok", len(PROMPT), [5])]
    if errors[1] is None:
        tasks.append(VerifyTask("tiny", len(PROMPT), []))
    results, _ = verifier.verify(tasks)
    assert results[0].error is None
    assert len(verifier.table.get("ok").committed) == len(PROMPT) + 1 + results[0].num_accepted


# -- open / close -------------------------------------------------------------------


@pytest.mark.parametrize("kind", ENGINE_KINDS)
def test_close_unknown_raises_not_found(engines, kind):
    engine = engines[kind]
    with pytest.raises(EngineError) as info:
        engine.close(["never-opened"])
    assert info.value.kind == ErrorKind.NOT_FOUND
    open_ok(engine, SequenceSpec("a", PROMPT, GREEDY))
    assert engine.close(["a"]) == 1
    with pytest.raises(EngineError) as info:
        engine.close(["a"])
    assert info.value.kind == ErrorKind.NOT_FOUND
    assert len(engine.table) == 0


@pytest.mark.parametrize("kind", ENGINE_KINDS)
def test_open_beyond_max_sequences_is_resource_exhausted(engines, kind):
    engine = engines[kind]
    specs = [SequenceSpec(f"s{i}", PROMPT[: i + 1], GREEDY) for i in range(MAX_SEQUENCES + 1)]
    errors, _ = engine.open(specs)
    assert [kind_of(e) for e in errors] == [None] * MAX_SEQUENCES + [ErrorKind.RESOURCE_EXHAUSTED]
    errors, _ = engine.open([SequenceSpec("late", PROMPT, GREEDY)])
    assert kind_of(errors[0]) == ErrorKind.RESOURCE_EXHAUSTED
    # Closing frees the slot for the next sequence.
    freed = engine.table.get("s1").slot
    assert engine.close(["s1"]) == 1
    open_ok(engine, SequenceSpec("late", PROMPT, GREEDY))
    assert engine.table.get("late").slot == freed
    assert len(engine.table) == MAX_SEQUENCES


@pytest.mark.parametrize("kind", ENGINE_KINDS)
def test_open_validation(engines, kind):
    engine = engines[kind]
    open_ok(engine, SequenceSpec("taken", PROMPT, GREEDY))
    specs = [
        SequenceSpec("long", list(range(1, MAX_CONTEXT + 1)), GREEDY),  # prompt too long
        SequenceSpec("fits", list(range(1, MAX_CONTEXT)), GREEDY),
        SequenceSpec("empty", [], GREEDY),
        SequenceSpec("", PROMPT, GREEDY),
        SequenceSpec("taken", PROMPT, GREEDY),  # already open
        SequenceSpec("twice", PROMPT, GREEDY),
        SequenceSpec("twice", PROMPT, GREEDY),  # twice in one call
        SequenceSpec("hot", PROMPT, SamplingParams(temperature=-1.0)),
        SequenceSpec("top_p", PROMPT, SamplingParams(top_p=0.0)),
    ]
    errors, _ = engine.open(specs)
    invalid = ErrorKind.INVALID_ARGUMENT
    assert [kind_of(e) for e in errors] == [invalid, None, invalid, invalid, invalid, None, invalid, invalid, invalid]
    assert sorted(engine.table.seqs) == ["fits", "taken", "twice"]
    assert engine.table.get("taken").committed == PROMPT


# -- end to end, without the network ----------------------------------------------------

TEXTS = [
    "Hello world, this is a test.",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12",
    "a",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):",
    "Speculative decoding splits generation into a cheap draft and an exact verification.",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
]
KS = [1, 4, 8, 1, 4, 8, 0]
NEW_TOKENS = 24


def speculate(
    verifier: VerifierEngine,
    drafter: ModelDrafter | NgramDrafter,
    prompts: dict[str, list[int]],
    ks: dict[str, int],
    params: dict[str, SamplingParams],
    new_tokens: int,
) -> tuple[dict[str, list[int]], int]:
    """Run batched speculative rounds as the gateway would; returns (outputs, accepted drafts)."""
    specs = [SequenceSpec(sid, list(prompt), params[sid]) for sid, prompt in prompts.items()]
    open_ok(verifier, *specs)
    open_ok(drafter, *specs)
    committed = {sid: list(p) for sid, p in prompts.items()}
    unsent: dict[str, list[int]] = {sid: [] for sid in prompts}
    active = sorted(prompts)
    accepted = 0
    while active:
        tasks = [DraftTask(sid, unsent[sid], len(committed[sid]), ks[sid]) for sid in active]
        proposals, _ = drafter.draft(tasks)
        verify = []
        for sid, proposal in zip(active, proposals, strict=True):
            assert proposal.error is None, proposal.error
            assert len(proposal.tokens) <= ks[sid]
            verify.append(VerifyTask(sid, len(committed[sid]), proposal.tokens, proposal.dists))
        results, _ = verifier.verify(verify)
        for task, result in zip(verify, results, strict=True):
            assert result.error is None, result.error
            emitted = [*task.draft_tokens[: result.num_accepted], result.next_token]
            committed[task.sequence_id] += emitted
            unsent[task.sequence_id] = emitted
            accepted += result.num_accepted
        for sid in list(active):
            if len(committed[sid]) - len(prompts[sid]) >= new_tokens:
                active.remove(sid)
                assert verifier.close([sid]) == 1
                assert drafter.close([sid]) == 1
    outputs = {sid: committed[sid][len(prompts[sid]) :][:new_tokens] for sid in prompts}
    return outputs, accepted


@pytest.fixture(scope="module")
def prompts(tok) -> dict[str, list[int]]:
    return {f"p{i}": tok.encode(text) for i, text in enumerate(TEXTS)}


@pytest.fixture(scope="module")
def greedy_reference(tiny_target, prompts) -> dict[str, list[int]]:
    out = {}
    for sid, prompt in prompts.items():
        ids = torch.tensor([prompt])
        generated = tiny_target.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None
        )
        out[sid] = generated[0, len(prompt) :].tolist()
        assert len(out[sid]) == NEW_TOKENS
    return out


@pytest.mark.parametrize("draft", ["tiny_draft", "close_draft", "tiny_target", "ngram", "suffix"])
def test_greedy_speculation_reproduces_target_generate(
    request, make_verifier, make_drafter, make_ngram, make_suffix, prompts, greedy_reference, draft
):
    verifier = make_verifier(max_sequences=len(prompts), max_draft_tokens=8)
    if draft in ("ngram", "suffix"):
        drafter = (make_ngram if draft == "ngram" else make_suffix)(max_sequences=len(prompts), max_draft_tokens=8)
    else:
        drafter = make_drafter(max_sequences=len(prompts), max_draft_tokens=8, model=request.getfixturevalue(draft))
    ks = dict(zip(prompts, KS, strict=True))
    params = dict.fromkeys(prompts, GREEDY)
    outputs, accepted = speculate(verifier, drafter, prompts, ks, params, NEW_TOKENS)
    for sid in prompts:
        assert outputs[sid] == greedy_reference[sid], f"{sid} (k={ks[sid]}) diverged from generate()"
    if draft in ("close_draft", "tiny_target"):
        assert accepted > 0
    if draft == "tiny_target":
        # A drafter identical to the target is always right: every draft is accepted.
        assert accepted >= sum(NEW_TOKENS // (k + 1) * k for k in KS) * 3 // 4
    assert len(verifier.table) == len(drafter.table) == 0


def run_sampled(
    make_verifier, make_drafter, prompts, seeds: dict[str, int], ks: dict[str, int]
) -> dict[str, list[int]]:
    verifier = make_verifier(max_sequences=len(prompts), max_draft_tokens=8)
    drafter = make_drafter(max_sequences=len(prompts), max_draft_tokens=8, max_support=16)
    params = {sid: SamplingParams(temperature=0.8, top_p=0.9, seed=seed) for sid, seed in seeds.items()}
    outputs, _ = speculate(verifier, drafter, {sid: prompts[sid] for sid in seeds}, ks, params, 16)
    return outputs


def test_seeded_sampled_speculation_is_reproducible(make_verifier, make_drafter, prompts):
    ids = list(prompts)[:4]
    ks = dict(zip(ids, [1, 4, 8, 3], strict=True))
    seeds = {sid: 1000 + i for i, sid in enumerate(ids)}
    first = run_sampled(make_verifier, make_drafter, prompts, seeds, ks)
    again = run_sampled(make_verifier, make_drafter, prompts, seeds, ks)
    assert first == again
    other = run_sampled(make_verifier, make_drafter, prompts, {sid: s + 1 for sid, s in seeds.items()}, ks)
    assert all(other[sid] != first[sid] for sid in ids)


def test_seeded_sampled_sequence_does_not_depend_on_its_batch(make_verifier, make_drafter, prompts):
    ids = list(prompts)[:4]
    ks = dict.fromkeys(ids, 4)
    seeds = {sid: 7 + i for i, sid in enumerate(ids)}
    batched = run_sampled(make_verifier, make_drafter, prompts, seeds, ks)
    alone = run_sampled(make_verifier, make_drafter, prompts, {ids[1]: seeds[ids[1]]}, ks)
    assert alone[ids[1]] == batched[ids[1]]


def test_ngram_drafter_proposes_from_the_committed_context(make_ngram):
    drafter = make_ngram(max_draft_tokens=8)
    open_ok(drafter, SequenceSpec("a", [5, 6, 7, 8, 5, 6], GREEDY))
    proposals, timing = drafter.draft([DraftTask("a", [], 6, 3)])
    assert proposals[0].tokens == [7, 8, 5]
    assert proposals[0].dists == []
    assert timing.batch_size == 1
    # New committed tokens extend the context the next proposal looks at.
    proposals, _ = drafter.draft([DraftTask("a", [9, 5, 6, 7], 10, 4)])
    assert proposals[0].tokens == [8, 5, 6, 9]
    assert drafter.table.get("a").committed == [5, 6, 7, 8, 5, 6, 9, 5, 6, 7]
    proposals, _ = drafter.draft([DraftTask("a", [42], 11, 4)])
    assert proposals[0].tokens == []


def test_model_drafter_unseeded_proposals_carry_their_distributions(make_drafter, tiny_draft):
    drafter = make_drafter(max_support=5)
    unseeded = SamplingParams(temperature=0.8, top_p=0.9)
    specs = [SequenceSpec("a", PROMPT, unseeded), SequenceSpec("g", PROMPT, GREEDY), SequenceSpec("s", PROMPT, SAMPLED)]
    open_ok(drafter, *specs)
    proposals, timing = drafter.draft(
        [DraftTask("a", [], len(PROMPT), 4), DraftTask("g", [], len(PROMPT), 2), DraftTask("s", [], len(PROMPT), 3)]
    )
    sampled, greedy, seeded = proposals
    # Seeded drafts are noisy argmaxes that the verifier checks against its own: no q.
    assert len(seeded.tokens) == 3 and seeded.dists == []
    assert len(sampled.tokens) == len(sampled.dists) == 4
    for token, dist in zip(sampled.tokens, sampled.dists, strict=True):
        assert token in dist.token_ids
        assert 1 <= len(dist.token_ids) <= 5
        assert all(p > 0 for p in dist.probs)
        assert sum(dist.probs) == pytest.approx(1.0, abs=1e-5)
    assert len(greedy.tokens) == 2 and greedy.dists == []
    assert timing.batch_size == 3
    # k = 0 asks for nothing and feeds nothing.
    proposals, timing = drafter.draft([DraftTask("a", [], len(PROMPT), 0)])
    assert proposals[0].tokens == [] and proposals[0].error is None
    assert timing.tokens_fed == 0 and timing.batch_size == 0
    state = drafter.table.get("a")
    assert state.cached == state.committed[: len(state.cached)]


def test_a_draft_ahead_guess_is_the_drafters_likeliest_token_and_the_drafts_after_it_are_sampled(make_drafter):
    drafter = make_drafter(max_support=64)
    hot = SamplingParams(temperature=1.5)  # unseeded, and far from one-hot on a random model
    open_ok(drafter, SequenceSpec("a", PROMPT, hot))
    assumed = (7, 8)
    guessed, sampled = [], []
    for _ in range(12):  # the same context each time: the drafter rolls back to the committed tokens
        (guess,), _ = drafter.draft([DraftTask("a", [], len(PROMPT), 3, assumed, guess_first=True)])
        (plain,), _ = drafter.draft([DraftTask("a", [], len(PROMPT), 3, assumed)])
        likeliest = max(zip(guess.dists[0].probs, guess.dists[0].token_ids, strict=True))[1]
        assert guess.tokens[0] == likeliest and len(guess.tokens) == len(guess.dists) == 3
        guessed.append(guess.tokens[0])
        sampled.append((plain.tokens[0], guess.tokens[1]))
    assert len(set(guessed)) == 1
    firsts, seconds = zip(*sampled, strict=True)
    assert len(set(firsts)) > 1 and len(set(seconds)) > 1  # without the flag, and after the guess: samples
    (refused,), _ = drafter.draft([DraftTask("a", [], len(PROMPT), 0, prefill_tokens=4, guess_first=True)])
    assert refused.error is not None and refused.error.kind == ErrorKind.INVALID_ARGUMENT


# -- the memory bound --------------------------------------------------------------------


def cache_tensors(engine: Engine) -> list[torch.Tensor]:
    cache = engine.lm.cache  # type: ignore[union-attr]
    return [t for store in (cache.keys, cache.values) for t in store if t is not None]


@pytest.mark.parametrize("kind", ["verifier", "drafter"])
def test_the_kv_cache_is_reserved_once_at_the_flags_bound(engines, kind):
    engine = engines[kind]
    open_ok(engine, SequenceSpec("a", PROMPT, GREEDY))
    tensors = cache_tensors(engine)
    # A drafter's fan-out branches have slots of their own beside the sequences'.
    slots = MAX_SEQUENCES + engine.table.branch_slots
    # The drafter's default: a slot a sequence on the CPU, a quarter as many where the cache is reserved up front.
    expected = default_branch_slots(MAX_SEQUENCES, device_under_test()) if kind == "drafter" else 0
    assert engine.table.branch_slots == expected
    assert kind == "verifier" or device_under_test().type != "cpu" or expected == MAX_SEQUENCES
    assert tensors and all(t.shape[0] == slots and t.shape[2] == MAX_CONTEXT for t in tensors)
    per_token = engine.table.kv_bytes_per_token()
    assert engine.table.kv_reserved_bytes() == slots * MAX_CONTEXT * per_token
    assert sum(t.numel() * t.element_size() for t in tensors) == engine.table.kv_reserved_bytes()
    assert engine.table.kv_bytes() == backed_kv_bytes(engine.table, len(PROMPT) - 1)  # the prefill's positions
    engine.close(["a"])
    assert engine.table.kv_bytes() == backed_kv_bytes(engine.table, 0)  # a closed sequence's memory goes back


def test_a_sequence_at_the_context_window_beside_long_draft_blocks_neither_grows_nor_moves_the_cache(
    engines, make_verifier
):
    """The padding of its one-token row to the other rows' 9 tokens once doubled the slab."""
    verifier = engines["verifier"]
    long = [(7 * i) % 50 + 1 for i in range(MAX_CONTEXT - 2)]
    open_ok(verifier, SequenceSpec("long", long, GREEDY), SequenceSpec("short", PROMPT, GREEDY))
    where = [t.data_ptr() for t in cache_tensors(verifier)]
    results, _ = verifier.verify(
        [VerifyTask("long", len(long), [5]), VerifyTask("short", len(PROMPT), [1] * MAX_DRAFT)]
    )
    assert [r.error for r in results] == [None, None]
    assert [t.data_ptr() for t in cache_tensors(verifier)] == where
    assert all(t.shape[2] == MAX_CONTEXT for t in cache_tensors(verifier))
    # Token-identical to the same sequence verified alone.
    alone = make_verifier(max_sequences=1, max_context=MAX_CONTEXT, max_draft_tokens=MAX_DRAFT)
    open_ok(alone, SequenceSpec("long", long, GREEDY))
    solo, _ = alone.verify([VerifyTask("long", len(long), [5])])
    assert (solo[0].num_accepted, solo[0].next_token) == (results[0].num_accepted, results[0].next_token)
    # The last position is reachable; one more is refused up front, not grown into.
    n = len(verifier.table.get("long").committed)
    results, _ = verifier.verify([VerifyTask("long", n, [1] * (MAX_CONTEXT - n + 1))])
    assert kind_of(results[0].error) == ErrorKind.INVALID_ARGUMENT
    results, _ = verifier.verify([VerifyTask("long", n, [1] * (MAX_CONTEXT - n))])
    assert results[0].error is None
    assert [t.data_ptr() for t in cache_tensors(verifier)] == where


@pytest.mark.parametrize("kind", ENGINE_KINDS)
def test_an_open_that_cannot_fit_is_refused_before_any_state_changes(engines, kind):
    engine = engines[kind]
    open_ok(engine, SequenceSpec("a", PROMPT, GREEDY))
    errors, _ = engine.open(
        [
            SequenceSpec("too-long", list(range(1, MAX_CONTEXT + 1)), GREEDY),  # no room to generate anything
            SequenceSpec("b", PROMPT, GREEDY),
            SequenceSpec("c", PROMPT, GREEDY),
            SequenceSpec("d", PROMPT, GREEDY),  # past --max-sequences
        ]
    )
    assert [kind_of(e) for e in errors] == [ErrorKind.INVALID_ARGUMENT, None, None, ErrorKind.RESOURCE_EXHAUSTED]
    assert sorted(engine.table.seqs) == ["a", "b", "c"]
    if kind not in ("ngram", "suffix"):
        assert engine.table.kv_bytes() == backed_kv_bytes(engine.table, 3 * (len(PROMPT) - 1))


def test_greedy_drafts_are_read_back_once_a_round_and_match_the_step_by_step_loop(make_drafter, monkeypatch):
    """A greedy batch feeds each step the previous step's choices on the device and reads the
    drafts back once; drafts, cache and fed tokens are those of the loop that reads every step."""
    on_device, stepwise = make_drafter(), make_drafter()
    monkeypatch.setattr(stepwise, "_drafts_stay_on_device", lambda *_: False)
    prompts = {"a": PROMPT, "b": PROMPT[:4], "c": [7, 8, 9, 10, 11, 12, 13, 14, 15]}
    ks = {"a": 4, "b": 1, "c": 3}
    reads = {"n": 0}
    tolist = torch.Tensor.tolist

    def counted(self: torch.Tensor) -> list:
        reads["n"] += 1
        return tolist(self)

    outcomes = []
    for drafter in (on_device, stepwise):
        open_ok(drafter, *(SequenceSpec(sid, p, GREEDY) for sid, p in prompts.items()))
        committed = {sid: len(p) for sid, p in prompts.items()}
        rounds = []
        for new in ({"a": [], "b": [], "c": []}, {"a": [5, 6], "b": [9], "c": [3, 4, 5]}):
            tasks = []
            for sid, tokens in new.items():
                committed[sid] += len(tokens)
                tasks.append(DraftTask(sid, tokens, committed[sid], ks[sid]))
            reads["n"] = 0
            monkeypatch.setattr(torch.Tensor, "tolist", counted)
            proposals, timing = drafter.draft(tasks)
            monkeypatch.setattr(torch.Tensor, "tolist", tolist)
            rounds.append(([p.tokens for p in proposals], timing.tokens_fed, reads["n"]))
        outcomes.append((rounds, {sid: list(drafter.table.get(sid).cached) for sid in prompts}))
    (device_rounds, device_cached), (step_rounds, step_cached) = outcomes
    assert device_cached == step_cached
    for (tokens, fed, device_reads), (want, want_fed, step_reads) in zip(device_rounds, step_rounds, strict=True):
        assert tokens == want and [len(t) for t in tokens] == [4, 1, 3]
        assert fed == want_fed
        assert device_reads == 1 and step_reads == max(ks.values())


def test_the_verifier_judges_a_round_on_one_torch_thread(make_verifier, make_drafter, prompts, monkeypatch):
    # After a CPU forward, its logits work spread over torch's threads would leave them spinning
    # into the next forward; after a GPU forward the host's threads are left as they are.
    import verifier_service.engine as engine

    seen: list[int] = []
    real = engine.probabilities
    monkeypatch.setattr(engine, "probabilities", lambda *a: seen.append(torch.get_num_threads()) or real(*a))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        run_sampled(make_verifier, make_drafter, prompts, {"p0": 5}, {"p0": 3})
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert seen and set(seen) == ({1} if device_under_test().type == "cpu" else {2})
