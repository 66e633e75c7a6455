"""A batched causal LM over a slot-based KV cache with per-sequence lengths.

Each open sequence owns one slot (a row) of a KV tensor per layer, sized once to
the service's bound: `max_slots` sequences of `max_positions` positions each. A
forward pass takes any subset of slots, each with its own number of new tokens
at its own position: new keys/values are written at each row's offset and a 4D
mask hides, per row, the positions beyond its own length. So sequences of
different lengths and different accepted counts share one forward pass, and
rolling a sequence back is only lowering its length: rejected positions are
overwritten later, the accepted prefix is never recomputed.

Memory never grows past the bound and is never copied: the tensors are made at
the first forward at their full size. On the CPU they lie in an anonymous
private mapping, so the kernel backs only the pages written (a slot's positions
are contiguous per head) and `release` hands a closed slot's pages back; on an
accelerator they are allocated outright.
"""

from __future__ import annotations

import inspect
import itertools
import mmap
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers.cache_utils import Cache

from specd.engine.attention_layout import layout
from specd.engine.forward_masks import positions_and_mask, row_tree
from specd.engine.head_product import HeadProduct
from specd.engine.host_threads import around_forward
from specd.engine.rows import Row
from specd.engine.timing import best_time

# Bounds of a BatchedCausalLM used on its own (tests); services reserve their flags' bounds.
DEFAULT_SLOTS = 16
DEFAULT_POSITIONS = 2048
# A bucketed forward's key counts are multiples of this (SlotKVCache.position_room).
KEY_ALIGNMENT = 64


# Anonymous private mappings that can hand pages back (Linux, macOS); elsewhere plain zeros.
_MAP_FLAGS = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
CAN_MAP = bool(_MAP_FLAGS) and hasattr(mmap, "MADV_DONTNEED") and hasattr(mmap.mmap, "madvise")


