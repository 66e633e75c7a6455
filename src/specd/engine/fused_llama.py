"""A lean forward for Llama-architecture drafters: fused projections, no per-layer framework work.

A draft step feeds one token per sequence, so much of its cost is the fixed cost of each
operation rather than arithmetic: on a CPU, transformers' Llama spends a large share of a
one-token step on module calls, keyword handling and small tensor operations beside the
quantized products (docs/architecture.md, "The fused forward"). This module runs the
same model with

- q, k and v in one product and gate and up in another (their weights concatenated along the
  outputs, so an int8 or int4 copy quantizes every output row exactly as the separate layers would);
- rotary embedding applied to queries and keys in one pass;
- attention on the key/value heads as cached (`_grouped_attention`).

It computes what `LlamaForCausalLM` computes, up to the summation order of the fused products.
The drafter runs it for a cheaper draft step. The verifier runs it too (`--decoder`): exactness
is the verifier's output with and without speculation, and both run this same forward; a
product over concatenated weights computes each output as the separate product does, so its
logits may differ from transformers' only in the last bits, where a CPU's kernel blocks the
outputs differently. `fuse` builds it from a loaded transformers model; `supports` says which
models it takes (anything else keeps transformers' forward); `choose` is the services' flag.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from specd.engine import DECODER_CHOICES
from specd.engine.gemv import RowKernel
from specd.engine.native_layer import NativeLayers, placement

log = logging.getLogger(__name__)


def supports(model: Any) -> bool:
    """Whether `fuse` reproduces this model's forward: transformers' Llama (its attention is plain:
    no sliding window, soft-capping or per-head norms) with the gate·silu·up MLP."""
    from transformers import LlamaForCausalLM

    if type(model) is not LlamaForCausalLM:
        return False
    return getattr(model.config, "hidden_act", None) == "silu"


def _concat(linears: list[nn.Linear]) -> nn.Linear:
    """One nn.Linear whose outputs are those of `linears`, in order."""
    first = linears[0]
    # Made on the meta device and given the concatenation itself: a layer made in place would
    # draw random weights and then copy the concatenation over them, both thrown away.
    out = nn.Linear(
        first.in_features,
        sum(m.out_features for m in linears),
        bias=first.bias is not None,
        device="meta",
        dtype=first.weight.dtype,
    )
    with torch.no_grad():
        out.weight = nn.Parameter(torch.cat([m.weight for m in linears], dim=0))
        if first.bias is not None:
            out.bias = nn.Parameter(torch.cat([m.bias for m in linears], dim=0))
    return out


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # As transformers' LlamaRMSNorm: the variance in float32 whatever the model's dtype.
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def _grouped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """Attention of q [batch, heads, length, dim] over k, v [batch, kv_heads, keys, dim].

    The query heads that share a key/value head become that head's queries, so the product runs
    on the key/value heads as they are cached: no repeated keys, and none of the slow paths
    `enable_gqa` takes on the CPU with a mask. `mask` is grouped the same way (`_group_mask`,
    made once a forward for every layer)."""
    batch, heads, length, dim = q.shape
    groups = k.shape[1]
    if heads > groups:
        q = q.reshape(batch, groups, heads // groups * length, dim)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    # reshape, not view: CUDA's attention kernels may return the grouped rows in another memory layout.
    return out.reshape(batch, heads, length, dim)


def _group_mask(mask: torch.Tensor | None, rep: int) -> torch.Tensor | None:
    """The attention mask [batch, 1, length, keys] for `rep` query heads grouped per key/value head
    (`_grouped_attention`): repeated along the queries; as it is for one query, which broadcasts."""
    if mask is None or rep == 1 or mask.shape[2] == 1:
        return mask
    return mask.repeat(1, 1, rep, 1)


class FusedLlamaLayer(nn.Module):
    """One decoder layer: attention then MLP, each behind an RMSNorm and a residual."""

    def __init__(self, layer: Any, config: Any, index: int, linears: RowKernel) -> None:
        super().__init__()
        # The body's, shared by every layer: one choice of product for the whole model.
        self.linears = linears
        attn, mlp = layer.self_attn, layer.mlp
        self.index = index
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(attn.head_dim)
        self.scaling = float(attn.scaling)
        self.eps = float(config.rms_norm_eps)
        self.input_norm = layer.input_layernorm.weight
        self.post_norm = layer.post_attention_layernorm.weight
        self.qkv_proj = _concat([attn.q_proj, attn.k_proj, attn.v_proj])
        self.o_proj = attn.o_proj
        self.gate_up_proj = _concat([mlp.gate_proj, mlp.up_proj])
        self.down_proj = mlp.down_proj
        # Released as they are fused, so the model never holds both copies of every layer.
        attn.q_proj = attn.k_proj = attn.v_proj = mlp.gate_proj = mlp.up_proj = None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None, cache: Any
    ) -> torch.Tensor:
        """`sin` has its first half negated (`FusedLlamaBody.forward`). The products (and the layers,
        in the body) are called through `.forward` (`RowKernel` calls a product's): a one-token step
        makes about 150 such calls, and nn.Module's call machinery (hooks, which nothing here
        registers) was a visible share of it."""
        batch, length, _ = x.shape
        d, hq, hkv = self.head_dim, self.heads, self.kv_heads
        qkv = self.linears(self.qkv_proj, _rms_norm(x, self.input_norm, self.eps)).view(batch, length, hq + 2 * hkv, d)
        qk = qkv[:, :, : hq + hkv]
        half = d // 2
        # transformers' rotate_half(qk) * sin, with rotate_half's negation folded into `sin`.
        qk = qk * cos + torch.cat((qk[..., half:], qk[..., :half]), dim=-1) * sin
        q = qk[:, :, :hq].transpose(1, 2)
        k = qk[:, :, hq:].transpose(1, 2)
        v = qkv[:, :, hq + hkv :].transpose(1, 2)
        if cache is not None:
            k, v = cache.update(k, v, self.index)
        attended = _grouped_attention(q, k, v, mask, self.scaling)
        x = x + self.linears(self.o_proj, attended.transpose(1, 2).reshape(batch, length, hq * d))
        gate, up = self.linears(self.gate_up_proj, _rms_norm(x, self.post_norm, self.eps)).chunk(2, dim=-1)
        return x + self.linears(self.down_proj, F.silu(gate) * up)


@dataclass
class _Output:
    last_hidden_state: torch.Tensor


class FusedLlamaBody(nn.Module):
    """The decoder stack; called as transformers' base model is by `specd.engine.kvcache.BatchedCausalLM`."""

    cache_keyword = "cache"

    def __init__(self, base: Any, config: Any) -> None:
        super().__init__()
        self.embed_tokens = base.embed_tokens
        self.rotary_emb = base.rotary_emb
        # Torch's products until `choose_products` takes the kernel's.
        self.linears = RowKernel()
        self.layers = nn.ModuleList(
            FusedLlamaLayer(layer, config, i, self.linears)
            for i, layer in enumerate(base.layers[: config.num_hidden_layers])
        )
        self.norm = base.norm.weight
        self.eps = float(config.rms_norm_eps)
        self.heads_per_kv_head = int(config.num_attention_heads) // int(config.num_key_value_heads)
        # The layers in one C call each (specd.engine.native_layer), made by `choose_products` where they apply.
        self.native: NativeLayers | None = None

    def choose_products(self, max_rows: int, activations: str = "float32") -> int:
        """Run the float32 linears' products through the gemv kernel, and each decoder layer in one
        native call where the layers take it, for every forward of 1..max_rows tokens
        (`specd.engine.gemv.RowKernel.choose`: a rule, so every such forward takes the same
        products and a token's bits do not depend on the forward it is in); the bound taken.
        `activations`: what the layers with exact blocks multiply them by (`RowKernel.choose`)."""
        products = [
            m for layer in self.layers for m in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
        ]
        taken = self.linears.choose(products, max_rows, activations)
        self.native = NativeLayers.build(self, self.linears.kernel, self.linears.int8) if taken else None
        if self.native is not None:
            log.info("the decoder layers run in one native call each for forwards of 1 to %d tokens", taken)
        return taken

    def kernel_takes(self, tokens: int) -> bool:
        """Whether a forward of `tokens` tokens runs its products on the gemv kernel."""
        return self.linears.takes(tokens)

    def native_forward(
        self,
        tokens: list[list[int]] | torch.Tensor,
        slots: list[int],
        starts: list[int],
        cache: Any,
        trees: Sequence[Sequence[int] | None] | None = None,
    ) -> torch.Tensor | None:
        """The last hidden states [rows, positions, hidden] of rows feeding `tokens` (per row, or one
        id per row as a tensor) at `starts` of `slots`, every layer in one native call
        (`specd.engine.native_layer`), their keys and values written to `cache`; `trees`: each row's
        token tree (its parents, specd.engine.trees), or None for a chain. None where the native
        layers do not take this forward (not built, more tokens than the kernel's bound, a
        tree too large, a cache they cannot address)."""
        counts = [1] * len(slots) if isinstance(tokens, torch.Tensor) else [len(t) for t in tokens]
        native = self.native
        if native is None or not self.linears.takes(sum(counts)):
            return None
        place = placement(starts, counts, trees or [None] * len(counts))
        if place is None:
            return None
        ids = tokens if isinstance(tokens, torch.Tensor) else torch.tensor([t for row in tokens for t in row])
        token_slots = [s for s, n in zip(slots, counts, strict=True) for _ in range(n)]
        with torch.inference_mode():
            x = self.embed_tokens(ids).float().contiguous()
            # A tree's node is rotated at its depth, wherever its key is written.
            cos, sin = self.rotary_emb(x[None], position_ids=torch.tensor(place.rotations)[None, :])
            half = sin.shape[-1] // 2
            sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
            cos, sin = cos[0].float().contiguous(), sin[0].float().contiguous()
            out = native.forward(x, cos, sin, token_slots, place.positions, cache, place.prefixes, place.visible)
            if out is None:
                return None
            flat = _rms_norm(out, self.norm, self.eps)
        if all(n == counts[0] for n in counts):
            return flat.view(len(counts), counts[0], flat.shape[-1])
        hidden = flat.new_zeros(len(counts), max(counts), flat.shape[-1])
        offsets = list(itertools.accumulate(counts, initial=0))
        for i, n in enumerate(counts):
            hidden[i, :n] = flat[offsets[i] : offsets[i] + n]
        return hidden

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Any = None,
        use_cache: bool = True,
    ) -> _Output:
        x = self.embed_tokens(input_ids)
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None, :]
        cos, sin = self.rotary_emb(x, position_ids=position_ids)
        # [batch, length, 1, head_dim]: one rotation for every query and key head; the first half
        # of `sin` negated once here, for every layer's rotation (FusedLlamaLayer.forward).
        half = sin.shape[-1] // 2
        cos, sin = cos[:, :, None, :], torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)[:, :, None, :]
        mask = _group_mask(attention_mask, self.heads_per_kv_head)
        for layer in self.layers:
            x = layer.forward(x, cos, sin, mask, cache if use_cache else None)
        return _Output(_rms_norm(x, self.norm, self.eps))


