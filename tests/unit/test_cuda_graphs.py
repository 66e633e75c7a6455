"""The bucketed static forward (specd.engine.cuda_graphs) computes what the eager forward computes.

On the CPU it runs without capture over the same static buffers a CUDA graph replays, so the
buffers' discipline is checked here: padded rows and padded positions change no real row's
logits, never write a real slot, and the scratch slot they use is never read by a real row.
The captured path itself is checked where CUDA is (tests marked below skip without it).
"""

from __future__ import annotations

import copy
from typing import NamedTuple

import pytest
import torch
from tinymodels import device_under_test
from transformers import LlamaConfig, LlamaForCausalLM

from specd.engine import cuda_graphs, fused_llama, trees
from specd.engine.attention_layout import AttentionLayout
from specd.engine.kvcache import BatchedCausalLM, Row
from specd.engine.slot_cache import SlotKVCache

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def llama(positions: int = 512, seed: int = 0) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=positions,
        initializer_range=0.2,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def pair(
    device: torch.device, dtype: torch.dtype = torch.float32, positions: int = 300, length: int = 5
) -> tuple[BatchedCausalLM, BatchedCausalLM]:
    """Two copies of one fused model over their own caches: the eager one and the static one
    (blocks of up to `length` tokens)."""
    fused = fused_llama.fuse(llama(positions)).to(device=device, dtype=dtype)
    eager = BatchedCausalLM(fused, device, dtype, max_slots=6, max_positions=positions)
    static = BatchedCausalLM(copy.deepcopy(fused), device, dtype, max_slots=6, max_positions=positions)
    static.static = cuda_graphs.StaticForward(static, 64, length, capture=device.type == "cuda")
    return eager, static


def prefill(lms: tuple[BatchedCausalLM, ...], slots: list[int], lengths: list[int]) -> list[list[int]]:
    """Each slot's prompt, fed to every one of `lms`."""
    gen = torch.Generator().manual_seed(1)
    prompts = []
    for slot, n in zip(slots, lengths, strict=True):
        tokens = torch.randint(0, 96, (n,), generator=gen).tolist()
        prompts.append(tokens)
        for lm in lms:
            lm.forward([Row(slot, 0, tokens, n - 1)])
    return prompts


def test_buckets_pad_the_batch_and_the_keys_but_never_past_the_bound() -> None:
    _, static = pair(torch.device("cpu"), positions=700)
    runner = static.static
    assert runner.batches == [1, 2, 4]  # six slots: no bucket of 8
    assert runner.keys == [512, 704]  # the bound rounded up to KEY_ALIGNMENT: aligned keys
    assert runner.bucket(3, 2, 40) == cuda_graphs.Bucket(4, 2, 512)
    assert runner.bucket(1, 5, 513) == cuda_graphs.Bucket(1, 5, 704)
    assert static.cache.keys[0] is None or static.cache.keys[0].shape[2] == 704
    assert runner.bucket(5, 1, 10) is None  # more rows than the largest bucket
    assert runner.bucket(1, 6, 10) is None  # a longer block than any captured: eager
    assert cuda_graphs.key_buckets(2048) == [512, 1024, 2048]
    assert cuda_graphs.key_buckets(100) == [100]


def test_bucketed_rounds_give_the_eager_logits_and_tokens() -> None:
    device = device_under_test()
    eager, static = pair(device)
    slots, lengths = [4, 0, 2], [7, 3, 12]
    prefill((eager, static), slots, lengths)
    gen = torch.Generator().manual_seed(2)
    for step in range(4):
        # Rows of different block lengths (a verify's), fed in an order that is not the slots'.
        counts = [1 + (step + i) % 3 for i in range(3)]
        rows = []
        for slot, start, n in zip(slots, lengths, counts, strict=True):
            rows.append(Row(slot, start, torch.randint(0, 96, (n,), generator=gen).tolist(), 0))
        want = eager.forward(rows)
        got = static.forward(rows)
        for w, g in zip(want, got, strict=True):
            # A GPU's attention kernels sum a padded batch and more (masked) keys in another order.
            tol = 1e-5 if device.type == "cpu" else 1e-4
            torch.testing.assert_close(g, w, rtol=tol, atol=tol)
            assert torch.equal(g.argmax(-1), w.argmax(-1))
        lengths = [s + n for s, n in zip(lengths, counts, strict=True)]
    # The one-token steps of a draft, fed from the device, pick the same tokens.
    rows = [Row(slot, start, [0], 0) for slot, start in zip(slots, lengths, strict=True)]
    ids = torch.tensor([5, 6, 7], device=device)
    assert torch.equal(static.forward_argmax(rows, ids), eager.forward_argmax(rows, ids))


