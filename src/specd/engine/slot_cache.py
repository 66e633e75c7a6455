"""A slot-based KV cache: one slot (a row) of a KV tensor per layer for each open sequence.

The tensors are sized once to the service's bound, `max_slots` sequences of `max_positions`
positions each, and made at the first forward at their full size, so memory never grows past
the bound and is never copied. On the CPU they lie in an anonymous private mapping, so the
kernel backs only the pages written (a slot's positions are contiguous per head) and `release`
hands a closed slot's pages back; on an accelerator they are allocated outright.
"""

from __future__ import annotations

import itertools
import mmap
from collections.abc import Sequence
from typing import Any

import torch
from transformers.cache_utils import Cache

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
