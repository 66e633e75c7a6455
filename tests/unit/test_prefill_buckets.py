"""Prefill chunks padded to a few bucket lengths (specd.engine.cuda_graphs.prefill_lengths) give the
logits and greedy tokens of exact-length chunks, and leave only real positions in the KV cache.

The services pad only on CUDA, where the buckets are captured graphs; here the same static path
runs uncaptured on the CPU, forced by passing the lengths to StaticForward.
"""

from __future__ import annotations

import copy

import torch
from tinymodels import build_model, device_under_test

from specd.engine import cuda_graphs, fused_llama
from specd.engine.kvcache import BatchedCausalLM, Row

VOCAB = 128
BLOCK = 4  # the drafter's graphed block: longer chunks are padded
LENGTHS = cuda_graphs.prefill_lengths(BLOCK, 64)  # 8, 16, 32, 64


def pair() -> tuple[BatchedCausalLM, BatchedCausalLM]:
    """One tiny fused model twice: exact-length (eager) chunks, and chunks padded to LENGTHS."""
    device = device_under_test()
    fused = fused_llama.fuse(build_model(3, VOCAB, 1, 2)).to(device)
    exact = BatchedCausalLM(fused, device, torch.float32, max_slots=4, max_positions=256)
    padded = BatchedCausalLM(copy.deepcopy(fused), device, torch.float32, max_slots=4, max_positions=256)
    capture = device.type == "cuda"
    padded.static = cuda_graphs.StaticForward(padded, 4, BLOCK, capture, prefill=LENGTHS, prefill_tokens=128)
    return exact, padded


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_same(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
        assert torch.equal(g.argmax(-1), w.argmax(-1))


def slot_cache(lm: BatchedCausalLM, slot: int) -> list[torch.Tensor]:
    return [t[slot].clone() for t in (*lm.cache.keys, *lm.cache.values) if t is not None]


def test_the_lengths_are_powers_of_two_past_the_block() -> None:
    assert cuda_graphs.prefill_lengths(4) == [8, 16, 32, 64, 128, 256]
    assert cuda_graphs.prefill_lengths(9) == [16, 32, 64, 128, 256]
    assert cuda_graphs.prefill_lengths(4, 40) == [8, 16, 32, 40]  # the limit is the last
    assert cuda_graphs.prefill_lengths(8, 8) == []
    _, padded = pair()
    static = padded.static
    assert static.bucket(1, 5, 20) == cuda_graphs.Bucket(1, 8, 256)
    assert static.bucket(3, 17, 40) == cuda_graphs.Bucket(4, 32, 256)  # batch and length padded
    assert static.bucket(2, 3, 9) == cuda_graphs.Bucket(2, 3, 256)  # a block keeps its length
    assert static.bucket(4, 33, 40) is None  # 4 x 64 tokens: past prefill_tokens, eager
    assert static.bucket(1, 65, 80) is None  # longer than any bucket
    assert {b.length for b in static.buckets()} == {1, 2, 3, 4, *LENGTHS}


def test_padded_chunks_give_the_exact_chunks_logits_and_cache() -> None:
    exact, padded = pair()
    # Odd chunk lengths across every bucket edge, each chunk at the positions the last one left.
    chunks = [1, 3, 5, 7, 9, 15, 17, 31, 33, 11]
    tokens = prompt(sum(chunks), 0)
    at = 0
    for n in chunks:
        row = [Row(2, at, tokens[at : at + n], 0)]  # every position's logits
        assert_same(padded.forward(row), exact.forward(row))
        at += n
    assert padded.static.missed == 0  # every chunk ran in a bucket
    # The same greedy continuation from both caches.
    last = [tokens[-1]]
    for _ in range(4):
        got, want = padded.forward([Row(2, at, last, 0)]), exact.forward([Row(2, at, last, 0)])
        assert_same(got, want)
        last, at = [int(want[0][-1].argmax())], at + 1
    # The cache holds the real positions alone: the padding's keys went to the scratch slot.
    for g, w in zip(slot_cache(padded, 2), slot_cache(exact, 2), strict=True):
        torch.testing.assert_close(g[:, :at], w[:, :at], rtol=1e-4, atol=1e-4)
        assert not g[:, at:].any() and not w[:, at:].any()
    for slot in (0, 1, 3):
        assert not any(t.any() for t in slot_cache(padded, slot))


def test_padded_rows_of_different_lengths_in_one_forward() -> None:
    exact, padded = pair()
    for length in range(1, 27, 2):
        # Three rows (a bucket of four), of lengths on either side of a bucket edge.
        rows = [Row(s, 0, prompt(n, 10 * length + s), 0) for s, n in enumerate((length, length + 6, 1))]
        assert_same(padded.forward(rows), exact.forward(rows))
        high = [len(r.tokens) for r in rows]
        for slot, n in enumerate(high):
            assert all(not t[:, n:].any() for t in slot_cache(padded, slot))
            padded.cache.release(slot)
            exact.cache.release(slot)
            with torch.inference_mode():  # wipe the slots: the next lengths are shorter or longer
                for lm in (exact, padded):
                    for t in (*lm.cache.keys, *lm.cache.values):
                        t[slot] = 0
    assert padded.static.missed == 0


def test_the_drafter_prefills_padded_chunks_and_says_so_in_its_span(make_drafter, tiny_draft) -> None:
    from specd.engine.params import SamplingParams
    from specd.engine.tasks import DraftTask, SequenceSpec

    greedy = SamplingParams(temperature=0.0)
    prompt = [(7 * i + 3) % 500 + 10 for i in range(90)]
    exact, padded = (make_drafter(max_sequences=2, model=fused_llama.fuse(copy.deepcopy(tiny_draft))) for _ in "ab")
    padded.lm.static = cuda_graphs.StaticForward(padded.lm, 2, BLOCK, False, prefill=LENGTHS)
    for engine in (exact, padded):
        engine.open([SequenceSpec("a", prompt, greedy, prefill_tokens=1)])
    attributes = []
    for chunk in (5, 9, 17, 33, 30):  # the last past the pending prompt: 89 - 1 - 64 = 24 tokens
        task = DraftTask("a", [], len(prompt), 0, (), prefill_tokens=chunk)
        (want,), _ = exact.draft([task])
        (got,), timing = padded.draft([task])
        assert got.prefill_pending == want.prefill_pending
        attributes.append(prefill_attributes(timing))
    assert attributes[0] == {"specd.prefill_tokens": 5, "specd.prefill_graphed": True}
    assert [a["specd.prefill_tokens"] for a in attributes] == [5, 9, 17, 33, 24]
    assert all(a["specd.prefill_graphed"] for a in attributes)
    (want,), _ = exact.draft([DraftTask("a", [], len(prompt), 4)])
    (got,), _ = padded.draft([DraftTask("a", [], len(prompt), 4)])
    assert got.tokens == want.tokens and len(want.tokens) == 4
    # A chunk longer than every bucket runs eagerly, and its span says so.
    padded.open([SequenceSpec("b", prompt, greedy, prefill_tokens=1)])
    (_,), timing = padded.draft([DraftTask("b", [], len(prompt), 0, (), prefill_tokens=70)])
    assert prefill_attributes(timing) == {"specd.prefill_tokens": 70, "specd.prefill_graphed": False}


def prefill_attributes(timing) -> dict:
    """The attributes of a drafter round's one prefill phase."""
    (index,) = [i for i, phase in enumerate(timing.phases) if phase[0] == "prefill"]
    return timing.phase_attributes[index]
