"""Decode and verify forwards over static buffers, captured as CUDA graphs on a GPU.

On a GPU a small model's step is bound by launching its kernels one by one from Python, not by
the hardware (docs/measurements.md, "Measured on a GPU"). A CUDA graph replays a whole forward's
kernels in one launch, but only over fixed shapes and fixed memory. So a forward whose rows fit
a bucket runs through buffers made once for it:

- `Bucket`: the batch padded up to one of `BATCH_BUCKETS`, every row padded to the block length
  (1 .. the longest block the service feeds), and the keys attended padded up to a power of two
  (`key_buckets`): a mask hides the keys past each query's position, as the eager forward's does.
- One packed int64 buffer holds every input of a forward (token ids, positions, the KV cache
  rows read and the slot/position each new key is written at, each row's start and which of its
  fed tokens each one sees), filled by one host-to-device copy that does not wait for the device.
- Token trees (`specd.engine.trees`) run through the same graphs: a node is written at start + its
  index but sits at start + its depth and sees its ancestors among the fed tokens, so the mask is
  built inside the graph from each row's ancestor matrix (a chain's is lower-triangular, which
  gives exactly the causal mask of a chain).
- A padded row reads and writes only the cache's scratch slot (`SlotKVCache.scratch_slot`), and a
  real row's padded positions write there too: nothing of a real sequence is overwritten, and
  a real row's queries never see the scratch slot (their keys are their own slot's). Padded
  rows' outputs are never read.

Plain `torch.cuda.CUDAGraph` capture, not `torch.compile(mode="reduce-overhead")`: that mode
replays CUDA graphs too, and would add fused kernels, but compiles every bucket at start, far
longer than capturing it, and compiles again wherever a shape guard fails.

Prompt prefill chunks longer than a block are padded up to one of a few lengths (`prefill_lengths`:
powers of two up to `PREFILL_LENGTH`, at most `PREFILL_TOKENS` tokens a bucket) and replay graphs
captured at start-up like any block: the gateway sizes chunks by a measured budget, so their
lengths vary from round to round, and an eager forward of a shape new to the process pays for its
first call. Their padded positions are a padded row's positions as above: written to the scratch
slot, unseen by the real ones. Powers of two keep the graphs few (six lengths past a block of four)
at no more than twice a chunk's tokens; whether a padded graphed chunk beats an exact eager one at
every length is for a GPU to show (scripts/gpu_check.py, `prefill_graphed_ms`). Longer chunks are
not captured: each bucket keeps its own output buffer, and the graphs multiply by batch and keys.

Longer prefills and shapes outside the buckets run eagerly, as do models other than the fused Llama
forward (`specd.engine.fused_llama`: transformers' own forward builds masks and reads cache lengths on
the host) and feature drafters. On the CPU the same static path runs without capture (tests
check it against the eager forward); the services only take it on CUDA (`--cuda-graphs`).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from specd.engine import CUDA_GRAPH_CHOICES
from specd.engine.forward_masks import row_tree
from specd.engine.trees import ancestor_mask, depths

if TYPE_CHECKING:
    from specd.engine.kvcache import BatchedCausalLM, Row

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
# The fewest keys a bucket attends: below it, more captures would save little.
MIN_KEYS = 512
# The longest prefill chunk padded to a graph, and the most tokens (rows x length) a prefill bucket
# holds: each bucket keeps its own output buffer, so these bound the graphs' memory.
PREFILL_LENGTH = 256
PREFILL_TOKENS = 1024


@dataclass(frozen=True, order=True)
class Bucket:
    batch: int
    length: int
    keys: int


class Inputs(NamedTuple):
    """A bucket's views of the packed input buffer."""

    ids: torch.Tensor  # [batch, length]
    positions: torch.Tensor  # [batch, length]: start + the token's depth (its index in a chain)
    slots: torch.Tensor  # [batch * length]: the cache row each new key is written to
    written: torch.Tensor  # [batch * length]: where in it: start + the token's index
    rows: torch.Tensor  # [batch]: the cache rows read
    starts: torch.Tensor  # [batch]: each row's first fed token's index
    ancestors: torch.Tensor  # bool [batch, length, length]: (i, j): fed token i sees fed token j


