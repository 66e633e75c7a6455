"""A batched causal LM over a slot-based KV cache with per-sequence lengths.

Each open sequence owns one slot (a row) of a preallocated KV tensor per layer.
A forward pass takes any subset of slots, each with its own number of new
tokens at its own position: new keys/values are written at each row's offset and
a 4D mask hides, per row, the positions beyond its own length. So sequences of
different lengths and different accepted counts share one forward pass, and
rolling a sequence back is only lowering its length: rejected positions are
overwritten later, the accepted prefix is never recomputed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache


class SlotKVCache(Cache):
    """Per-layer KV storage [slots, kv_heads, positions, head_dim], grown on demand.

    Plugged into an HF model as `past_key_values`: the model calls `update` once
    per layer with the new tokens' keys/values and attends over what it returns.
    """

    def __init__(self, num_layers: int, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__(layers=[])
        self.num_layers = num_layers
        self.device = device
        self.dtype = dtype
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.slot_capacity = 0
        self.position_capacity = 0
        # Per-forward addressing, set by `prepare`.
        self._rows: torch.Tensor | None = None
        self._row_range: tuple[int, int] | None = None
        self._write_slots: torch.Tensor | None = None
        self._write_pos: torch.Tensor | None = None
        self._kv_len = 0

    # -- capacity -------------------------------------------------------
    def ensure_capacity(self, slots: int, positions: int) -> None:
        new_slots = self.slot_capacity
        while new_slots < slots:
            new_slots = max(1, new_slots * 2)
        new_pos = self.position_capacity
        while new_pos < positions:
            new_pos = max(64, new_pos * 2)
        if (new_slots, new_pos) == (self.slot_capacity, self.position_capacity):
            return
        for store in (self.keys, self.values):
            for i, old in enumerate(store):
                if old is None:
                    continue
                grown = old.new_zeros((new_slots, old.shape[1], new_pos, old.shape[3]))
                grown[: old.shape[0], :, : old.shape[2]] = old
                store[i] = grown
        self.slot_capacity, self.position_capacity = new_slots, new_pos

    def bytes_per_token(self) -> int:
        total = 0
        for store in (self.keys, self.values):
            for t in store:
                if t is not None:
                    total += t.shape[1] * t.shape[3] * t.element_size()
        return total

    def allocated_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in (self.keys, self.values) for t in s if t is not None)

    # -- per-forward addressing ----------------------------------------
    def prepare(self, slots: Sequence[int], lengths: Sequence[int], num_new: int) -> None:
        rows = torch.tensor(slots, dtype=torch.long, device=self.device)
        starts = torch.tensor(lengths, dtype=torch.long, device=self.device)
        self._rows = rows
        first, last = min(slots), max(slots)
        contiguous = list(slots) == list(range(first, last + 1))
        self._row_range = (first, last + 1) if contiguous else None
        self._write_slots = rows[:, None].expand(-1, num_new)
        self._write_pos = starts[:, None] + torch.arange(num_new, device=self.device)[None, :]
        self._kv_len = max(lengths) + num_new

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        cache_kwargs: dict[str, Any] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out = []
        for store, new in ((self.keys, key_states), (self.values, value_states)):
            buf = store[layer_idx]
            if buf is None:
                buf = new.new_zeros((self.slot_capacity, new.shape[1], self.position_capacity, new.shape[3]))
                store[layer_idx] = buf
            # new: [batch, heads, num_new, dim] -> indexed [batch, num_new] x [heads, dim]
            buf[self._write_slots, :, self._write_pos] = new.transpose(1, 2).to(buf.dtype)
            if self._row_range is not None:
                a, b = self._row_range
                out.append(buf[a:b, :, : self._kv_len])
            else:
                out.append(buf[:, :, : self._kv_len].index_select(0, self._rows))
        return out[0], out[1]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._kv_len

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.position_capacity

    @property
    def is_compileable(self) -> bool:  # type: ignore[override]
        return False


@dataclass
class Row:
    """One sequence's part of a batched forward."""

    slot: int
    start: int  # tokens already in the cache for this slot
    tokens: list[int]  # new tokens to feed, written at start, start+1, ...
    logits_from: int  # index into `tokens` of the first position whose logits are wanted


