"""Token trees through the VerifierEngine (VerifyTask.draft_parents) and its servicer: a tree whose
accepted path runs through later siblings commits what target-only decoding commits (greedy and
seeded), with the target's logprobs and hidden states of those positions, and leaves the cache as
if the path alone had been fed; bad trees are refused per sequence."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
import torch
from engine_backends import EngineVerifier

from specd.engine import trees
from specd.engine.errors import ErrorKind
from specd.engine.kvcache import BatchedCausalLM
from specd.engine.params import LogprobsRequest, Penalties, SamplingParams
from specd.engine.tasks import SequenceSpec, SparseDist, VerifyResult, VerifyTask
from specd.proto.speculative.v1 import common_pb2, verifier_pb2
from verifier_service.engine import VerifierEngine

GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(temperature=0.9, seed=1234)
PROMPT = [11, 22, 33, 44, 55, 11, 22]
ROUNDS = 5
WRONG = 3  # a token offset that makes a draft differ from the target's token


def target_only(engine: VerifierEngine, spec: SequenceSpec, count: int) -> tuple[list[int], list[VerifyResult]]:
    """`count` tokens of target-only decoding (rounds without drafts), and each round's result."""
    assert engine.open([spec])[0] == [None]
    out: list[int] = []
    results: list[VerifyResult] = []
    while len(out) < count:
        (result,), _ = engine.verify(
            [VerifyTask(spec.sequence_id, len(spec.prompt) + len(out), [], return_hidden=True)]
        )
        assert result.error is None, result.error
        out.append(result.next_token)
        results.append(result)
    return out, results


def tree_for(expected: list[int], vocab: int, shape: int) -> tuple[list[int], list[int], list[int]]:
    """(drafts, parents, the accepted path) of a tree whose path to the target's tokens `expected`
    runs through a later sibling at every level but the last: each level offers a wrong token first."""
    wrong = [(t + WRONG) % vocab for t in expected]
    if shape == 0:  # nothing right at the root: two wrong siblings
        return [wrong[0], (wrong[0] + 1) % vocab], [-1, -1], []
    drafts, parents, path = [wrong[0], expected[0]], [-1, -1], [1]
    for depth in range(1, shape):
        drafts += [wrong[depth], expected[depth]]
        parents += [path[-1], path[-1]]
        path.append(len(drafts) - 1)
    drafts.append(wrong[shape])  # a wrong leaf under the last accepted node: the target's token is next
    parents.append(path[-1])
    return drafts, parents, path


def tree_decode(
    engine: VerifierEngine, spec: SequenceSpec, expected: list[int]
) -> tuple[list[int], list[VerifyResult]]:
    """Decode with trees built from `expected`, checking each verdict's path; the tokens committed."""
    assert engine.open([spec])[0] == [None]
    out: list[int] = []
    results: list[VerifyResult] = []
    for shape in (2, 0, 3, 1, 2):
        drafts, parents, path = tree_for(expected[len(out) :], engine.lm.vocab_size, shape)
        task = VerifyTask(
            spec.sequence_id, len(spec.prompt) + len(out), drafts, return_hidden=True, draft_parents=parents
        )
        (result,), _ = engine.verify([task])
        assert result.error is None, result.error
        assert (result.accepted_path, result.num_accepted) == (path, len(path))
        out += [drafts[i] for i in path] + [result.next_token]
        results.append(result)
    return out, results


@pytest.fixture
def verifiers(make_verifier) -> Callable[[], VerifierEngine]:
    return lambda: make_verifier(max_sequences=4, max_context=128, max_draft_tokens=8)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_tree_verify_commits_the_target_only_tokens_logprobs_and_hidden_states(verifiers, params):
    spec = SequenceSpec("s", PROMPT, params, logprobs=LogprobsRequest(top=2))
    expected, reference = target_only(verifiers(), spec, 20)
    engine = verifiers()
    got, results = tree_decode(engine, spec, expected)
    assert got == expected[: len(got)] and len(got) > ROUNDS
    # The compacted cache serves what follows: target-only rounds go on as from scratch.
    state = engine.table.get("s")
    for n in range(len(got), len(expected)):
        (result,), _ = engine.verify([VerifyTask("s", len(PROMPT) + n, [])])
        assert result.next_token == expected[n]
    assert len(state.committed) == len(PROMPT) + len(expected)
    want_lp = [lp for r in reference for lp in r.logprobs][: len(got)]
    got_lp = [lp for r in results for lp in r.logprobs]
    assert [lp.token_id for lp in got_lp] == got
    torch.testing.assert_close(
        torch.tensor([lp.logprob for lp in got_lp]), torch.tensor([lp.logprob for lp in want_lp]), atol=1e-4, rtol=0
    )
    assert [lp.top_ids for lp in got_lp] == [lp.top_ids for lp in want_lp]
    # Hidden states: the rows of the positions each round kept, as target-only rounds give them.
    want_rows = {r.hidden_start: r.hidden[0] for r in reference if r.hidden is not None}
    for r in results:
        assert r.hidden is not None and r.hidden.shape[0] == 1 + r.num_accepted
        for j in range(r.hidden.shape[0]):
            torch.testing.assert_close(r.hidden[j].float(), want_rows[r.hidden_start + j].float(), atol=2e-2, rtol=0)


