"""Which keys each layer of a model attends to, for the slot KV cache's own masks.

`BatchedCausalLM` hands the model a prepared 4D mask, and transformers uses a prepared mask
as it is: a layer with a sliding window (Mistral, Phi-3, Gemma-2's every other layer, Qwen's
when configured) would then see every earlier key, not the last `sliding_window`, and the
output would differ from `generate`'s once a sequence outgrows the window. So the mask
carries the window itself: one mask where every layer slides (Mistral, Phi-3, whose forward
takes one mask), or one mask per layer type where the config lists `layer_types` (the
models whose forward takes {layer type: mask}). A layer type with any other pattern
(chunked attention, for one) is refused: specd would not compute what the model computes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

FULL = "full_attention"
SLIDING = "sliding_attention"


class UnsupportedAttention(ValueError):
    """A model whose attention pattern the slot KV cache's masks do not reproduce."""


@dataclass(frozen=True)
class AttentionLayout:
    # Keys a sliding layer sees: its own position and the window - 1 before it; None: no layer slides.
    window: int | None = None
    # The forward takes {layer type: mask} (the config lists layer_types).
    by_layer_type: bool = False

    def masks(self, visible: torch.Tensor, key_pos: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> Any:
        """The model's attention_mask: `visible` [rows, queries, keys] (causal, per row) as an
        additive float mask [rows, 1, queries, keys], each sliding layer's narrowed to its window.
        `key_pos`: each key's position, [keys] alike for every row or [rows, keys] (a token tree's
        keys sit at their depth, not their index)."""
        full = _additive(visible, dtype)
        if self.window is None:
            return full
        keys = key_pos[None, None, :] if key_pos.dim() == 1 else key_pos[:, None, :]
        sliding = _additive(visible & (keys > positions[:, :, None] - self.window), dtype)
        return {FULL: full, SLIDING: sliding} if self.by_layer_type else sliding


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return mask.masked_fill_(~visible, torch.finfo(dtype).min)[:, None]


def layout(text_config: Any) -> AttentionLayout:
    """The layout of a transformers text config; raises UnsupportedAttention naming what it cannot mask."""
    window = getattr(text_config, "sliding_window", None)
    types = getattr(text_config, "layer_types", None)
    if types is not None:
        unknown = sorted(set(types) - {FULL, SLIDING})
        if unknown:
            raise UnsupportedAttention(
                f"{type(text_config).__name__} has layers of attention type {', '.join(unknown)}; "
                "specd's KV cache reproduces full and sliding-window attention only"
            )
        if SLIDING not in types:
            return AttentionLayout()
        if not window:
            raise UnsupportedAttention(f"{type(text_config).__name__} has sliding layers but no sliding_window")
        return AttentionLayout(int(window), by_layer_type=True)
    return AttentionLayout(int(window)) if window else AttentionLayout()
