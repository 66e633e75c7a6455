"""A batched causal LM over a slot-based KV cache (`specd.engine.slot_cache`) with
per-sequence lengths.

A forward pass takes any subset of slots, each with its own number of new tokens at its own
position: new keys/values are written at each row's offset and a 4D mask hides, per row, the
positions beyond its own length. So sequences of different lengths and different accepted
counts share one forward pass, and rolling a sequence back is only lowering its length:
rejected positions are overwritten later, the accepted prefix is never recomputed.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from typing import Any

import torch

from specd.engine import gemv
from specd.engine.attention_layout import layout
from specd.engine.forward_masks import positions_and_mask, row_tree
from specd.engine.head_product import HeadProduct, Keep
from specd.engine.host_threads import around_forward
from specd.engine.rows import Row
from specd.engine.slot_cache import DEFAULT_POSITIONS, DEFAULT_SLOTS, SlotKVCache, to_device
from specd.engine.timing import best_time

log = logging.getLogger(__name__)


def cache_keyword(model: Any) -> str:
    """The keyword an HF model's forward takes its KV cache by: `cache` since transformers 5.24
    renamed it (`past_key_values` then only warns, until it is removed), `past_key_values`
    before. A model that forwards to an HF model inside says which itself."""
    own = getattr(model, "cache_keyword", None)
    if isinstance(own, str):
        return own
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


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

    def calibrate_products(self, max_rows: int, kept: Keep | None = None, activations: str = "float32") -> str:
        """On the CPU, choose the products of forwards of up to max_rows tokens: the gemv kernel for
        the LM head and the decoder's linears (where the model's forward can take it: the fused one,
        `specd.engine.fused_llama`) wherever it applies, by rule, so that every such forward takes
        the same products; where it does not, the head's torch product is timed per row count.
        Other devices keep torch's. `kept`: see `HeadProduct.calibrate`. `activations` "int8": the
        kernel's products from exact weight blocks take int8-quantized activations (specd.engine.gemv);
        ValueError where they cannot (another device, a forward without the kernel, a CPU without
        AVX-512 VNNI or AVX2). "auto": int8 where it can run, float32 elsewhere (`auto_activations`).
        Returns the activations taken."""
        choose = getattr(self._base, "choose_products", None)
        if activations == "auto":
            activations = self.auto_activations()
        if activations != "float32" and (self.device.type != "cpu" or choose is None):
            raise ValueError(
                f"--activations {activations} takes the CPU kernel of the fused forward (--decoder auto or fused, "
                f"a Llama model on the CPU), not this {self.device.type} model's {type(self._base).__name__}"
            )
        if self.device.type != "cpu":
            return activations
        if activations == "int8":
            # int8 products are far from float32's: a forward left to torch's (a long prefill) would
            # give its positions other keys and logits than the kernel's forwards, and a sequence's
            # tokens would depend on the forwards its prompt shared. So the kernel takes every
            # forward the cache can hold (at a long prefill about what torch's products cost, below it less).
            max_rows = max(max_rows, self.cache.max_slots * self.cache.max_positions)
        self.head_product.calibrate(max_rows, kept=kept, activations=activations)
        if choose is not None:
            choose(max_rows, activations)
        return activations

    def auto_activations(self) -> str:
        """int8 where the fused forward's CPU kernel reads exact 4- or 8-bit weight blocks and this CPU
        sums int8 (the products llama.cpp takes for a Q4_1 model: its blocks against 8-bit
        activations, a far cheaper verify than float32's), else float32; logged with the reason."""
        why = self._int8_missing()
        if why:
            log.info("activations: float32 (auto: %s)", why)
            return "float32"
        log.info(
            "activations: int8 (auto: exact weight blocks on a CPU that sums int8; "
            "--activations float32 for float32 products)"
        )
        return "int8"

    def _int8_missing(self) -> str:
        """Why int8 activations cannot run here; empty where they can."""
        if self.device.type != "cpu" or self.dtype != torch.float32:
            return f"a {self.dtype} model on {self.device.type}, not float32 on the CPU"
        if getattr(self._base, "choose_products", None) is None:
            return f"the {type(self._base).__name__} forward does not take the CPU kernel"
        kernel = gemv.load()
        if kernel is None:
            return "the CPU kernel does not load here"
        if not kernel.int8_supported():
            return "this CPU has neither AVX-512 VNNI nor AVX2 and FMA"
        first = next((m for m in self._base.modules() if type(m) is torch.nn.Linear), None)
        if first is None or gemv.as_blocks(first.weight) is None:
            return "the weights have no exact 4- or 8-bit blocks (a Q4_1 or Q8_0 GGUF's)"
        return ""

    def forward(
        self, rows: Sequence[Row], ids: torch.Tensor | None = None, inputs: list[torch.Tensor] | None = None
    ) -> list[torch.Tensor]:
        """Feed each row's tokens; return per row float32 logits [n_wanted, vocab].

        `ids`: [len(rows)] token ids on the model's device, one per row, fed instead of the rows'
        own tokens (each row then has one placeholder token): a step can feed what the previous
        step chose without reading it back to the host. `inputs`, if given, gets each row's head
        inputs [n_wanted, hidden] (`logits_of` turns them into the same logits later)."""
        # Its hidden states are dropped: a bucketed forward's need not be copied out of its buffer.
        return self._forward(rows, ids, keep=False, inputs=inputs)[0] if rows else []

    def forward_hidden(
        self, rows: Sequence[Row], device_ids: torch.Tensor | None = None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Feed each row's tokens (or `device_ids`, as `forward` says); per row, float32 logits
        [n_wanted, vocab] and the last hidden states (the LM head's input) of every fed position,
        [len(tokens), hidden], in the model's dtype."""
        return self._forward(rows, device_ids, keep=True)

    def logits_of(self, inputs: torch.Tensor) -> torch.Tensor:
        """Float32 logits [n, vocab] of head inputs [n, hidden] (the last hidden states)."""
        with torch.inference_mode():
            logits = self.head_product(inputs).float()
            return torch.tanh(logits / self.softcap) * self.softcap if self.softcap else logits

    def _forward(
        self, rows: Sequence[Row], device_ids: torch.Tensor | None, keep: bool, inputs: list[torch.Tensor] | None = None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        if not rows:
            return [], []
        with around_forward(self._base, self.device, sum(len(r.tokens) for r in rows)):
            order, rows, hidden, wanted = self._run(rows, device_ids, keep)
            logits = self.logits_of(wanted)
        if inputs is not None:
            inputs.extend(_by_row(wanted, rows, order))
        states: list[torch.Tensor] = [torch.empty(0)] * len(rows)
        for sorted_i, original_i in enumerate(order):
            states[original_i] = hidden[sorted_i, : len(rows[sorted_i].tokens)]
        return _by_row(logits, rows, order), states

    def forward_argmax(
        self, rows: Sequence[Row], device_ids: torch.Tensor | None = None, inputs: list[torch.Tensor] | None = None
    ) -> torch.Tensor:
        """Feed each row's tokens (or `device_ids`, as `forward` says); the likeliest next token of
        each row's one wanted position, [len(rows)], on the device: `forward`'s argmax, through the
        head's own `argmax` where it has one (`specd.engine.quant.Int8WeightOnlyLinear`). `inputs`
        as `forward`'s."""
        if any(len(r.tokens) - r.logits_from != 1 for r in rows):
            raise ValueError("forward_argmax wants one position of each row")
        if not rows:
            return torch.empty(0, dtype=torch.long, device=self.device)
        argmax = getattr(self._head, "argmax", None)
        with around_forward(self._base, self.device, sum(len(r.tokens) for r in rows)):
            order, sorted_rows, _, wanted = self._run(rows, device_ids)
            with torch.inference_mode():
                # A softcap is monotonic: it moves no argmax.
                best = argmax(wanted) if argmax is not None else self.head_product(wanted).argmax(dim=-1)
        if inputs is not None:
            inputs.extend(_by_row(wanted, sorted_rows, order))
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


def _by_row(values: torch.Tensor, rows: Sequence[Row], order: Sequence[int]) -> list[torch.Tensor]:
    """Per row of the caller's, its wanted positions' part of `values` [wanted, ...], which runs
    in `rows`' order (the forward's, by slot; `order[i]` the caller's index of rows[i])."""
    out: list[torch.Tensor] = [torch.empty(0)] * len(rows)
    offset = 0
    for r, original_i in zip(rows, order, strict=True):
        n = len(r.tokens) - r.logits_from
        out[original_i] = values[offset : offset + n]
        offset += n
    return out