def test_without_compaction_the_next_round_differs(verifiers, monkeypatch):
    """The check above can fail: leave the path's keys where the tree wrote them."""
    spec = SequenceSpec("s", PROMPT, GREEDY, logprobs=LogprobsRequest())
    expected, reference = target_only(verifiers(), spec, 4)
    engine = verifiers()
    monkeypatch.setattr(engine.lm.cache, "compact", lambda slot, start, kept: None)
    assert engine.open([spec])[0] == [None]
    drafts, parents, path = tree_for(expected, engine.lm.vocab_size, 2)
    (first,), _ = engine.verify([VerifyTask("s", len(PROMPT), drafts, draft_parents=parents)])
    assert first.accepted_path == path  # the round itself does not read the keys it moves
    (after,), _ = engine.verify([VerifyTask("s", len(PROMPT) + 3, [])])
    assert abs(after.logprobs[0].logprob - reference[3].logprobs[0].logprob) > 1e-3


def test_unseeded_sampled_trees_commit_a_path_of_the_tree(verifiers):
    """The multi-candidate rule in the engine (its distribution: test_tree_sampling): each round
    commits a path from the root and the token after it, and paths through siblings are taken."""
    expected, _ = target_only(verifiers(), SequenceSpec("ref", PROMPT, GREEDY), 12)
    engine = verifiers()
    spec = SequenceSpec("s", PROMPT, SamplingParams(temperature=0.3))
    vocab = engine.lm.vocab_size
    drafts, parents, _ = tree_for(expected, vocab, 3)
    dists = [SparseDist([t, (t + 1) % vocab], [0.5, 0.5]) for t in drafts]
    paths = set()
    for trial in range(20):  # the same first round of a fresh sequence, each with its own generator
        assert engine.open([spec])[0] == [None]
        engine.table.get("s").generator = torch.Generator(device=engine.lm.device).manual_seed(trial)
        (result,), _ = engine.verify([VerifyTask("s", len(PROMPT), drafts, dists, draft_parents=parents)])
        assert result.error is None, result.error
        path = result.accepted_path
        assert not path or path == trees.path_to(parents, path[-1])
        assert engine.table.get("s").committed == PROMPT + [drafts[i] for i in path] + [result.next_token]
        paths.add(tuple(path))
        engine.close(["s"])
    assert len(paths) > 1 and any(len(p) > 1 for p in paths)


def test_a_chain_beside_a_tree_is_verified_as_alone(verifiers):
    """One forward, a chain and a tree: the chain's result is the one it gets on its own."""
    alone = verifiers()
    alone.open([SequenceSpec("c", PROMPT, GREEDY, logprobs=LogprobsRequest())])
    (want,), _ = alone.verify([VerifyTask("c", len(PROMPT), [1, 2, 3])])
    engine = verifiers()
    engine.open([SequenceSpec("c", PROMPT, GREEDY, logprobs=LogprobsRequest()), SequenceSpec("t", PROMPT[:4], GREEDY)])
    (chain, tree), _ = engine.verify(
        [VerifyTask("c", len(PROMPT), [1, 2, 3]), VerifyTask("t", 4, [1, 2, 3, 4], draft_parents=[-1, -1, 0, 1])]
    )
    assert tree.error is None and chain.error is None
    assert (chain.num_accepted, chain.next_token, chain.accepted_path) == (want.num_accepted, want.next_token, [])
    torch.testing.assert_close(
        torch.tensor([lp.logprob for lp in chain.logprobs]), torch.tensor([lp.logprob for lp in want.logprobs])
    )


BAD_TREES = [
    ([-1, 0], "2 draft parents for 3"),
    ([-1, 1, 0], "node 1 has parent 1"),
    ([-1, 0, 3], "node 2 has parent 3"),
    ([-2, 0, 1], "node 0 has parent -2"),
]


