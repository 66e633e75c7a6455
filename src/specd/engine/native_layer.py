"""The fused Llama forward's decoder layers in one C call each (`layer.c`), for a few tokens on the CPU.

A one-token step of the fused forward makes a few hundred torch calls per layer around its four
products (norms, rotation, the cache write, attention, SiLU, residuals); on one core their fixed
cost is about as large as reading the weights. `layer.c` does a layer's whole work for the tokens
of one forward in one call, with the products through the gemv kernel (from exact blocks where a
layer has them). Each token is computed alone, so its hidden state is bitwise the same in a
one-token step and in a verify of several positions. Greedy speculation is identical to
target-only where every step and verify forward runs here, which `FusedLlamaBody.choose_products`
arranges by rule (every forward up to a bound of tokens, never a choice by timing per count).

Used by `FusedLlamaBody` for forwards of up to the kernel's bound of tokens, when every product is a
float32 nn.Linear without bias on the CPU and the cache holds float32; anything else (a token tree
of more than MAX_TREE_NODES nodes too) keeps the torch forward, whose bits differ.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from specd.engine import gemv
from specd.engine.trees import depths


class _Product(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int64), ("weight", ctypes.c_void_p), ("scales", ctypes.c_void_p)]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("hidden", ctypes.c_int64),
        ("heads", ctypes.c_int64),
        ("kv_heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("inter", ctypes.c_int64),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("qkv", _Product),
        ("o", _Product),
        ("gate_up", _Product),
        ("down", _Product),
    ]


class _Batch(ctypes.Structure):
    _fields_ = [
        ("tokens", ctypes.c_int64),
        ("keys", ctypes.c_int64),
        ("x", ctypes.c_void_p),
        ("cos", ctypes.c_void_p),
        ("sin", ctypes.c_void_p),
        ("slots", ctypes.c_void_p),
        ("positions", ctypes.c_void_p),
        ("cache_keys", ctypes.c_void_p),
        ("cache_values", ctypes.c_void_p),
        ("slot_stride", ctypes.c_int64),
        ("head_stride", ctypes.c_int64),
        ("position_stride", ctypes.c_int64),
        ("work", ctypes.c_void_p),
        ("prefixes", ctypes.c_void_p),
        ("visible", ctypes.c_void_p),
    ]


KINDS = {None: 0, "q4": 1, "q8": 2}
# layer.c's kinds for blocks against int8-quantized activations.
INT8_KINDS = {"q4": 3, "q8": 4}
# layer.c's bound on a head's width (its rotation buffer).
MAX_HEAD_DIM = 512
# layer.c's bound on a token tree's nodes in one row: a node's visible nodes are one uint64's bits.
MAX_TREE_NODES = 64


@dataclass
class Placement:
    """Where a forward's tokens go (`placement`): per token, its cache position, the position it is
    rotated at, and for a forward with token trees, what it sees (`Batch` in layer.c)."""

    positions: list[int]
    rotations: list[int]
    prefixes: list[int] | None = None
    visible: list[int] | None = None


def placement(starts: Sequence[int], counts: Sequence[int], trees: Sequence[Sequence[int] | None]) -> Placement | None:
    """The tokens of rows feeding `counts` tokens at `starts`, each row a chain (None) or a token tree
    (its parents, specd.engine.trees): a node is written at its row's start + its index, rotated at
    start + its depth and sees the keys before start, its ancestors and itself. None where a tree has
    more nodes than layer.c takes."""
    positions = [s + j for s, n in zip(starts, counts, strict=True) for j in range(n)]
    if not any(trees):
        return Placement(positions, positions)
    rotations: list[int] = []
    prefixes: list[int] = []
    visible: list[int] = []
    for start, count, parents in zip(starts, counts, trees, strict=True):
        if parents is None:
            # A chain's token sees every key up to its own: all before it, none picked.
            prefixes += range(start + 1, start + count + 1)
            rotations += range(start, start + count)
            visible += [0] * count
            continue
        if len(parents) > MAX_TREE_NODES:
            return None
        bits: list[int] = []
        for i, parent in enumerate(parents):
            bits.append(1 << i | (bits[parent] if parent >= 0 else 0))
        rotations += (start + d for d in depths(parents))
        prefixes += [start] * count
        visible += bits
    return Placement(positions, rotations, prefixes, visible)


def _product(linear: nn.Module, int8: bool) -> _Product | None:
    if type(linear) is not nn.Linear or linear.bias is not None:
        return None
    weight = linear.weight
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or not weight.is_contiguous():
        return None
    blocks: gemv.Blocks | None = linear.__dict__.get(gemv.BLOCKS_ATTRIBUTE)
    packed: gemv.Packed | None = linear.__dict__.get(gemv.PACKED_ATTRIBUTE)
    if blocks is None:
        return _Product(0, weight.data_ptr(), None)
    if int8 and packed is not None:
        return _Product(INT8_KINDS[packed.kind], packed.q.data_ptr(), packed.scales.data_ptr())
    return _Product(KINDS[blocks.kind], blocks.q.data_ptr(), blocks.scales.data_ptr())


class NativeLayers:
    """The C layers of one fused body (`build` says whether it can have them)."""

    def __init__(self, kernel: gemv.Gemv, layers: list[_Layer], keep: list[Any]) -> None:
        self._run = kernel.library.specd_layer
        self._run.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self._run.restype = ctypes.c_int
        self._work = kernel.library.specd_layer_work
        self._work.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
        self._work.restype = ctypes.c_int64
        self.layers = layers
        # The tensors the structures point into, kept alive with them.
        self._keep = keep

    @classmethod
    def build(cls, body: Any, kernel: gemv.Gemv | None, int8: bool = False) -> NativeLayers | None:
        """For `body`'s FusedLlamaLayers with the kernel loaded; None where a layer is not of the
        form layer.c computes (a product with a bias or not float32, a head too wide or odd).
        `int8`: the products with exact blocks take int8-quantized activations (`gemv_int8.c`)."""
        if kernel is None or not hasattr(kernel.library, "specd_layer"):
            return None
        layers, keep = [], []
        for layer in body.layers:
            linears = (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
            products = [_product(m, int8) for m in linears]
            norms = [layer.input_norm.detach().float().contiguous(), layer.post_norm.detach().float().contiguous()]
            d = layer.head_dim
            if any(p is None for p in products) or d % 8 or d > MAX_HEAD_DIM or layer.heads % layer.kv_heads:
                return None
            qkv, o, gate_up, down = products
            layers.append(
                _Layer(
                    layer.o_proj.out_features,
                    layer.heads,
                    layer.kv_heads,
                    d,
                    layer.down_proj.in_features,
                    layer.eps,
                    layer.scaling,
                    norms[0].data_ptr(),
                    norms[1].data_ptr(),
                    qkv,
                    o,
                    gate_up,
                    down,
                )
            )
            keep.append((norms, layer))
        return cls(kernel, layers, keep)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: Sequence[int],
        positions: Sequence[int],
        cache: Any,
        prefixes: Sequence[int] | None = None,
        visible: Sequence[int] | None = None,
    ) -> torch.Tensor | None:
        """Run every layer on x [tokens, hidden] (float32, updated in place and returned), the tokens
        at (`slots`, `positions`) of `cache`; cos and sin [tokens, head_dim] as FusedLlamaLayer takes
        them. `prefixes` and `visible` (`Placement`): what each token sees where not every key up to
        its own. None (x untouched) where the cache's tensors are not float32 [slots, heads,
        positions, dim] with unit stride on the last."""
        tokens = x.shape[0]
        first = self.layers[0]
        kv = [cache.layer_tensors(i, first.kv_heads, first.head_dim, torch.float32) for i in range(len(self.layers))]
        if any(
            t.dtype != torch.float32 or t.stride(3) != 1 or t.stride() != kv[0][0].stride() for pair in kv for t in pair
        ):
            return None
        slot_t = torch.tensor(slots, dtype=torch.int64)
        position_t = torch.tensor(positions, dtype=torch.int64)
        keys = max(positions) + 1
        work = torch.empty(self._work(ctypes.byref(first), tokens, keys), dtype=torch.float32)
        stride = kv[0][0].stride()
        batch = _Batch(
            tokens,
            keys,
            x.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            slot_t.data_ptr(),
            position_t.data_ptr(),
            None,
            None,
            stride[0],
            stride[1],
            stride[2],
            work.data_ptr(),
        )
        if prefixes is not None and visible is not None:
            # Kept alive by these names until the layers have run.
            seen_from = (ctypes.c_int64 * tokens)(*prefixes)
            seen = (ctypes.c_uint64 * tokens)(*visible)
            batch.prefixes, batch.visible = ctypes.addressof(seen_from), ctypes.addressof(seen)
        for layer, (k, v) in zip(self.layers, kv, strict=True):
            batch.cache_keys, batch.cache_values = k.data_ptr(), v.data_ptr()
            if self._run(ctypes.byref(layer), ctypes.byref(batch)) != 0:
                raise RuntimeError("the native decoder layer refused a shape it was built for")
        return x