class BatchedCausalLM:
    """An HF causal LM plus a slot KV cache; rows of any lengths in one forward."""

    def __init__(self, model: Any, device: torch.device, dtype: torch.dtype) -> None:
        self.model = model
        self.device = device
        self.dtype = dtype
        config = model.config
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.num_layers = int(text_config.num_hidden_layers)
        head = model.get_output_embeddings()
        self.vocab_size = int(getattr(head, "out_features", 0) or head.weight.shape[0])
        self.max_positions = int(getattr(text_config, "max_position_embeddings", 2048))
        self.softcap = getattr(text_config, "final_logit_softcapping", None)
        self.cache = SlotKVCache(self.num_layers, device, dtype)
        self._base = model.base_model
        self._head = model.get_output_embeddings()
        self._mask_min = torch.finfo(dtype).min

    def warm_up(self, max_new: int) -> None:
        """Run the shapes of a prefill and of rounds once, so the first request
        does not pay for first-call kernel setup. Slot 0 is left with garbage
        that the next sequence using it overwrites."""
        self.forward([Row(0, 0, [0] * 32, 31)])
        for n in range(1, max_new + 1):
            self.forward([Row(0, 32, [0] * n, n - 1)])

    def forward(self, rows: Sequence[Row]) -> list[torch.Tensor]:
        """Feed each row's tokens; return per row float32 logits [n_wanted, vocab]."""
        if not rows:
            return []
        order = sorted(range(len(rows)), key=lambda i: rows[i].slot)
        rows = [rows[i] for i in order]
        num_new = max(len(r.tokens) for r in rows)
        lengths = [r.start for r in rows]
        self.cache.ensure_capacity(max(r.slot for r in rows) + 1, max(lengths) + num_new)
        self.cache.prepare([r.slot for r in rows], lengths, num_new)
        ids = torch.zeros((len(rows), num_new), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r.tokens)] = torch.tensor(r.tokens, dtype=torch.long)
        ids = ids.to(self.device)
        starts = torch.tensor(lengths, dtype=torch.long, device=self.device)
        positions = starts[:, None] + torch.arange(num_new, device=self.device)[None, :]
        kv_len = max(lengths) + num_new
        # Padding of a short row may run past the model's last position; its
        # outputs are discarded, but learned position tables would index out of range.
        positions = positions.clamp(max=self.max_positions - 1)
        key_pos = torch.arange(kv_len, device=self.device)
        # Query at absolute position p sees keys 0..p of its own row only.
        visible = key_pos[None, None, :] <= positions[:, :, None]
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=self.device)
        mask.masked_fill_(~visible, self._mask_min)
        with torch.inference_mode():
            hidden = self._base(
                input_ids=ids,
                attention_mask=mask[:, None],
                position_ids=positions,
                past_key_values=self.cache,
                use_cache=True,
            ).last_hidden_state
            picks = [(i, j) for i, r in enumerate(rows) for j in range(r.logits_from, len(r.tokens))]
            bi = torch.tensor([p[0] for p in picks], device=self.device)
            pj = torch.tensor([p[1] for p in picks], device=self.device)
            logits = self._head(hidden[bi, pj]).float()
            if self.softcap:
                logits = torch.tanh(logits / self.softcap) * self.softcap
        out: list[torch.Tensor] = []
        offset = 0
        for r in rows:
            n = len(r.tokens) - r.logits_from
            out.append(logits[offset : offset + n])
            offset += n
        result: list[torch.Tensor] = [torch.empty(0)] * len(rows)
        for sorted_i, original_i in enumerate(order):
            result[original_i] = out[sorted_i]
        return result