def test_padding_never_reads_or_writes_a_real_sequence() -> None:
    eager, static = pair(torch.device("cpu"))
    prefill((eager, static), [1, 3, 5], [4, 9, 2])
    # Garbage in the scratch slot: a real row that read it would turn NaN.
    scratch = static.cache.scratch_slot
    with torch.inference_mode():  # the cache was made in it
        for store in (static.cache.keys, static.cache.values):
            for t in store:
                t[scratch] = float("nan")
    before = [t.clone() for t in static.cache.keys]
    rows = [Row(1, 4, [3], 0), Row(3, 9, [4, 5, 6], 0)]  # a bucket of 2 rows of 3: row 1 has 2 padded positions
    want = eager.forward(rows)
    got = static.forward(rows)
    for w, g in zip(want, got, strict=True):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    for old, new in zip(before, static.cache.keys, strict=True):
        # Slot 1 changed at position 4 only, slot 3 at 9..11 only; no other slot at all.
        changed = (old != new) & ~(old.isnan() & new.isnan())
        where = {(int(s), int(p)) for s, _, p, _ in changed.nonzero().tolist()}
        assert {s for s, _ in where} <= {1, 3, scratch}
        assert {p for s, p in where if s == 1} <= {4}
        assert {p for s, p in where if s == 3} <= {9, 10, 11}
    # The cache counts what the real rows wrote, as the eager forward's does.
    assert static.cache._high[:6] == eager.cache._high[:6]
    # Three rows in a bucket of four: the padded row attends the scratch slot alone (its NaN).
    runner = static.static
    three = [Row(0, 0, [1], 0), Row(1, 5, [2], 0), Row(3, 12, [3], 0)]
    bucket = runner.bucket(3, 1, 13)
    runner._fill(bucket, three, None)
    with torch.inference_mode():
        hidden = runner._body(bucket)
    assert hidden.shape[0] == 4 and torch.isfinite(hidden[:3]).all() and hidden[3].isnan().all()


def test_a_captured_cache_keeps_its_bound() -> None:
    _, static = pair(torch.device("cpu"))
    static.cache.captured = True  # as a capture sets it: graphs hold these tensors' addresses
    with pytest.raises(RuntimeError, match="captured in CUDA graphs"):
        static.reserve(4, 100)


def test_shapes_outside_the_buckets_run_eagerly() -> None:
    eager, static = pair(torch.device("cpu"))
    calls = []
    body = static.static._body
    static.static._body = lambda bucket: calls.append(bucket) or body(bucket)
    prefill((eager, static), [0], [20])  # a prefill of 20 tokens: longer than any bucket's block
    assert calls == []
    rows = [Row(0, 20, [1, 2], 1)]
    torch.testing.assert_close(static.forward(rows)[0], eager.forward(rows)[0], rtol=1e-5, atol=1e-5)
    assert calls == [cuda_graphs.Bucket(1, 2, 320)]


def test_the_choice_of_cuda_graphs() -> None:
    cpu = torch.device("cpu")
    assert not cuda_graphs.wants_graphs("auto", cpu)
    assert not cuda_graphs.wants_graphs("off", cpu)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        cuda_graphs.wants_graphs("on", cpu)
    with pytest.raises(ValueError, match="takes auto, on, off"):
        cuda_graphs.wants_graphs("yes", cpu)
    lm = BatchedCausalLM(llama(), cpu, torch.float32)  # transformers' forward
    assert cuda_graphs.supported(lm) is not None
    assert cuda_graphs.enable(lm, "auto", 5, "verifier") is None and lm.static is None


def test_a_capture_that_fails_leaves_auto_eager_and_on_refusing(monkeypatch) -> None:
    lm = BatchedCausalLM(fused_llama.fuse(llama()), torch.device("cpu"), torch.float32)
    monkeypatch.setattr(cuda_graphs, "wants_graphs", lambda choice, device: True)

    def refuse(self, buckets=None) -> None:
        self.lm.cache.captured = True
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(cuda_graphs.StaticForward, "capture_all", refuse)
    assert cuda_graphs.enable(lm, "auto", 5, "verifier") is None and lm.static is None
    lm.reserve(4, 100)  # not left captured: the bound can still change
    with pytest.raises(RuntimeError, match="stream is capturing"):
        cuda_graphs.enable(lm, "on", 5, "verifier")


