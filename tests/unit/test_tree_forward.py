"""Token-tree rows in BatchedCausalLM's forward: each node's logits are the chain's along its path,
for each architecture's way of masking (sliding windows deeper than the window included), and the
cache compacted to the accepted path serves the next round as if the path alone had been fed."""

from __future__ import annotations

import pytest
import tinymodels
import torch

from specd.engine import trees
from specd.engine.kvcache import BatchedCausalLM, Row

CPU = torch.device("cpu")
PROMPT = [5, 17, 300, 42, 7, 9, 11, 13, 2, 99, 100]
# Three siblings at the root, two below node 0, and a branch deeper than the sliding window
# (tinymodels.SLIDING_WINDOW) under node 1, whose keys sit at a cache index past their depth.
PARENTS = [-1, -1, -1, 0, 0, 3, 1, 5, 7, 8, 9, 10, 11, 12, 13, 6, 15, 16, 17, 18, 19, 20, 21, 22]
DRAFTS = [40 + 3 * i for i in range(len(PARENTS))]
PREFIX = 2  # committed tokens not cached yet, fed before the drafts
ATOL = 1e-4


@pytest.fixture(scope="module", params=["llama", "qwen2", "gemma2", "mistral"])
def arch_model(request, tok):
    return request.param, tinymodels.build_architecture(request.param, 0, len(tok), tok.bos_token_id, tok.eos_token_id)


def _lm(model) -> BatchedCausalLM:
    return BatchedCausalLM(model, CPU, torch.float32, max_slots=4, max_positions=96)


def _tree_row(lm: BatchedCausalLM, slot: int) -> Row:
    """Slot `slot` holding PROMPT but its last PREFIX tokens; the row feeding those and the tree."""
    cached = len(PROMPT) - PREFIX
    lm.forward([Row(slot, 0, PROMPT[:cached], cached - 1)])
    return Row(slot, cached, PROMPT[cached:] + DRAFTS, 0, parents=trees.with_prefix(PREFIX, PARENTS))


def test_each_nodes_logits_are_the_chains_along_its_path(arch_model):
    arch, model = arch_model
    lm = _lm(model)
    row = _tree_row(lm, 0)
    assert row.parents is not None
    # A chain row in the same forward, of another length, pads the tree's batch.
    got, chain_row = lm.forward([row, Row(1, 0, PROMPT[:5], 0)])
    chains = _lm(model)
    for j in range(len(row.tokens)):
        path = [row.tokens[i] for i in trees.path_to(row.parents, j)]
        want = chains.forward([Row(2, 0, PROMPT[:-PREFIX] + path, len(PROMPT) - PREFIX + len(path) - 1)])[0][0]
        torch.testing.assert_close(got[j], want, atol=ATOL, rtol=1e-4, msg=lambda m, j=j: f"{arch} node {j}: {m}")
    plain = _lm(model).forward([Row(1, 0, PROMPT[:5], 0)])[0]
    torch.testing.assert_close(chain_row, plain, atol=ATOL, rtol=1e-4)


def test_the_compacted_path_serves_the_next_round(arch_model):
    """Commit a path through a later sibling and deep under it, compact, feed a chain on: its logits
    are those of a fresh forward of the committed sequence."""
    arch, model = arch_model
    lm = _lm(model)
    row = _tree_row(lm, 0)
    assert row.parents is not None
    lm.forward([row])
    leaf = 23  # under node 1, the root's second child: every node of its path moves
    path = trees.path_to(PARENTS, leaf)
    assert path[0] == 1 and len(path) > tinymodels.SLIDING_WINDOW
    kept = list(range(PREFIX)) + [PREFIX + i for i in path]
    lm.cache.compact(0, row.start, kept)
    committed = PROMPT + [DRAFTS[i] for i in path]
    after = [7, 8, 9]
    got = lm.forward([Row(0, len(committed), after, 0)])[0]
    want = _lm(model).forward([Row(1, 0, committed + after, len(committed))])[0]
    torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-4, msg=lambda m: f"{arch}: {m}")


