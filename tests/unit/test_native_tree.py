"""Token trees through the native decoder layers (specd.engine.native_layer, layer.c): each node's
logits are bitwise those of its path fed as a chain, beside a chain row in the same forward, and
the compacted path serves the next round bitwise as the chain would; trees too large for layer.c
keep the torch forward."""

from __future__ import annotations

import pytest
import tinymodels
import torch

from specd.engine import fused_llama, gemv, native_layer, trees
from specd.engine.kvcache import BatchedCausalLM, Row
from specd.engine.native_layer import NativeLayers

MAX_ROWS = 16
# A prompt longer than MAX_ROWS: its prefill takes the torch forward, the same in every slot.
PROMPT = [5, 17, 33, 2, 90, 41, 8, 11, 60, 7, 19, 100, 3, 55, 31, 9, 12, 13]
PREFIX = 2  # committed tokens not cached yet, fed before the drafts
# Two siblings at the root, one with a branch of two below it and a sibling below that.
PARENTS = [-1, -1, 0, 2, 2, 1, 5, 3]
DRAFTS = [40 + 7 * i for i in range(len(PARENTS))]
CHAIN = [70, 71, 72]


def _lm(kernel: gemv.Gemv) -> BatchedCausalLM:
    # head_dim 16 (64 / 4 heads), 2 key/value heads; intermediate 100: not a multiple of 8.
    model = tinymodels.build_model(3, 120, 1, 2, layers=3, intermediate_size=100)
    fused = fused_llama.fuse(model)
    fused.body.linears.kernel, fused.body.linears.max_rows = kernel, MAX_ROWS
    fused.body.native = NativeLayers.build(fused.body, kernel)
    assert fused.body.native is not None
    lm = BatchedCausalLM(fused, torch.device("cpu"), torch.float32, max_slots=4, max_positions=96)
    # The head's product as calibration would choose it: the kernel's, whose rows do not interact.
    lm.head_product.kernel, lm.head_product.kernel_max_rows = kernel, MAX_ROWS
    return lm


def _spy(lm: BatchedCausalLM) -> list[bool]:
    """Per native forward from now on, whether it carried a tree's visibility."""
    native = lm.model.body.native
    real = native.forward
    calls: list[bool] = []

    def spied(*args: object, **kwargs: object) -> torch.Tensor | None:
        calls.append(len(args) > 6 and args[6] is not None)
        return real(*args, **kwargs)

    native.forward = spied  # type: ignore[method-assign]
    return calls


def _cached(lm: BatchedCausalLM, slot: int) -> int:
    """Slot `slot` holding PROMPT but its last PREFIX tokens; how many it holds."""
    cached = len(PROMPT) - PREFIX
    lm.forward([Row(slot, 0, PROMPT[:cached], cached - 1)])
    return cached


def _chain_logits(lm: BatchedCausalLM, slot: int, tokens: list[int]) -> torch.Tensor:
    """The logits of the last of `tokens`, fed as a chain after the cached prompt in `slot`."""
    cached = _cached(lm, slot)
    out = lm.forward([Row(slot, cached, tokens, len(tokens) - 1)])[0][0]
    lm.cache.release(slot)
    return out


def _path(row: Row, node: int) -> list[int]:
    """The tokens from the first fed down to `node`."""
    assert row.parents is not None
    return [row.tokens[i] for i in trees.path_to(row.parents, node)]


def test_each_nodes_logits_are_bitwise_its_chains_beside_a_chain_row(kernel: gemv.Gemv) -> None:
    lm = _lm(kernel)
    cached = _cached(lm, 0)
    lm.forward([Row(1, 0, PROMPT[:5], 4)])
    row = Row(0, cached, PROMPT[cached:] + DRAFTS, 0, parents=trees.with_prefix(PREFIX, PARENTS))
    calls = _spy(lm)
    got, chain_row = lm.forward([row, Row(1, 5, CHAIN, 0)])
    assert calls == [True]  # one forward, through the native layers, with the tree's visibility
    for j in range(len(row.tokens)):
        assert torch.equal(got[j], _chain_logits(lm, 2, _path(row, j))), f"node {j}"
    plain = _lm(kernel)
    plain.forward([Row(1, 0, PROMPT[:5], 4)])
    assert torch.equal(chain_row, plain.forward([Row(1, 5, CHAIN, 0)])[0])