def _lazy_cpu_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, mmap.mmap | None]:
    """Zeros whose pages the kernel backs only when written, or plain zeros where it cannot."""
    count = torch.Size(shape).numel()
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    if not nbytes or not CAN_MAP:
        return torch.zeros(shape, dtype=dtype), None
    region = mmap.mmap(-1, nbytes, flags=_MAP_FLAGS, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return torch.frombuffer(region, dtype=dtype, count=count).view(shape), region


class SlotKVCache(Cache):
    """Per-layer KV storage [max_slots, kv_heads, max_positions, head_dim], made once.

    Plugged into an HF model as its cache (`cache_keyword`): the model calls `update` once
    per layer with the new tokens' keys/values and attends over what it returns.
    """

    def __init__(
        self,
        num_layers: int,
        device: torch.device,
        dtype: torch.dtype,
        max_slots: int = DEFAULT_SLOTS,
        max_positions: int = DEFAULT_POSITIONS,
    ) -> None:
        super().__init__(layers=[])
        self.num_layers = num_layers
        self.device = device
        self.dtype = dtype
        self.keys: list[torch.Tensor | None] = []
        self.values: list[torch.Tensor | None] = []
        # The CPU mappings behind keys/values, per layer (None: plain tensors).
        self._key_regions: list[mmap.mmap | None] = []
        self._value_regions: list[mmap.mmap | None] = []
        # Whether the tensors hold a scratch row past the bound (`scratch_slot`), and whether CUDA
        # graphs captured them (specd.engine.cuda_graphs): their bound is then fixed.
        self.scratch = False
        self.captured = False
        self.reserve(max_slots, max_positions)
        # Per-forward addressing, set by `prepare`.
        self._rows: torch.Tensor | None = None
        self._row_range: tuple[int, int] | None = None
        self._write_slots: torch.Tensor | None = None
        self._write_pos: torch.Tensor | None = None
        self._pick: tuple[torch.Tensor, torch.Tensor] | None = None
        self._single: tuple[int, int, int] | None = None
        self._kv_len = 0
        # Set by `set_static` (specd.engine.cuda_graphs): the static buffers of a bucketed forward.
        self._static: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None

    # -- the bound ------------------------------------------------------
    def reserve(self, max_slots: int, max_positions: int) -> None:
        """Set the bound: what any slot or position may ever use. Drops what is cached."""
        if max_slots < 1 or max_positions < 1:
            raise ValueError(f"a KV cache needs at least 1 slot and 1 position, got {max_slots} x {max_positions}")
        if getattr(self, "captured", False):
            # Graphs replay reads and writes of these very tensors: new ones would leave them stale.
            raise RuntimeError("this KV cache is captured in CUDA graphs: its bound cannot change")
        self.max_slots = max_slots
        self.max_positions = max_positions
        self.keys = [None] * self.num_layers
        self.values = [None] * self.num_layers
        # Dropped, not closed: views handed to the model may still hold them; the last reference unmaps.
        self._key_regions, self._value_regions = [None] * self.num_layers, [None] * self.num_layers
        # Per slot: positions written since it was last released (what its pages back).
        self._high = [0] * max_slots

    @property
    def scratch_slot(self) -> int:
        """The row past the bound that a bucketed forward's padding writes and reads
        (specd.engine.cuda_graphs): no sequence owns it. Made by `add_scratch`."""
        if not self.scratch:
            raise RuntimeError("this cache has no scratch row (add_scratch)")
        return self.max_slots

    @property
    def position_room(self) -> int:
        """Positions the tensors hold: the bound, and with a scratch row (a bucketed forward) the bound
        rounded up to a multiple of KEY_ALIGNMENT, so every key count a bucket attends is aligned
        (attention kernels pad an unaligned mask; the positions past the bound are never written by
        a sequence, and masked)."""
        if not self.scratch:
            return self.max_positions
        return -(-self.max_positions // KEY_ALIGNMENT) * KEY_ALIGNMENT

    def add_scratch(self) -> None:
        """Make the tensors with a scratch row past the bound, dropping what is cached."""
        if not self.scratch:
            self.scratch = True
            self.reserve(self.max_slots, self.max_positions)

    @property
    def lazy(self) -> bool:
        """Whether the kernel backs only the pages written (CPU), rather than all of it up front."""
        return self.device.type == "cpu" and CAN_MAP

    def _allocate(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, mmap.mmap | None]:
        if not self.lazy:
            return torch.zeros(shape, dtype=dtype, device=self.device), None
        return _lazy_cpu_zeros(shape, dtype)

    def release(self, slot: int) -> None:
        """Hand a freed slot's memory back to the kernel (CPU): its whole pages read as zeros after."""
        if not self._high[slot]:
            return
        self._high[slot] = 0
        for store, regions in ((self.keys, self._key_regions), (self.values, self._value_regions)):
            for t, region in zip(store, regions, strict=True):
                if t is not None and region is not None:
                    _dontneed(region, t, slot)

    def bytes_per_token(self) -> int:
        total = 0
        for store in (self.keys, self.values):
            for t in store:
                if t is not None:
                    total += t.shape[1] * t.shape[3] * t.element_size()
        return total

    def reserved_bytes(self) -> int:
        """The bound in bytes: every slot at every position (known once the first forward made the tensors)."""
        return self.bytes_per_token() * self.max_slots * self.max_positions

    def allocated_bytes(self) -> int:
        """Bytes backed by memory now: all of it on an accelerator, the slots' written positions on the CPU."""
        if not self.lazy:
            return self.reserved_bytes()
        return self.bytes_per_token() * sum(self._high)

    def check_row(self, slot: int, start: int, count: int) -> None:
        if not 0 <= slot < self.max_slots:
            raise ValueError(f"slot {slot} is outside the cache's {self.max_slots} slots")
        if start < 0 or start + count > self.max_positions:
            raise ValueError(
                f"positions {start}..{start + count - 1} are outside the cache's {self.max_positions} positions"
            )

    def copy_prefix(self, source: int, dest: int, count: int) -> None:
        """Give slot `dest` the keys and values of slot `source`'s first `count` positions (a shared prompt)."""
        self.check_row(source, 0, count)
        self.check_row(dest, 0, count)
        with torch.inference_mode():  # the tensors were made by forwards in inference mode
            for store in (self.keys, self.values):
                for t in store:
                    if t is not None:
                        t[dest, :, :count] = t[source, :, :count]
        self._high[dest] = max(self._high[dest], count)

    def compact(self, slot: int, start: int, kept: Sequence[int]) -> None:
        """Move `slot`'s keys and values at start + kept[d] to start + d: a token tree's accepted path."""
        if any(b <= a for a, b in itertools.pairwise(kept)):
            raise ValueError(f"kept positions {list(kept)} are not increasing")
        if moved := [d for d, j in enumerate(kept) if j != d]:
            self.check_row(slot, start, kept[-1] + 1)
            at = to_device([start + kept[d] for d in moved] + [start + d for d in moved], self.device).view(2, -1)
            with torch.inference_mode():
                for t in (*self.keys, *self.values):
                    if t is not None:
                        t[slot, :, at[1]] = t[slot, :, at[0]]

    # -- per-forward addressing ----------------------------------------
    def prepare(self, slots: Sequence[int], lengths: Sequence[int], counts: Sequence[int]) -> None:
        """Rows (sorted by slot) at `lengths` with `counts` new tokens each; padding is never written."""
        self._static = None
        rows = to_device(slots, self.device)
        self._rows = rows
        first, last = min(slots), max(slots)
        contiguous = list(slots) == list(range(first, last + 1))
        self._row_range = (first, last + 1) if contiguous else None
        num_new = max(counts)
        # One row (a single sequence's step or prefill): its positions are one slice of its slot,
        # written by a plain copy, so no index tensors are built for it.
        self._single = (slots[0], lengths[0], counts[0]) if len(slots) == 1 else None
        if self._single is not None:
            self._write_slots = self._write_pos = None
            self._pick = None
        elif all(n == num_new for n in counts):
            starts = to_device(lengths, self.device)
            self._write_slots = rows[:, None].expand(-1, num_new)
            self._write_pos = starts[:, None] + torch.arange(num_new, device=self.device)[None, :]
            self._pick = None
        else:
            # Only each row's own tokens: padding past a row's end could reach past the bound.
            pick_rows = [i for i, n in enumerate(counts) for _ in range(n)]
            pick_cols = [j for n in counts for j in range(n)]
            self._write_slots = to_device([slots[i] for i in pick_rows], self.device)
            self._write_pos = to_device(
                [lengths[i] + j for i, j in zip(pick_rows, pick_cols, strict=True)], self.device
            )
            self._pick = (
                to_device(pick_rows, self.device),
                to_device(pick_cols, self.device),
            )
        for slot, start, n in zip(slots, lengths, counts, strict=True):
            self._high[slot] = max(self._high[slot], start + n)
        self._kv_len = max(s + n for s, n in zip(lengths, counts, strict=True))

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *_: Any,
        **__: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # What else a model passes (`cache_kwargs` positionally before transformers 5.24,
        # `kwargs=` since) is for caches that rotate or quantize; this one needs none of it.
        out = []
        tensors = self.layer_tensors(layer_idx, key_states.shape[1], key_states.shape[3], key_states.dtype)
        for buf, new in zip(tensors, (key_states, value_states), strict=True):
            if self._static is not None:
                out.append(self._static_update(buf, new))
                continue
            if self._single is not None:
                slot, start, count = self._single
                buf[slot, :, start : start + count].copy_(new[0])
            else:
                # new: [batch, heads, num_new, dim] -> [batch, num_new, heads, dim] (or [tokens, heads, dim] picked)
                fresh = new.transpose(1, 2)
                if self._pick is not None:
                    fresh = fresh[self._pick[0], self._pick[1]]
                buf[self._write_slots, :, self._write_pos] = fresh.to(buf.dtype)
            if self._row_range is not None:
                a, b = self._row_range
                out.append(buf[a:b, :, : self._kv_len])
            else:
                out.append(buf[:, :, : self._kv_len].index_select(0, self._rows))
        return out[0], out[1]

    def layer_tensors(
        self, layer_idx: int, heads: int, dim: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's key and value tensors [slots, heads, positions, dim], made at first use."""
        for store, regions in ((self.keys, self._key_regions), (self.values, self._value_regions)):
            if store[layer_idx] is None:
                shape = (self.max_slots + int(self.scratch), heads, self.position_room, dim)
                store[layer_idx], regions[layer_idx] = self._allocate(shape, dtype)
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        assert keys is not None and values is not None
        return keys, values

    def set_static(
        self,
        slots: torch.Tensor | None,
        positions: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
        keys: int = 0,
    ) -> None:
        """Address the next forward by static buffers (specd.engine.cuda_graphs): the new key of each fed
        position [batch * length] is written at (`slots`, `positions`), and the rows attend the first
        `keys` keys of the cache rows `rows` [batch]. None: back to `prepare`'s addressing."""
        if slots is None:
            self._static = None
            return
        assert positions is not None and rows is not None
        self._static = (slots, positions, rows, keys)
        self._kv_len = keys

    def note_written(self, slots: Sequence[int], ends: Sequence[int]) -> None:
        """Slots written up to `ends` by a forward `prepare` did not address (what their pages back)."""
        for slot, end in zip(slots, ends, strict=True):
            self._high[slot] = max(self._high[slot], end)

    def _static_update(self, buf: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        assert self._static is not None
        slots, positions, rows, keys = self._static
        batch, heads, length, dim = new.shape
        buf[slots, :, positions] = new.transpose(1, 2).reshape(batch * length, heads, dim).to(buf.dtype)
        return buf[:, :, :keys].index_select(0, rows)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._kv_len

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.max_positions

    @property
    def is_compileable(self) -> bool:  # type: ignore[override]
        return False


def to_device(values: list[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host values (a list of ids, or a CPU tensor) as a tensor on `device`. Off the CPU the copy
    does not wait: a blocking host-to-device copy first waits for all the work queued on the
    device, which would stall every step of a forward on the step before it."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=torch.long)
    return t if device.type == "cpu" else t.to(device, non_blocking=True)


def cache_keyword(model: Any) -> str:
    """The keyword an HF model's forward takes its KV cache by: `cache` since transformers 5.24
    renamed it (`past_key_values` then only warns, until it is removed), `past_key_values`
    before. A model that forwards to an HF model inside says which itself."""
    own = getattr(model, "cache_keyword", None)
    if isinstance(own, str):
        return own
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _dontneed(region: mmap.mmap, t: torch.Tensor, slot: int) -> None:
    """madvise(MADV_DONTNEED) the whole pages inside one slot's part of a mapped tensor.

    Pages it shares with a neighbouring slot stay: they may hold that slot's keys.
    """
    per_slot = t[0].numel() * t.element_size()
    start, end = slot * per_slot, (slot + 1) * per_slot
    page = mmap.PAGESIZE
    first = -(-start // page) * page
    last = end // page * page
    if last > first:
        region.madvise(mmap.MADV_DONTNEED, first, last - first)


class BatchedCausalLM:
    """An HF causal LM plus a slot KV cache; rows of any lengths in one forward."""

    def __init__(
        self,
        model: Any,
        device: torch.device,
        dtype: torch.dtype,
        max_slots: int = DEFAULT_SLOTS,
        max_positions: int = DEFAULT_POSITIONS,
    ) -> None:
        self.model = model
        self.device = device
        self.dtype = dtype
        config = model.config
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.num_layers = int(text_config.num_hidden_layers)
        head = model.get_output_embeddings()
        self.vocab_size = int(getattr(head, "out_features", 0) or head.weight.shape[0])
        self.max_positions = int(getattr(text_config, "max_position_embeddings", 2048))
        self.hidden_size = int(getattr(text_config, "hidden_size", 0))
        self.softcap = getattr(text_config, "final_logit_softcapping", None)
        # Sliding-window layers get their window in the mask (a prepared mask is used as it is).
        self.attention = layout(text_config)
        self.cache = SlotKVCache(self.num_layers, device, dtype, max_slots, min(max_positions, self.max_positions))
        self._base = model.base_model
        self._cache_keyword = cache_keyword(self._base)
        self._head = model.get_output_embeddings()
        # The head's product is chosen per row count where measured (`calibrate_products`).
        self.head_product = HeadProduct(self._head)
        # Above 0: the model reads a feature beside each token (Row.features).
        self.feature_size = int(getattr(model, "feature_size", 0))
        # The bucketed static forward (specd.engine.cuda_graphs.enable), where one is on.
        self.static: Any = None

    def reserve(self, max_slots: int, max_positions: int) -> None:
        """Bound the cache to `max_slots` sequences of `max_positions` positions (capped by the model's)."""
        self.cache.reserve(max_slots, min(max_positions, self.max_positions))

    def warm_up(self, max_new: int) -> None:
        """Run the shapes of a prefill and of rounds once, so the first request
        does not pay for first-call kernel setup, and make the cache's tensors
        (so its size is known). Slot 0 is released again afterwards."""
        room = self.cache.max_positions
        prompt = max(1, min(32, room - max_new))
        self.forward([Row(0, 0, [0] * prompt, prompt - 1)])
        for n in range(1, min(max_new, room - prompt) + 1):
            self.forward([Row(0, prompt, [0] * n, n - 1)])
        self.cache.release(0)

    def time_steps(self, sizes: Sequence[int], context: int = 16, repeats: int = 3) -> list[tuple[int, int]]:
        """(sequences, ns): a one-token step for a batch of each of `sizes` sequences (those the
        cache has slots for), each after `context` tokens, the fastest of `repeats` after one
        untimed step. Start-up only: it uses slots 0 on and releases them."""
        room = self.cache.max_positions - repeats - 1
        if room < 1:
            return []
        context = max(1, min(context, room))
        timed: list[tuple[int, int]] = []
        for n in sizes:
            if not 0 < n <= self.cache.max_slots:
                continue
            self.forward([Row(slot, 0, [0] * context, context - 1) for slot in range(n)])
            position = context

            def step(n: int = n) -> None:
                nonlocal position
                self.forward([Row(slot, position, [0], 0) for slot in range(n)])
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                position += 1

            timed.append((n, round(best_time(step, repeats) * 1e9)))
            for slot in range(n):
                self.cache.release(slot)
        return timed

    def calibrate_products(self, max_rows: int) -> None:
        """On the CPU, measure the LM head's products for up to max_rows rows and the decoder's linear
        products for forwards of up to max_rows tokens (where the model's forward can choose: the fused
        one, `specd.engine.fused_llama`), and use the fastest for each; other devices keep torch's."""
        if self.device.type != "cpu":
            return
        self.head_product.calibrate(max_rows)
        calibrate = getattr(self._base, "calibrate", None)
        if calibrate is not None:
            calibrate(max_rows, self.round_forward)
        for slot in range(self.cache.max_slots):
            self.cache.release(slot)

    def round_forward(self, tokens: int, context: int = 16) -> Callable[[], object] | None:
        """A forward of `tokens` tokens spread over the cache's slots, one a slot where it has as
        many (a round of that many sequences), each after `context` cached tokens, to time; None
        where the cache cannot hold them. Start-up only: the caller releases the slots."""
        slots = min(tokens, self.cache.max_slots)
        counts = [tokens // slots + (i < tokens % slots) for i in range(slots)]
        context = min(context, self.cache.max_positions - counts[0])
        if context < 1:
            return None
        self.forward([Row(slot, 0, [0] * context, context - 1) for slot in range(slots)])
        return lambda: self.forward([Row(slot, context, [0] * n, n - 1) for slot, n in enumerate(counts)])

    def forward(self, rows: Sequence[Row], ids: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Feed each row's tokens; return per row float32 logits [n_wanted, vocab].

        `ids`: [len(rows)] token ids on the model's device, one per row, fed instead of the rows'
        own tokens (each row then has one placeholder token): a step can feed what the previous
        step chose without reading it back to the host."""
        # Its hidden states are dropped: a bucketed forward's need not be copied out of its buffer.
        return self._forward(rows, ids, keep=False)[0] if rows else []

    def forward_hidden(
        self, rows: Sequence[Row], device_ids: torch.Tensor | None = None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Feed each row's tokens (or `device_ids`, as `forward` says); per row, float32 logits
        [n_wanted, vocab] and the last hidden states (the LM head's input) of every fed position,
        [len(tokens), hidden], in the model's dtype."""
        return self._forward(rows, device_ids, keep=True)

    def _forward(
        self, rows: Sequence[Row], device_ids: torch.Tensor | None, keep: bool
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        if not rows:
            return [], []
        with around_forward(self._base, self.device, sum(len(r.tokens) for r in rows)):
            order, rows, hidden, wanted = self._run(rows, device_ids, keep)
            with torch.inference_mode():
                logits = self.head_product(wanted).float()
                if self.softcap:
                    logits = torch.tanh(logits / self.softcap) * self.softcap
        out: list[torch.Tensor] = []
        offset = 0
        for r in rows:
            n = len(r.tokens) - r.logits_from
            out.append(logits[offset : offset + n])
            offset += n
        result: list[torch.Tensor] = [torch.empty(0)] * len(rows)
        states: list[torch.Tensor] = [torch.empty(0)] * len(rows)
        for sorted_i, original_i in enumerate(order):
            result[original_i] = out[sorted_i]
            states[original_i] = hidden[sorted_i, : len(rows[sorted_i].tokens)]
        return result, states

    def forward_argmax(self, rows: Sequence[Row], device_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Feed each row's tokens (or `device_ids`, as `forward` says); the likeliest next token of
        each row's one wanted position, [len(rows)], on the device: `forward`'s argmax, through the
        head's own `argmax` where it has one (`specd.engine.quant.Int8WeightOnlyLinear`)."""
        if any(len(r.tokens) - r.logits_from != 1 for r in rows):
            raise ValueError("forward_argmax wants one position of each row")
        if not rows:
            return torch.empty(0, dtype=torch.long, device=self.device)
        argmax = getattr(self._head, "argmax", None)
        with around_forward(self._base, self.device, sum(len(r.tokens) for r in rows)):
            order, _, _, wanted = self._run(rows, device_ids)
            with torch.inference_mode():
                # A softcap is monotonic: it moves no argmax.
                best = argmax(wanted) if argmax is not None else self.head_product(wanted).argmax(dim=-1)
        # Back from the slot order the forward ran in to the caller's.
        return best.index_select(0, to_device(sorted(range(len(order)), key=order.__getitem__), best.device))

    def _run(
        self, rows: Sequence[Row], device_ids: torch.Tensor | None, keep: bool = False
    ) -> tuple[list[int], list[Row], torch.Tensor, torch.Tensor]:
        """The forward through the decoder: the rows' order by slot, the rows in it, the last hidden
        states [rows, positions, hidden] and those of the wanted positions [wanted, hidden].
        `keep`: the caller keeps the hidden states past the next forward (a bucketed forward's
        are its buffer's, so they are copied out)."""
        if device_ids is not None and (device_ids.shape != (len(rows),) or any(len(r.tokens) != 1 for r in rows)):
            raise ValueError("device ids feed one token to each row")
        order = sorted(range(len(rows)), key=lambda i: rows[i].slot)
        rows = [rows[i] for i in order]
        for r in rows:
            # Before anything is written: a row past the bound is the caller's error, never growth.
            self.cache.check_row(r.slot, r.start, len(r.tokens))
        if device_ids is not None:
            device_ids = device_ids.index_select(0, to_device(order, device_ids.device))  # in the rows' order
        trees = [row_tree(r.parents, len(r.tokens)) for r in rows]
        # Trees too: the bucketed and native forwards take each token's depth and ancestors.
        if self.static is not None:
            hidden = self.static.run(rows, device_ids)
            if hidden is not None:
                return order, rows, hidden.clone() if keep else hidden, self._wanted(rows, hidden)
        native = self._native(rows, device_ids, trees)
        if native is not None:
            return order, rows, native, self._wanted(rows, native)
        num_new = max(len(r.tokens) for r in rows)
        lengths = [r.start for r in rows]
        self.cache.prepare([r.slot for r in rows], lengths, [len(r.tokens) for r in rows])
        if device_ids is not None:
            ids = device_ids[:, None]
        else:
            ids = torch.zeros((len(rows), num_new), dtype=torch.long)
            for i, r in enumerate(rows):
                ids[i, : len(r.tokens)] = torch.tensor(r.tokens, dtype=torch.long)
            ids = to_device(ids, self.device)
        counts = [len(r.tokens) for r in rows]
        positions, mask = positions_and_mask(
            self.attention, lengths, counts, trees, self.max_positions - 1, self.dtype, self.device
        )
        extra = {}
        if self.feature_size:
            feats = torch.zeros((len(rows), num_new, self.feature_size), dtype=self.dtype)
            for i, r in enumerate(rows):
                if r.features is not None:
                    feats[i, : len(r.tokens)] = r.features.to(self.dtype)
            extra["features"] = to_device(feats, self.device)
        with torch.inference_mode():
            hidden = self._base(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                use_cache=True,
                **{self._cache_keyword: self.cache},
                **extra,
            ).last_hidden_state
        return order, rows, hidden, self._wanted(rows, hidden)

    def _native(self, rows: Sequence[Row], device_ids: torch.Tensor | None, trees: list[Any]) -> torch.Tensor | None:
        """The hidden states [rows, positions, hidden] through the model's native layers
        (`FusedLlamaBody.native_forward`), or None where it has none or they decline.
        `device_ids`: one token per row, in the rows' order, fed instead of their tokens; `trees`: row_tree's."""
        native = getattr(self._base, "native_forward", None)
        if native is None or self.feature_size:
            return None
        tokens = [r.tokens for r in rows] if device_ids is None else device_ids
        hidden = native(tokens, [r.slot for r in rows], [r.start for r in rows], self.cache, trees)
        if hidden is not None:
            self.cache.note_written([r.slot for r in rows], [r.start + len(r.tokens) for r in rows])
        return hidden

    def _wanted(self, rows: Sequence[Row], hidden: torch.Tensor) -> torch.Tensor:
        """The hidden states [wanted, hidden] of each row's positions from its `logits_from` on."""
        picks = [(i, j) for i, r in enumerate(rows) for j in range(r.logits_from, len(r.tokens))]
        with torch.inference_mode():
            # Both index lists in one copy to the device.
            at = to_device([p[0] for p in picks] + [p[1] for p in picks], self.device).view(2, len(picks))
            return hidden[at[0], at[1]]