@pytest.mark.parametrize(("parents", "why"), BAD_TREES)
def test_a_malformed_tree_is_invalid_and_others_proceed(verifiers, parents, why):
    engine = verifiers()
    engine.open([SequenceSpec("a", PROMPT, GREEDY), SequenceSpec("b", PROMPT, GREEDY)])
    (bad, good), _ = engine.verify(
        [VerifyTask("a", len(PROMPT), [1, 2, 3], draft_parents=parents), VerifyTask("b", len(PROMPT), [1, 2, 3])]
    )
    assert bad.error is not None and bad.error.kind == ErrorKind.INVALID_ARGUMENT and why in bad.error.message
    assert good.error is None
    assert engine.table.get("a").committed == PROMPT


@pytest.mark.parametrize(
    "spec",
    [
        SequenceSpec("p", PROMPT, GREEDY, penalties=Penalties.of(presence=0.5)),
        SequenceSpec("p", PROMPT, GREEDY, penalties=Penalties.of(repetition=1.2)),
        SequenceSpec("p", PROMPT, GREEDY, penalties=Penalties.of(bias={5: 2.0})),
    ],
    ids=["presence", "repetition", "logit_bias"],
)
def test_a_tree_for_a_penalized_sequence_is_invalid(verifiers, spec):
    engine = verifiers()
    assert engine.open([spec])[0] == [None]
    (result,), _ = engine.verify([VerifyTask("p", len(PROMPT), [1, 2], draft_parents=[-1, -1])])
    assert result.error is not None and result.error.kind == ErrorKind.INVALID_ARGUMENT
    assert "penalties" in result.error.message
    (chain,), _ = engine.verify([VerifyTask("p", len(PROMPT), [1, 2])])
    assert chain.error is None  # a chain is fine


def test_a_tree_for_a_sequence_with_a_grammar_is_invalid(tiny_target, fingerprint, grammars):
    lm = BatchedCausalLM(tiny_target, torch.device("cpu"), torch.float32)
    engine = VerifierEngine(lm, fingerprint, 2, 128, 8, grammars=grammars)
    assert engine.open([SequenceSpec("g", PROMPT, GREEDY, json_schema='{"type": "object"}')])[0] == [None]
    (result,), _ = engine.verify([VerifyTask("g", len(PROMPT), [1, 2], draft_parents=[-1, -1])])
    assert result.error is not None and result.error.kind == ErrorKind.INVALID_ARGUMENT
    assert "grammar" in result.error.message


def test_a_prefill_task_with_parents_is_invalid(verifiers):
    engine = verifiers()
    assert engine.open([SequenceSpec("a", PROMPT, GREEDY, prefill_tokens=2)])[0] == [None]
    (result,), _ = engine.verify([VerifyTask("a", len(PROMPT), [], prefill_tokens=2, draft_parents=[-1])])
    assert result.error is not None and result.error.kind == ErrorKind.INVALID_ARGUMENT


# -- through the servicer ------------------------------------------------------------------


def test_the_servicer_maps_parents_in_and_the_path_out(verifiers):
    expected, _ = target_only(verifiers(), SequenceSpec("ref", PROMPT, GREEDY), 3)
    asyncio.run(_servicer_round(verifiers(), expected))


async def _servicer_round(engine: VerifierEngine, expected: list[int]) -> None:
    backend = EngineVerifier(engine, 4)
    try:
        greedy = common_pb2.SamplingParams(top_p=1.0)  # temperature 0
        opened = await backend.open(
            [common_pb2.SequenceSpec(sequence_id=sid, prompt_token_ids=PROMPT, sampling=greedy) for sid in "ab"]
        )
        assert not any(r.HasField("error") for r in opened), opened
        drafts, parents, path = tree_for(expected, engine.lm.vocab_size, 2)
        tasks = [
            verifier_pb2.VerifyTask(
                sequence_id="a", num_committed=len(PROMPT), draft_token_ids=drafts, draft_parents=parents
            ),
            verifier_pb2.VerifyTask(
                sequence_id="b", num_committed=len(PROMPT), draft_token_ids=[1, 2], draft_parents=[-1, 5]
            ),
        ]
        reply = await backend.verify(verifier_pb2.VerifyRequest(round_id=1, tasks=tasks))
        a, b = reply.results
        assert not a.HasField("error")
        assert list(a.accepted_path) == path and a.num_accepted == len(path)
        assert a.next_token_id == expected[len(path)]
        assert b.error.code == common_pb2.ERROR_CODE_INVALID_ARGUMENT and not b.accepted_path
    finally:
        backend.runner.shutdown()