def test_the_start_up_check_catches_cache_writes_gone_astray(monkeypatch, caplog) -> None:
    _, static = pair(torch.device("cpu"))
    runner = static.static
    assert cuda_graphs.self_check(static, runner) is None
    assert static.cache._high[:3] == [0, 0, 0]  # the slots it used are handed back

    def astray(self, buf, new):
        # Every key to the scratch slot: the rows then read what the eager step left there.
        slots, positions, rows, keys = self._static
        self._static = (torch.full_like(slots, self.scratch_slot), positions, rows, keys)
        return real(self, buf, new)

    real = SlotKVCache._static_update
    monkeypatch.setattr(SlotKVCache, "_static_update", astray)
    assert cuda_graphs.self_check(static, runner) > 0.01
    # In the service: auto serves eagerly (and says why), on refuses to start.
    monkeypatch.setattr(cuda_graphs, "wants_graphs", lambda choice, device: True)
    monkeypatch.setattr(cuda_graphs.StaticForward, "capture_all", lambda self, buckets=None: None)
    monkeypatch.setattr(cuda_graphs.StaticForward, "__init__", uncaptured(cuda_graphs.StaticForward.__init__))
    lm = BatchedCausalLM(fused_llama.fuse(llama()), torch.device("cpu"), torch.float32, max_slots=6)
    assert cuda_graphs.enable(lm, "auto", 5, "verifier") is None and lm.static is None
    assert "CUDA graphs gave logits" in caplog.text and "runs eagerly" in caplog.text
    with pytest.raises(RuntimeError, match="CUDA graphs gave logits"):
        cuda_graphs.enable(lm, "on", 5, "verifier")


def uncaptured(init):
    """StaticForward.__init__ that keeps the static path uncaptured whatever it is asked (the CPU)."""

    def wrapped(self, lm, max_batch, max_length, capture, **options):
        init(self, lm, max_batch, max_length, False, **options)

    return wrapped


# Two committed tokens, then a tree: siblings at the root, a branch of depth 5 under the root's
# second child (deeper than WINDOW: its keys sit at cache indices past their depth).
TREE = trees.with_prefix(2, [-1, -1, 0, 1, 3, 4, 5])
SMALL_TREE = [-1, -1, 0, 1]  # shorter than the bucket: padded positions past a tree
WINDOW = 3


class TreeRound(NamedTuple):
    rows: list[Row]
    want: list[torch.Tensor]  # the eager forward's logits
    got: list[torch.Tensor]  # the static forward's
    eager: BatchedCausalLM
    static: BatchedCausalLM
    prompts: list[list[int]]


def tree_round(device: torch.device, window: int | None = None) -> TreeRound:
    """Two trees of different shapes beside a chain in a bucket of four (one padded row), through
    the eager and the static forward."""
    eager, static = pair(device, length=len(TREE))
    for lm in (eager, static):
        lm.attention = AttentionLayout(window)  # a fused Llama's mask narrowed as a sliding model's
    slots, lengths = [4, 0, 2], [7, 3, 12]
    prompts = prefill((eager, static), slots, lengths)
    rows = [
        Row(4, 7, [10 + i for i in range(len(TREE))], 0, parents=TREE),
        Row(0, 3, [30, 31], 0),
        Row(2, 12, [50 + i for i in range(len(SMALL_TREE))], 0, parents=SMALL_TREE),
    ]
    calls = []
    body = static.static._body
    static.static._body = lambda bucket: calls.append(bucket) or body(bucket)
    want, got = eager.forward(rows), static.forward(rows)
    # The bucketed forward ran them (on CUDA its body ran to capture the bucket, then replayed).
    assert set(calls) == {cuda_graphs.Bucket(4, len(TREE), 320)}
    return TreeRound(rows, want, got, eager, static, prompts)


