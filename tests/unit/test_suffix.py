"""The suffix drafter: its tries (specd.engine.suffix) and its engine (drafter_service.suffix_engine),
exact like every drafter, greedy with token trees and seeded sampled with point-mass q."""

from __future__ import annotations

import pytest
import torch

from gateway.round.messages import tree_problem
from specd.engine import suffix
from specd.engine.errors import EngineError, ErrorKind
from specd.engine.params import SamplingParams
from specd.engine.tasks import DraftTask, SequenceSpec, VerifyTask

GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=3)
NEW_TOKENS = 24


def open_ok(engine, *specs: SequenceSpec) -> None:
    errors, _ = engine.open(list(specs))
    assert errors == [None] * len(specs)


def total(trie: suffix.SuffixTrie) -> int:
    return sum(trie.count[1:])


# -- the trie ------------------------------------------------------------------------------


def test_each_new_token_counts_only_the_suffixes_that_end_at_it():
    trie = suffix.SuffixTrie(depth=4)
    active = trie.extend([], list(range(50)))
    before = total(trie)
    # One token after 50 touches the 4 suffixes (lengths 1..4) that end at it: no rescan.
    active = trie.extend(active, [7])
    assert total(trie) - before == 4
    assert [trie.level[n] for n in active] == [1, 2, 3, 4]


def test_counts_are_occurrences_and_removal_frees_every_node():
    trie = suffix.SuffixTrie(depth=3)
    trie.extend([], [1, 2, 1, 2, 1])
    pair = trie.children[trie.children[suffix.ROOT][1]][2]
    assert trie.count[pair] == 2  # [1, 2] twice
    assert trie.count[trie.children[suffix.ROOT][1]] == 3
    other = [9, 1, 2, 8]
    trie.extend([], other)
    assert trie.count[pair] == 3
    trie.remove([1, 2, 1, 2, 1])
    assert trie.count[pair] == 1
    trie.remove(other)
    assert trie.nodes == 1 and not trie.children[suffix.ROOT]


def test_the_continuation_is_the_most_frequent_then_the_most_recent():
    trie = suffix.SuffixTrie(depth=8)
    # [1, 2] -> 3 twice, -> 4 once (most recently): frequency wins, unlike prompt lookup.
    active = trie.extend([], [1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 2])
    node, match = suffix.deepest(trie, active)
    assert match == 2  # [4, 1, 2] occurs only at the end: [1, 2] is the longest match
    draft = suffix.continue_from(trie, node, 1, suffix.Limits(), match)
    assert draft.chain == [3]


def test_a_short_match_drafts_little_and_unlikely_drafts_are_cut():
    trie = suffix.SuffixTrie(depth=8)
    active = trie.extend([], [5, 6, 7, 8, 9, 10, 5])
    node, match = suffix.deepest(trie, active)
    assert match == 1
    assert suffix.continue_from(trie, node, 8, suffix.Limits(factor=2.0), match).chain == [6, 7]
    assert suffix.continue_from(trie, node, 8, suffix.Limits(factor=5.0), match).chain == [6, 7, 8, 9, 10]
    trie = suffix.SuffixTrie(depth=8)
    active = trie.extend([], [1, 2, 1, 3, 1, 4, 1])  # 1 -> 2, 3, 4: each a third
    node, match = suffix.deepest(trie, active)
    assert suffix.continue_from(trie, node, 4, suffix.Limits(factor=4.0, min_prob=0.3), match).chain == [4, 1]
    assert suffix.continue_from(trie, node, 4, suffix.Limits(factor=4.0, min_prob=0.4), match).chain == []


def test_the_lru_keeps_the_latest_responses():
    shared = suffix.GlobalTrie(depth=4, capacity=2)
    shared.add([1, 2, 3])
    shared.add([4, 5, 6])
    shared.add([7, 8, 9])
    fresh = suffix.SuffixTrie(depth=4)
    fresh.extend([], [4, 5, 6])
    fresh.extend([], [7, 8, 9])
    assert shared.trie.nodes == fresh.nodes
    assert 1 not in shared.trie.children[suffix.ROOT]


# -- the drafter ---------------------------------------------------------------------------


def test_it_proposes_from_the_committed_context(make_suffix):
    drafter = make_suffix(max_draft_tokens=8)
    open_ok(drafter, SequenceSpec("a", [5, 6, 7, 8, 5, 6], GREEDY))
    proposals, timing = drafter.draft([DraftTask("a", [], 6, 3)])
    assert proposals[0].tokens == [7, 8, 5]
    assert proposals[0].dists == [] and proposals[0].parents == []
    assert timing.batch_size == 1
    proposals, _ = drafter.draft([DraftTask("a", [9, 5, 6, 7], 10, 4)])
    assert proposals[0].tokens == [8, 5, 6, 9]
    assert drafter.table.get("a").committed == [5, 6, 7, 8, 5, 6, 9, 5, 6, 7]
    proposals, _ = drafter.draft([DraftTask("a", [42], 11, 4)])
    assert proposals[0].tokens == []
    # Drafting after assumed tokens (draft-ahead) matches them too, and counts none of them.
    proposals, _ = drafter.draft([DraftTask("a", [], 11, 2, (5, 6, 7, 8))])
    assert proposals[0].tokens == [5, 6]
    assert drafter.table.get("a").committed[-1] == 42