def test_without_compaction_the_next_round_is_wrong(tok):
    """The check above can fail: the path's keys left where the tree wrote them are not the path's."""
    model = tinymodels.build_architecture("llama", 0, len(tok), tok.bos_token_id, tok.eos_token_id)
    lm = _lm(model)
    row = _tree_row(lm, 0)
    lm.forward([row])
    path = trees.path_to(PARENTS, 23)
    committed = PROMPT + [DRAFTS[i] for i in path]
    got = lm.forward([Row(0, len(committed), [7, 8, 9], 0)])[0]
    want = _lm(model).forward([Row(1, 0, [*committed, 7, 8, 9], len(committed))])[0]
    assert not torch.allclose(got, want, atol=1e-2)


def test_a_chain_given_as_parents_is_a_chain_and_keeps_the_fast_forwards(tiny_target):
    lm = _lm(tiny_target)
    calls: list[int] = []

    class Static:
        def run(self, rows, device_ids=None):
            calls.append(len(rows))
            return None  # no bucket: the caller runs eagerly

    lm.static = Static()
    tokens = PROMPT[:6]
    plain = lm.forward([Row(0, 0, tokens, 0)])[0]
    as_parents = lm.forward([Row(1, 0, tokens, 0, parents=trees.chain(6))])[0]
    assert torch.equal(plain, as_parents)
    assert calls == [1, 1]
    lm.forward([Row(2, 0, tokens, 0, parents=[-1, 0, 0, 1, 2, 2])])
    # A tree reaches the bucketed forward too (specd.engine.cuda_graphs builds its mask; tested
    # there), and runs eagerly where no bucket holds it.
    assert calls == [1, 1, 1]


def test_a_tree_is_offered_to_the_native_forward_with_its_parents(tiny_target, monkeypatch):
    """A model without native layers declines it, and the generic forward runs (test_native_tree: one with)."""
    lm = _lm(tiny_target)
    offered = []
    real = lm._native
    monkeypatch.setattr(lm, "_native", lambda rows, ids, trees: offered.append(trees) or real(rows, ids, trees))
    want = _lm(tiny_target).forward([Row(0, 0, PROMPT[:4], 0, parents=[-1, 0, 0, 1])])[0]
    got = lm.forward([Row(0, 0, PROMPT[:4], 0, parents=[-1, 0, 0, 1]), Row(1, 0, PROMPT[:2], 0)])[0]
    assert offered == [[[-1, 0, 0, 1], None]]
    # Padded beside another row: equal up to float rounding, which some CPUs' kernels change with the batch.
    torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("parents", [[-1, 0], [-1, 0, 2], [-2, 0, 1], [-1, 1, 1]])
def test_rows_with_bad_trees_are_refused(tiny_target, parents):
    lm = _lm(tiny_target)
    with pytest.raises(ValueError):
        lm.forward([Row(0, 0, [1, 2, 3], 0, parents=parents)])


def test_compaction_refuses_positions_out_of_order(tiny_target):
    lm = _lm(tiny_target)
    lm.forward([Row(0, 0, [1, 2, 3], 0)])
    with pytest.raises(ValueError):
        lm.cache.compact(0, 0, [0, 2, 1])


def test_tree_helpers():
    parents = [-1, -1, 0, 2, 1]
    assert trees.depths(parents) == [0, 0, 1, 2, 1]
    assert trees.path_to(parents, 3) == [0, 2, 3]
    assert trees.children(parents) == {-1: [0, 1], 0: [2], 2: [3], 1: [4]}
    assert trees.ancestor_mask(parents)[3].tolist() == [True, False, True, True, False]
    assert trees.with_prefix(2, parents) == [-1, 0, 1, 1, 2, 4, 3]
    assert trees.check_parents([-1, 1]) and trees.check_parents([-2]) and trees.check_parents(parents) is None