@pytest.mark.parametrize("window", [None, WINDOW])
def test_tree_rows_give_the_eager_trees_logits_at_every_node(window: int | None) -> None:
    run = tree_round(torch.device("cpu"), window)
    for w, g in zip(run.want, run.got, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    # And each node's logits are those of the chain along its path (the window counts depths).
    tree, prompt, eager = run.rows[0], run.prompts[0], run.eager
    assert tree.parents is not None
    for j in range(len(tree.tokens)):
        path = [tree.tokens[i] for i in trees.path_to(tree.parents, j)]
        chain = eager.forward([Row(5, 0, prompt + path, len(prompt) + len(path) - 1)])[0][0]
        eager.cache.release(5)
        torch.testing.assert_close(run.got[0][j], chain, rtol=1e-4, atol=1e-4, msg=lambda m, j=j: f"node {j}: {m}")


def test_a_window_shallower_than_the_branch_changes_its_logits() -> None:
    """The windowed check above can fail: the deep branch's last node sees fewer keys in a window."""
    full = tree_round(torch.device("cpu")).got
    windowed = tree_round(torch.device("cpu"), WINDOW).got
    assert not torch.allclose(full[0][-1], windowed[0][-1], atol=1e-3)


@pytest.mark.parametrize("window", [None, WINDOW])
def test_chains_get_the_causal_mask_bit_for_bit(window: int | None) -> None:
    """Chain rows through the ancestor matrices get the mask they got before trees: a key is seen
    up to the query's position (and within the window), so their hidden states are unchanged."""
    eager, static = pair(torch.device("cpu"))
    static.attention = AttentionLayout(window)
    prefill((eager, static), [4, 0, 2], [7, 3, 12])
    runner = static.static

    def causal(inputs, keys):
        key_pos = torch.arange(keys)
        return key_pos[None, None, :] <= inputs.positions[:, :, None], key_pos

    rows = [Row(4, 7, [1, 2, 3], 0), Row(0, 3, [4], 0), Row(2, 12, [5, 6, 7, 8, 9], 0)]
    bucket = runner.bucket(3, 5, 17)
    runner._fill(bucket, rows, None)
    inputs = runner._views(bucket)
    with torch.inference_mode():
        visible, key_pos = runner._visible(inputs, bucket.keys)
        before, _ = causal(inputs, bucket.keys)
        for i, r in enumerate(rows):
            assert torch.equal(visible[i, : len(r.tokens)], before[i, : len(r.tokens)])
        if window is not None:
            # A real row's keys at their indices (a padded row's outputs are never read).
            assert torch.equal(key_pos[: len(rows)], torch.arange(bucket.keys).expand(len(rows), -1))
        got = runner._body(bucket).clone()
        runner._visible = causal
        runner._fill(bucket, rows, None)
        want = runner._body(bucket)
    for i, r in enumerate(rows):
        assert torch.equal(got[i, : len(r.tokens)], want[i, : len(r.tokens)])


@cuda
def test_captured_rounds_give_the_eager_tokens_on_cuda() -> None:
    device = torch.device("cuda")
    eager, static = pair(device, torch.float32)
    static.static.capture_all([cuda_graphs.Bucket(4, n, 320) for n in (1, 2, 3)])
    slots, lengths = [4, 0, 2], [7, 3, 12]
    prefill((eager, static), slots, lengths)
    for step in range(3):
        rows = [Row(s, n, [step + 1] * (1 + step), 0) for s, n in zip(slots, lengths, strict=True)]
        for w, g in zip(eager.forward(rows), static.forward(rows), strict=True):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
            assert torch.equal(g.argmax(-1), w.argmax(-1))
        lengths = [n + 1 + step for n in lengths]


@cuda
def test_a_captured_graph_takes_tree_rows_on_cuda() -> None:
    """A bucket captured with chains of padding replays a tree beside a chain as the eager forward."""
    run = tree_round(torch.device("cuda"))
    assert cuda_graphs.Bucket(4, len(TREE), 320) in run.static.static._graphs
    for w, g in zip(run.want, run.got, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
        assert torch.equal(g.argmax(-1), w.argmax(-1))


def test_the_capture_path_runs_with_a_stand_in_for_cuda(monkeypatch) -> None:
    """The GPU-only code of StaticForward (capture, the pool, the side stream, the memory count,
    replay into the captured output) run on the CPU with torch.cuda's calls stood in for: a
    graph's replay runs the captured body again over the same buffers and writes the captured
    output in place, as a real replay would."""
    import contextlib

    real_body = cuda_graphs.StaticForward._body
    capturing: list[Graph] = []

    class Graph:
        def __init__(self) -> None:
            self.captured = None

        def replay(self) -> None:
            static, bucket, out = self.captured
            with torch.inference_mode():
                out.copy_(real_body(static, bucket))

    def body(self, bucket):
        out = real_body(self, bucket)
        if capturing:
            capturing[-1].captured = (self, bucket, out)
        return out

    @contextlib.contextmanager
    def graph(g, pool=None, stream=None):
        capturing.append(g)
        try:
            yield
        finally:
            capturing.pop()

    class Stream:
        def __init__(self, device=None) -> None:
            pass

        def wait_stream(self, other) -> None:
            pass

    monkeypatch.setattr(cuda_graphs.StaticForward, "_body", body)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    eager, static = pair(torch.device("cpu"))
    static.static.capture = True
    static.static.capture_all([cuda_graphs.Bucket(4, n, 320) for n in (1, 2)])
    assert static.cache.captured and len(static.static._graphs) == 2
    slots, lengths = [4, 0, 2], [7, 3, 12]
    prefill((eager, static), slots, lengths)  # a prompt of 3 captures one more bucket on the way
    assert cuda_graphs.Bucket(1, 3, 320) in static.static._graphs
    for step in range(2):
        rows = [Row(s, n, [step + 3] * (1 + step), 0) for s, n in zip(slots, lengths, strict=True)]
        for w, g in zip(eager.forward(rows), static.forward(rows), strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
        lengths = [n + 1 + step for n in lengths]
    # A tree replays through the bucket (1, 3) captured for a prompt of chains.
    tree = [Row(4, lengths[0], [9, 8, 7], 0, parents=[-1, -1, 1])]
    torch.testing.assert_close(static.forward(tree)[0], eager.forward(tree)[0], rtol=1e-5, atol=1e-5)