def test_a_greedy_sequence_gets_the_runners_up_as_siblings(make_suffix):
    drafter = make_suffix(max_draft_tokens=4)
    # After [1, 2]: 3 twice, 9 once; after [1, 2, 3, 4]: 5 once, 6 once (more recently).
    prompt = [1, 2, 3, 4, 5, 1, 2, 3, 4, 6, 1, 2, 9, 4, 7, 1, 2]
    open_ok(drafter, SequenceSpec("g", prompt, GREEDY), SequenceSpec("s", prompt, SEEDED))
    tasks = [DraftTask(sid, [], len(prompt), 4, num_siblings=2) for sid in ("g", "s")]
    greedy, sampled = drafter.draft(tasks)[0]
    assert greedy.tokens == [3, 4, 6, 1, 9, 5]
    assert greedy.parents == [-1, 0, 1, 2, -1, 1]
    assert tree_problem(greedy.parents, len(greedy.tokens)) == ""
    # A sampled sequence's drafts are a point mass each: a chain, no alternatives.
    assert sampled.tokens == [3, 4, 6, 1] and sampled.parents == []


def test_a_closed_response_drafts_for_its_tenant_only(make_suffix):
    drafter = make_suffix(max_draft_tokens=4)
    response = [40, 41, 42, 43, 44]
    open_ok(drafter, SequenceSpec("a", [1, 2, 3], GREEDY, tenant="k1"))
    drafter.draft([DraftTask("a", response, 8, 0)])
    assert drafter.close(["a"]) == 1
    for sid, tenant in (("same", "k1"), ("other", "k2"), ("anonymous", "")):
        open_ok(drafter, SequenceSpec(sid, [7, 40, 41], GREEDY, tenant=tenant))
    proposals, _ = drafter.draft([DraftTask(sid, [], 3, 4) for sid in ("same", "other", "anonymous")])
    assert [p.tokens for p in proposals] == [[42, 43, 44], [], []]


def test_a_close_s_tail_is_learnt_with_its_response(make_suffix):
    """The tokens a sequence committed after its last draft task come with its close: its tenant
    drafts from the whole response. A tail that does not continue it is left out; a token outside
    the vocabulary refuses the close before anything is closed."""
    drafter = make_suffix(max_draft_tokens=4)
    open_ok(drafter, SequenceSpec("a", [1, 2, 3], GREEDY), SequenceSpec("b", [1, 2, 3], GREEDY))
    drafter.draft([DraftTask("a", [40, 41], 5, 0), DraftTask("b", [70, 71], 5, 0)])
    with pytest.raises(EngineError, match="tail tokens"):
        drafter.close(["a"], tails={"a": ([10**9], 6)})
    assert "a" in drafter.table.seqs
    # a's tail continues it (5 committed + 3 = 8); b's does not (it claims 9), so b is learnt as sent.
    assert drafter.close(["a", "b"], tails={"a": ([42, 43, 44], 8), "b": ([72, 73], 9)}) == 2
    open_ok(drafter, SequenceSpec("c", [7, 42], GREEDY), SequenceSpec("d", [7, 71], GREEDY))
    proposals, _ = drafter.draft([DraftTask("c", [], 2, 4), DraftTask("d", [], 2, 4)])
    assert [p.tokens for p in proposals] == [[43, 44], []]


def test_an_evicted_response_stops_drafting_for_open_sequences(make_suffix):
    drafter = make_suffix(max_draft_tokens=4, responses=1)
    open_ok(drafter, SequenceSpec("a", [1], GREEDY))
    drafter.draft([DraftTask("a", [50, 51, 52, 53], 5, 0)])
    drafter.close(["a"])
    open_ok(drafter, SequenceSpec("b", [50, 51], GREEDY), SequenceSpec("c", [2], GREEDY))
    (proposal,), _ = drafter.draft([DraftTask("b", [], 2, 2)])
    assert proposal.tokens == [52, 53]
    drafter.draft([DraftTask("c", [60, 61], 3, 0)])
    drafter.close(["c"])  # its response replaces a's
    (proposal,), _ = drafter.draft([DraftTask("b", [], 2, 2)])
    assert proposal.tokens == []


def test_invalid_requests_fail_only_their_own_task(make_suffix):
    drafter = make_suffix(max_draft_tokens=4)
    open_ok(drafter, *(SequenceSpec(sid, [5, 6, 7, 5, 6, 7, 5], GREEDY) for sid in ("ok", "x", "y")))
    proposals, _ = drafter.draft(
        [DraftTask("ok", [], 7, 3, num_siblings=3), DraftTask("x", [], 7, 2, num_siblings=3), DraftTask("y", [], 9, 1)]
    )
    kinds = [None if p.error is None else p.error.kind for p in proposals]
    assert kinds == [None, ErrorKind.INVALID_ARGUMENT, ErrorKind.FAILED_PRECONDITION]
    assert proposals[0].tokens == [6, 7, 5]