def _words(cells: int) -> int:
    """int64 words that hold `cells` bools."""
    return -(-cells // 8)


def _size(batch: int, length: int) -> int:
    """The int64 words of a bucket's inputs."""
    return 4 * batch * length + 2 * batch + _words(batch * length * length)


@functools.cache
def _chain_ancestors(batch: int, length: int) -> torch.Tensor:
    """The ancestor matrices of `batch` chains of `length` (lower-triangular), as packed words."""
    cells = torch.ones(length, length, dtype=torch.bool).tril().repeat(batch, 1, 1).flatten()
    packed = torch.zeros(8 * _words(cells.numel()), dtype=torch.bool)
    packed[: cells.numel()] = cells
    return packed.view(torch.long)


def _cells(words: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    """Packed ancestor words as the matrices they hold, bool [batch, length, length] (a view)."""
    return words.view(torch.bool)[: batch * length * length].view(batch, length, length)


def key_buckets(max_positions: int) -> list[int]:
    """Key counts attended: powers of two from MIN_KEYS, the last one the positions the cache holds."""
    out: list[int] = []
    n = MIN_KEYS
    while n < max_positions:
        out.append(n)
        n *= 2
    out.append(max_positions)
    return out


def prefill_lengths(block: int, longest: int = PREFILL_LENGTH) -> list[int]:
    """The lengths a prefill chunk longer than `block` is padded to: powers of two up to `longest`
    (itself the last where it is none)."""
    out: list[int] = []
    n = 1
    while n < longest:
        n *= 2
        if n > block:
            out.append(min(n, longest))
    return out


def wants_graphs(choice: str, device: torch.device) -> bool:
    """`--cuda-graphs`: auto is on for a CUDA device; on refuses any other device; off is off."""

    if choice not in CUDA_GRAPH_CHOICES:
        raise ValueError(f"--cuda-graphs takes {', '.join(CUDA_GRAPH_CHOICES)}, not {choice!r}")
    if choice == "on" and device.type != "cuda":
        raise ValueError(f"--cuda-graphs on needs a CUDA device, not {device}")
    return choice != "off" and device.type == "cuda"


def supported(lm: BatchedCausalLM) -> str | None:
    """Why `lm` cannot take the static path, or None if it can."""
    from specd.engine.fused_llama import FusedLlamaBody

    if not isinstance(lm._base, FusedLlamaBody):
        return "only the fused Llama forward runs over static buffers"
    if lm.feature_size:
        return "a feature drafter's forward reads per-token features"
    return None


class StaticForward:
    """The decoder of a BatchedCausalLM over bucketed static buffers; captured when `capture`.
    `prefill`: the lengths past `max_length` a longer block is padded to (`prefill_lengths`), in
    buckets of at most `prefill_tokens` tokens. On the CPU the services make none (padding would
    only add work there); tests pass them to check the padding."""

    def __init__(
        self,
        lm: BatchedCausalLM,
        max_batch: int,
        max_length: int,
        capture: bool,
        batches: Iterable[int] = (),
        prefill: Iterable[int] = (),
        prefill_tokens: int = PREFILL_TOKENS,
    ) -> None:
        reason = supported(lm)
        if reason is not None:
            raise ValueError(reason)
        self.lm = lm
        self.capture = capture
        cache = lm.cache
        cache.add_scratch()
        self.max_length = max(1, max_length)
        limit = min(max_batch, cache.max_slots)
        self.batches = sorted({b for b in (batches or BATCH_BUCKETS) if b <= max(limit, 1)} or {1})
        self.keys = key_buckets(cache.position_room)
        self.prefill_tokens = prefill_tokens
        self.prefill = sorted({n for n in prefill if n > self.max_length and self._fits(1, n)})
        shapes = {(b.batch, b.length) for b in self.buckets() if b.keys == self.keys[0]}
        self._inputs = torch.zeros(max(_size(b, n) for b, n in shapes), dtype=torch.long, device=lm.device)
        self._graphs: dict[Bucket, tuple[Any, torch.Tensor]] = {}
        self._pool: Any = None
        self.capture_s = 0.0
        self.capture_bytes = 0
        # Forwards no bucket held, which ran eagerly (a prefill chunk's span reports them).
        self.missed = 0

    # -- shapes ------------------------------------------------------------
    def _fits(self, batch: int, length: int) -> bool:
        """Whether a bucket of `batch` rows of `length` is made: every block, prefill within the tokens."""
        return length <= self.max_length or batch * length <= self.prefill_tokens

    def bucket(self, rows: int, length: int, keys: int) -> Bucket | None:
        """The smallest bucket that holds `rows` rows of `length` tokens attending `keys` keys: a
        block at its own length, a longer one padded to a prefill length."""
        if rows > self.batches[-1] or keys > self.keys[-1]:
            return None
        if length > self.max_length:
            length = next((n for n in self.prefill if n >= length), 0)
        batch = next(b for b in self.batches if b >= rows)
        if not length or not self._fits(batch, length):
            return None
        return Bucket(batch, length, next(k for k in self.keys if k >= keys))

    def lengths(self) -> list[int]:
        return [*range(1, self.max_length + 1), *self.prefill]

    def buckets(self) -> list[Bucket]:
        return [Bucket(b, n, k) for b in self.batches for n in self.lengths() for k in self.keys if self._fits(b, n)]

    # -- running -----------------------------------------------------------
    def run(self, rows: Sequence[Row], device_ids: torch.Tensor | None = None) -> torch.Tensor | None:
        """The last hidden states [len(rows), bucket length, hidden] of `rows` (sorted by slot, checked
        against the cache's bound), or None where no bucket holds them (the caller runs eagerly).
        `device_ids`: one token per row on the device, fed instead of the rows' placeholders. The
        result lives in the bucket's output buffer until the next run."""
        length = max(len(r.tokens) for r in rows)
        bucket = self.bucket(len(rows), length, max(r.start + len(r.tokens) for r in rows))
        if bucket is None:
            self.missed += 1
            return None
        if self.capture and bucket not in self._graphs:
            # Before the rows' inputs go in: capturing fills the buffers with padding.
            self._capture([bucket])
        self._fill(bucket, rows, device_ids)
        if not self.capture:
            with torch.inference_mode():
                return self._body(bucket)[: len(rows)]
        graph, out = self._graphs[bucket]
        graph.replay()
        return out[: len(rows)]

    def _views(self, bucket: Bucket) -> Inputs:
        batch, length = bucket.batch, bucket.length
        n = batch * length
        flat = self._inputs
        ids, positions, slots, written = (flat[i * n : (i + 1) * n] for i in range(4))
        at = 4 * n + 2 * batch
        ancestors = _cells(flat[at : at + _words(n * length)], batch, length)
        shape = (batch, length)
        rows, starts = flat[4 * n : 4 * n + batch], flat[4 * n + batch : at]
        return Inputs(ids.view(shape), positions.view(shape), slots, written, rows, starts, ancestors)

    def _fill(self, bucket: Bucket, rows: Sequence[Row], device_ids: torch.Tensor | None) -> None:
        """Every input of the bucket from one host tensor, copied without waiting for the device."""
        cache = self.lm.cache
        scratch = cache.scratch_slot
        last = self.lm.max_positions - 1
        top = cache.max_positions - 1
        length = bucket.length
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        written: list[int] = []
        chains = ancestors = _chain_ancestors(bucket.batch, length)
        for i, r in enumerate(rows):
            n = len(r.tokens)
            tree = row_tree(r.parents, n)
            # A token sits at start + its depth: its index in a chain, and in the padding past a tree.
            depth = range(length) if tree is None else depths(tree) + list(range(n, length))
            if tree is not None:
                ancestors = chains.clone() if ancestors is chains else ancestors
                _cells(ancestors, bucket.batch, length)[i, :n, :n] = ancestor_mask(tree)
            ids.extend(r.tokens)
            ids.extend([0] * (length - n))
            positions.extend(min(r.start + d, last) for d in depth)
            slots.extend([r.slot] * n + [scratch] * (length - n))
            written.extend(r.start + j if j < n else min(r.start + j, top) for j in range(length))
        pad = (bucket.batch - len(rows)) * length
        ids.extend([0] * pad)
        positions.extend([0] * pad)
        slots.extend([scratch] * pad)
        written.extend([0] * pad)
        read = [r.slot for r in rows] + [scratch] * (bucket.batch - len(rows))
        starts = [r.start for r in rows] + [0] * (bucket.batch - len(rows))
        host = torch.cat((torch.tensor(ids + positions + slots + written + read + starts, dtype=torch.long), ancestors))
        self._inputs[: host.numel()].copy_(host, non_blocking=True)
        if device_ids is not None:
            self._views(bucket).ids[: len(rows), 0].copy_(device_ids)
        cache.note_written([r.slot for r in rows], [r.start + len(r.tokens) for r in rows])

    def _body(self, bucket: Bucket) -> torch.Tensor:
        """The decoder over the bucket's buffers: what a graph captures and replays."""
        lm = self.lm
        inputs = self._views(bucket)
        visible, key_pos = self._visible(inputs, bucket.keys)
        # The eager forward's masks (a sliding layer's narrowed to its window), over the bucket's keys.
        mask = lm.attention.masks(visible, key_pos, inputs.positions, lm.dtype)
        lm.cache.set_static(inputs.slots, inputs.written, inputs.rows, bucket.keys)
        try:
            return lm._base(
                input_ids=inputs.ids,
                attention_mask=mask,
                position_ids=inputs.positions,
                use_cache=True,
                cache=lm.cache,
            ).last_hidden_state
        finally:
            lm.cache.set_static(None)

    def _visible(self, inputs: Inputs, keys: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Which of `keys` keys each fed token sees [batch, length, keys], and the keys' positions
        ([keys], or [batch, keys] where a layer slides): static shapes, gathers and compares only,
        so a graph replays it. A row's token sees every key before its start, and among its fed
        tokens those its ancestor matrix names: for a chain's lower-triangular one, exactly the
        keys up to its own (the causal mask)."""
        length = inputs.ids.shape[1]
        key_index = torch.arange(keys, device=self.lm.device)
        fed = key_index[None, :] - inputs.starts[:, None]  # [batch, keys]: a key's index among the fed tokens
        among = (fed >= 0) & (fed < length)
        at = fed.clamp(0, length - 1)
        seen = inputs.ancestors.gather(2, at[:, None, :].expand(-1, length, -1))
        visible = (fed < 0)[:, None, :] | (among[:, None, :] & seen)
        if self.lm.attention.window is None:
            return visible, key_index
        # A fed key sits at its token's position (start + depth): a window counts depths in a tree.
        return visible, torch.where(among, inputs.positions.gather(1, at), key_index[None, :])

    # -- capture -----------------------------------------------------------
    def _capture(self, buckets: Sequence[Bucket]) -> None:
        device = self.lm.device
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device)
        with torch.inference_mode():
            for bucket in buckets:
                # Inputs all padding: capturing writes and reads only the scratch slot.
                self._fill(bucket, [], None)
                stream.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(stream):
                    self._body(bucket)  # kernels chosen and workspaces made outside the capture
                torch.cuda.current_stream(device).wait_stream(stream)
                self.lm.cache.captured = True
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool, stream=stream):
                    out = self._body(bucket)
                self._graphs[bucket] = (graph, out)
        torch.cuda.current_stream(device).wait_stream(stream)

    def capture_all(self, buckets: Sequence[Bucket] | None = None) -> None:
        """Capture `buckets` (default every one), largest (in tokens, then keys) first so the smaller
        ones reuse the pool's memory; the time and the device memory it took are kept for the start-up log."""
        if not self.capture:
            return
        chosen = sorted(
            buckets if buckets is not None else self.buckets(),
            key=lambda b: (b.batch * b.length, b.keys, b),
            reverse=True,
        )
        device = self.lm.device
        if self.lm.cache.keys[0] is None:
            # The KV cache is made by the first forward: before the count, which is the graphs' alone.
            smallest = min(chosen or self.buckets())
            self._fill(smallest, [], None)
            with torch.inference_mode():
                self._body(smallest)
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_reserved(device)
        start = time.perf_counter()
        self._capture(chosen)
        torch.cuda.synchronize(device)
        self.capture_s += time.perf_counter() - start
        self.capture_bytes += torch.cuda.memory_reserved(device) - before


def enable(
    lm: BatchedCausalLM, choice: str, max_length: int, service: str, max_batch: int = BATCH_BUCKETS[-1]
) -> StaticForward | None:
    """Turn on `lm`'s captured forward where `--cuda-graphs` (`choice`) asks for it and `lm` takes
    it; captures every bucket now and logs what that took. None where it stays eager."""
    if not wants_graphs(choice, lm.device):
        return None
    reason = supported(lm)
    if reason is not None:
        if choice == "on":
            raise ValueError(f"--cuda-graphs on: {reason}")
        log.info("the %s runs eagerly: %s", service, reason)
        return None
    static = StaticForward(lm, max_batch, max_length, capture=True, prefill=prefill_lengths(max_length))
    try:
        static.capture_all()
        diff = self_check(lm, static)
    except Exception as exc:
        if choice == "on":
            raise
        # auto: a forward that cannot be captured (an op that waits for the host, say) runs eagerly.
        log.warning("the %s runs eagerly: capturing its CUDA graphs failed (%s: %s)", service, type(exc).__name__, exc)
        lm.static = None
        lm.cache.captured = False
        return None
    if diff is not None:
        # Wrong logits are never worth a faster step: the eager forward serves instead.
        message = f"the {service}'s CUDA graphs gave logits {diff:.3g} away from the eager forward's"
        if choice == "on":
            raise RuntimeError(message)
        log.error("%s: it runs eagerly", message)
        lm.static = None
        lm.cache.captured = False
        return None
    lm.static = static
    log.info(
        "the %s captured %d CUDA graphs (batches %s, blocks 1..%d, prefill chunks padded to %s of at most %d "
        "tokens, keys %s), each run once, in %.1f s, %.0f MiB of device memory; their logits match the eager "
        "forward's",
        service,
        len(static.buckets()),
        ",".join(map(str, static.batches)),
        static.max_length,
        ",".join(map(str, static.prefill)) or "none",
        static.prefill_tokens,
        ",".join(map(str, static.keys)),
        static.capture_s,
        static.capture_bytes / 2**20,
    )
    return static


def self_check(lm: BatchedCausalLM, static: StaticForward) -> float | None:
    """Run a round through `static` and eagerly, and return how far apart their logits are where
    that is beyond rounding, else None. Start-up only (it uses the first slots and releases them).

    The rows start at different positions, feed blocks of different lengths (the longest a token
    tree of two branches where it has three tokens) and leave a padded row in their bucket; two
    steps run each way, and before the graphed pair another eager step
    writes other tokens at the first step's positions, so a graph whose cache writes went astray
    reads those and fails the check. Last, the prompts are prefilled again in one graphed forward,
    those longer than a block padded to a prefill bucket."""
    from specd.engine.kvcache import Row

    rows = min(3, lm.cache.max_slots, static.batches[-1])
    lengths = [4 + 3 * s for s in range(rows)]
    if lengths[-1] + 2 * static.max_length + 1 > lm.cache.max_positions:
        return None  # too short a cache to check in
    vocab = lm.vocab_size
    counts = [min(1 + s, static.max_length) for s in range(rows)]
    tree = [-1, -1, *range(1, counts[-1] - 1)] if counts[-1] >= 3 else None
    first = [Row(s, lengths[s], [(5 + s) % vocab] * counts[s], 0) for s in range(rows)]
    first[-1].parents = tree
    second = [Row(s, lengths[s] + len(first[s].tokens), [(9 + s) % vocab], 0) for s in range(rows)]
    other = [Row(r.slot, r.start, [(r.tokens[0] + 1) % vocab] * len(r.tokens), 0) for r in first]
    prompts = [Row(s, 0, [(11 * s + j) % vocab for j in range(lengths[s])], lengths[s] - 1) for s in range(rows)]
    lm.static = None
    try:
        want = [logits for p in prompts for logits in lm.forward([p])]
        want = lm.forward(first) + lm.forward(second) + want
        lm.forward(other)
        lm.static = static
        got = lm.forward(first) + lm.forward(second) + lm.forward(prompts)
    finally:
        lm.static = None
        for s in range(rows):
            lm.cache.release(s)
    scale = max(1.0, max(float(w.abs().max()) for w in want))
    diff = max(float((g - w).abs().max()) for g, w in zip(got, want, strict=True))
    # Rounding: float32 sums in another order; bfloat16 and float16 keep two or three digits, and
    # a padded batch or more (masked) keys can move the last of them. A graph gone astray is off by
    # about the logits' own scale.
    tolerance = (1e-3 if lm.dtype == torch.float32 else 1e-1) * scale
    return diff if diff > tolerance else None


def read_back(t: torch.Tensor) -> list[Any]:
    """`t.tolist()`: the one wait for the device a round makes where it reads back its verdicts or
    its draft blocks. Nothing else in a round waits for the GPU; a test checks that under
    torch.cuda.set_sync_debug_mode("error"), which this one sanctioned wait sets aside."""
    if t.device.type != "cuda":
        return t.tolist()
    mode = torch.cuda.get_sync_debug_mode()
    if not mode:
        return t.tolist()
    torch.cuda.set_sync_debug_mode(0)
    try:
        return t.tolist()
    finally:
        torch.cuda.set_sync_debug_mode(mode)