class FusedLlamaForCausalLM(nn.Module):
    """A Llama causal LM with the lean forward: `model.base_model` and `get_output_embeddings()`."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.config = model.config
        self.body = FusedLlamaBody(model.model, model.config)
        self.lm_head = model.get_output_embeddings()

    @property
    def base_model(self) -> FusedLlamaBody:
        return self.body

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def get_input_embeddings(self) -> nn.Module:
        return self.body.embed_tokens


def fuse(model: Any) -> FusedLlamaForCausalLM:
    """The lean forward over `model`'s weights: copied into the fused products, shared elsewhere.
    `model` is consumed (its separate products are released)."""
    if not supports(model):
        raise ValueError(f"the fused forward does not take {type(model).__name__}")
    return FusedLlamaForCausalLM(model).eval()


def choose(model: Any, decoder: str, service: str) -> Any:
    """`model` with the forward `decoder` (one of DECODER_CHOICES) asks for, logged as `service`'s: fused,
    transformers', or auto, fused wherever `supports` says it reproduces the model. Before any
    quantizing: the fused products are quantized as they are used."""
    if decoder not in DECODER_CHOICES:
        raise ValueError(f"--decoder takes {', '.join(DECODER_CHOICES)}, not {decoder!r}")
    if decoder == "transformers":
        return model
    if not supports(model):
        if decoder == "fused":
            raise ValueError(f"--decoder fused takes a Llama-architecture model, not {type(model).__name__}")
        log.info("the %s runs transformers' forward (%s has no fused one)", service, type(model).__name__)
        return model
    log.info("the %s runs the fused forward (q/k/v and gate/up each one product)", service)
    return fuse(model)