def test_the_native_tree_is_the_torch_trees_forward(kernel: gemv.Gemv) -> None:
    """The same tree through the generic forward (the native layers off): the same logits but for
    the last bits, the same choices."""
    got = []
    for on in (True, False):
        lm = _lm(kernel)
        if not on:
            lm.model.body.native = None
        cached = _cached(lm, 0)
        got.append(
            lm.forward([Row(0, cached, PROMPT[cached:] + DRAFTS, 0, parents=trees.with_prefix(PREFIX, PARENTS))])[0]
        )
    torch.testing.assert_close(got[0], got[1], rtol=1e-4, atol=1e-4)
    assert torch.equal(got[0].argmax(-1), got[1].argmax(-1))


def test_the_compacted_path_serves_the_next_round_bitwise(kernel: gemv.Gemv) -> None:
    lm = _lm(kernel)
    cached = _cached(lm, 0)
    lm.forward([Row(0, cached, PROMPT[cached:] + DRAFTS, 0, parents=trees.with_prefix(PREFIX, PARENTS))])
    path = trees.path_to(PARENTS, 7)  # under node 0's child: nodes that move
    lm.cache.compact(0, cached, list(range(PREFIX)) + [PREFIX + i for i in path])
    committed = PROMPT + [DRAFTS[i] for i in path]
    got = lm.forward([Row(0, len(committed), CHAIN, 0)])[0]
    want = _chain_logits(lm, 1, PROMPT[cached:] + [DRAFTS[i] for i in path] + CHAIN)
    assert torch.equal(got[-1], want)


def test_the_check_can_fail(kernel: gemv.Gemv, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nodes that saw every node before them, as a chain's do, are not their paths' chains."""
    real = native_layer.placement

    def as_chains(*args: object) -> native_layer.Placement | None:
        place = real(*args)  # type: ignore[arg-type]
        if place is not None and place.visible is not None:
            place.visible = [(2 << i) - 1 for i in range(len(place.visible))]
        return place

    lm = _lm(kernel)
    cached = _cached(lm, 0)
    monkeypatch.setattr(fused_llama, "placement", as_chains)
    row = Row(0, cached, PROMPT[cached:] + DRAFTS, 0, parents=trees.with_prefix(PREFIX, PARENTS))
    got = lm.forward([row])[0]
    monkeypatch.undo()
    wrong = [j for j in range(len(row.tokens)) if not torch.equal(got[j], _chain_logits(lm, 2, _path(row, j)))]
    # The prefix and the first draft see what a chain's would; the root's second child on do not.
    assert wrong and wrong[0] == PREFIX + 1


def test_trees_larger_than_the_kernel_takes_run_the_torch_forward(kernel: gemv.Gemv) -> None:
    lm = _lm(kernel)
    size = native_layer.MAX_TREE_NODES + 1
    lm.model.body.linears.max_rows = size
    calls = _spy(lm)
    parents = [-1, -1, *range(size - 2)]
    lm.forward([Row(0, 0, [3] * size, 0, parents=parents)])
    assert calls == []
    assert native_layer.placement([0], [size], [parents]) is None


def test_placement() -> None:
    place = native_layer.placement([10, 4], [3, 4], [None, [-1, -1, 0, 2]])
    assert place is not None
    assert place.positions == [10, 11, 12, 4, 5, 6, 7]
    assert place.rotations == [10, 11, 12, 4, 4, 5, 6]
    assert place.prefixes == [11, 12, 13, 4, 4, 4, 4]
    assert place.visible == [0, 0, 0, 0b1, 0b10, 0b101, 0b1101]
    chains = native_layer.placement([10, 4], [3, 1], [None, None])
    assert chains == native_layer.Placement([10, 11, 12, 4], [10, 11, 12, 4])


def test_a_chain_attends_together_as_its_nodes_in_a_tree_alone_bit_for_bit(kernel: gemv.Gemv) -> None:
    # A chain's tokens attend together, each key read once for all of them (layer.c's attend_chain);
    # a tree's attend one by one. A chain's nodes in a tree must give the chain's bits: past a
    # tile of 64 keys and over more tokens than attend together (16), beside another slot's chain.
    lm = _lm(kernel)
    lm.model.body.linears.max_rows = lm.head_product.kernel_max_rows = 64
    prompt = [(7 * i + 3) % 120 for i in range(70)]
    drafts = [(11 * i + 5) % 120 for i in range(21)]
    for slot in (0, 1):
        lm.forward([Row(slot, 0, prompt, 0)])
    calls = _spy(lm)
    chain = lm.forward([Row(0, 70, drafts, 0), Row(2, 0, PROMPT[:5], 0)])[0]
    # The chain, and a sibling of its second token: a tree, whose nodes attend one by one.
    parents = [*range(-1, len(drafts) - 1), 0]
    tree = lm.forward([Row(1, 70, [*drafts, 9], 0, parents=parents), Row(3, 0, PROMPT[:5], 0)])[0]
    assert calls == [False, True]
    assert torch.equal(chain, tree[: len(drafts)])