# -- exactness -----------------------------------------------------------------------------


def run(verifier, drafter, prompt: list[int], params: SamplingParams, k: int, siblings: int, sid: str):
    """A sequence's rounds as the gateway runs them (trees verified with their parents);
    returns (its output, drafts accepted, drafts proposed)."""
    spec = SequenceSpec(sid, list(prompt), params)
    open_ok(verifier, spec)
    open_ok(drafter, spec)
    committed, unsent, accepted, proposed = list(prompt), [], 0, 0
    while len(committed) - len(prompt) < NEW_TOKENS:
        (proposal,), _ = drafter.draft([DraftTask(sid, unsent, len(committed), k, num_siblings=siblings)])
        assert proposal.error is None and proposal.dists == []
        proposed += len(proposal.tokens)
        task = VerifyTask(sid, len(committed), proposal.tokens, draft_parents=proposal.parents)
        (result,), _ = verifier.verify([task])
        assert result.error is None, result.error
        path = result.accepted_path or list(range(result.num_accepted))
        unsent = [*(proposal.tokens[i] for i in path), result.next_token]
        committed += unsent
        accepted += result.num_accepted
    assert verifier.close([sid]) == 1 and drafter.close([sid]) == 1
    return committed[len(prompt) :][:NEW_TOKENS], accepted, proposed


def reference(model, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("siblings", [0, 2])
def test_greedy_output_is_the_targets_and_a_repeat_is_drafted_from_the_first(
    make_verifier, make_suffix, tiny_target, tok, siblings
):
    prompt = tok.encode("def add(a, b):\n    return a + b\n\ndef add(a, b):")
    verifier, drafter = make_verifier(max_draft_tokens=8), make_suffix(max_draft_tokens=8)
    want = reference(tiny_target, prompt)
    first, _, _ = run(verifier, drafter, prompt, GREEDY, 4, siblings, "first")
    assert first == want
    # The same request again: the first response, now in the global trie, drafts it.
    again, accepted, _ = run(verifier, drafter, prompt, GREEDY, 4, siblings, "again")
    assert again == want
    assert accepted >= NEW_TOKENS // 2


def test_seeded_sampled_output_is_the_targets(make_verifier, make_suffix, tok):
    prompt = tok.encode("1, 2, 3, 4, 5, 6, 1, 2, 3")
    alone, _, _ = run(make_verifier(max_draft_tokens=8), _NoDrafter(), prompt, SEEDED, 0, 0, "ref")
    drafter, verifier = make_suffix(max_draft_tokens=8), make_verifier(max_draft_tokens=8)
    for sid in ("x", "y"):  # the second from the first's response too
        out, _, proposed = run(verifier, drafter, prompt, SEEDED, 4, 0, sid)
        assert out == alone
    assert proposed > 0


class _NoDrafter:
    """Target-only rounds: proposes nothing."""

    def open(self, specs):
        return [None] * len(specs), 0

    def close(self, ids):
        return len(ids)

    def draft(self, tasks):
        from specd.engine.tasks import DraftProposal

        return [DraftProposal(t.sequence_id) for t in tasks], None


def test_the_drafter_service_takes_a_close_s_tails_from_the_wire(make_suffix):
    """CloseDraftSequences' tails reach the engine under the owner's keys."""
    import asyncio

    from engine_backends import OWNER, _NoContext

    from drafter_service.servicer import DrafterServicer
    from specd.proto.speculative.v1 import common_pb2, drafter_pb2
    from specd.rpc.leases import Leases
    from specd.rpc.service_metrics import ServiceMetrics
    from specd.rpc.serving import EngineRunner
    from specd.rpc.tracing import Tracing

    engine = make_suffix(max_draft_tokens=4)
    runner = EngineRunner("drafter")
    info = common_pb2.ModelInfo(model_id="suffix", max_sequences=4, max_draft_tokens=4)
    servicer = DrafterServicer(engine, info, runner, Tracing("d"), ServiceMetrics("drafter", engine), Leases(0))

    async def main() -> list[int]:
        sampling = common_pb2.SamplingParams(top_p=1.0)
        spec = common_pb2.SequenceSpec(sequence_id="a", prompt_token_ids=[1, 2, 3], sampling=sampling)
        opened = drafter_pb2.OpenDraftSequencesRequest(sequences=[spec], lease_owner=OWNER)
        await servicer.OpenDraftSequences(opened, _NoContext())
        tail = drafter_pb2.DraftTail(sequence_id="a", new_token_ids=[40, 41, 42], num_committed=6)
        request = drafter_pb2.CloseDraftSequencesRequest(sequence_ids=["a"], lease_owner=OWNER, tails=[tail])
        assert (await servicer.CloseDraftSequences(request, _NoContext())).closed == 1
        open_ok(engine, SequenceSpec("b", [7, 40], GREEDY))
        (proposal,), _ = engine.draft([DraftTask("b", [], 2, 4)])
        return proposal.tokens

    assert asyncio.run(main()) == [41, 42]
