"""Weight-only int8 and int4 quantization for a cheap draft copy of the target.

int8: per-output-channel symmetric weights through torch's `_weight_int8pack_mm`.
int4: asymmetric groups of 32 inputs (a scale and an offset each) through torch's
`_weight_int4pack_mm_for_cpu`. That is GGUF's Q4_1 layout, so the inner layers of
a target loaded from a Q4_1 file (the embedded one) are held without loss, in an
eighth of float32's bytes; the LM head stays int8 (`quantize_int4`). Activations
are bfloat16 in both. Agreement is what
speculation needs; exactness does not depend on it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from specd.engine.timing import best_time

log = logging.getLogger(__name__)

# Never: an input this wide does not happen.
NEVER = 2**62


class WeightOnlyLinear(nn.Module):
    """An nn.Linear with quantized weights (see the subclasses); optionally also a bfloat16
    copy of the original weights for wide inputs.

    The quantized kernels read a quarter (int8) or an eighth (int4) of float32's bytes, which
    is what a step over a few rows needs. Over many rows (a prompt's prefill, a large batch)
    the product is compute-bound instead, and where the CPU multiplies bfloat16 matrices fast
    (AMX) a plain bfloat16 product can beat them; elsewhere it is slower. Which holds
    is measured, not assumed. `wide_rows` says from how many rows the copy is used (NEVER: not at all);
    `calibrate_wide_rows` measures it.
    """

    def __init__(self, linear: nn.Linear, keep_wide: bool = False) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        bias = linear.bias.detach().to(torch.bfloat16) if linear.bias is not None else None
        self.register_buffer("bias", bias)
        # The original weights in bfloat16 (not the quantized ones widened: those would cost
        # agreement for no speed), and not saved with the module.
        wide = linear.weight.detach().to(torch.bfloat16).contiguous() if keep_wide else None
        self.register_buffer("wide_weight", wide, persistent=False)
        self.wide_rows = NEVER

    def _apply(self, fn: Callable[..., torch.Tensor], recurse: bool = True) -> WeightOnlyLinear:
        # The kernels take bfloat16 activations and scales whatever dtype the model computes in
        # (`model.to(torch.float32)` would otherwise make the scales float32, which they refuse):
        # floating buffers follow a move to another device, never to another dtype.
        super()._apply(fn, recurse)
        for name, buffer in self._buffers.items():
            if buffer is not None and buffer.is_floating_point() and buffer.dtype != torch.bfloat16:
                self._buffers[name] = buffer.to(torch.bfloat16)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A draft step calls this for every product with one row each, so it does no more than
        # it must: buffers read from the dict (not through nn.Module's attribute lookup), and
        # no conversion where the dtype is already the one wanted.
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        if flat.dtype != torch.bfloat16:
            flat = flat.to(torch.bfloat16)
        buffers = self._buffers
        wide = buffers["wide_weight"]
        if wide is not None and flat.shape[0] >= self.wide_rows:
            out = nn.functional.linear(flat, wide)
        else:
            out = self.narrow(flat)
        bias = buffers["bias"]
        if bias is not None:
            out = out + bias
        out = out.view(*shape[:-1], self.out_features)
        return out if out.dtype == x.dtype else out.to(x.dtype)

    def narrow(self, flat: torch.Tensor) -> torch.Tensor:
        """The quantized product of bfloat16 rows [n, in_features]."""
        raise NotImplementedError


class Int8WeightOnlyLinear(WeightOnlyLinear):
    """Per-output-channel symmetric int8 weights.

    `scout`: also keep an int4 copy of the weights (`Int4WeightOnlyLinear`), for `argmax`. An LM
    head's int4 product reads half the int8 one's bytes, but its own argmax would cost greedy
    agreement with the target (`quantize_int4`); it only shortlists the candidates.
    """

    # Candidates the int4 scout shortlists per row for `argmax` to rescore with the int8 weights.
    SHORTLIST = 64

    def __init__(self, linear: nn.Linear, keep_wide: bool = False, scout: bool = False) -> None:
        super().__init__(linear, keep_wide)
        weight = linear.weight.detach().float()
        scales = weight.abs().amax(dim=1).clamp(min=1e-8) / 127.0
        qweight = torch.round(weight / scales[:, None]).clamp(-128, 127).to(torch.int8)
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("scales", scales.to(torch.bfloat16))
        self.scout = Int4WeightOnlyLinear(linear) if scout and int4_fits(linear) else None

    def narrow(self, flat: torch.Tensor) -> torch.Tensor:
        buffers = self._buffers
        return torch.ops.aten._weight_int8pack_mm(flat, buffers["qweight"], buffers["scales"])

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """The index of each row's largest output, for rows x [n, in_features]: from the int8
        weights, as `forward(x).argmax(-1)` (up to its bfloat16 rounding of the outputs).

        With a scout, only the `SHORTLIST` outputs its int4 product ranks highest are computed
        from the int8 weights: the largest int8 output lies among them unless the two products
        rank it that far apart.
        """
        if self.scout is None or self.wide_rows <= x.shape[0] or self.out_features <= self.SHORTLIST:
            return self.forward(x).argmax(dim=-1)
        flat = x.to(torch.bfloat16)
        candidates = self.scout.narrow(flat).topk(self.SHORTLIST, dim=-1).indices  # [n, SHORTLIST]
        weights = self.qweight[candidates].float()  # [n, SHORTLIST, in_features]
        scores = torch.einsum("ni,nci->nc", flat.float(), weights) * self.scales[candidates].float()
        if self.bias is not None:
            scores = scores + self.bias[candidates].float()
        return candidates.gather(1, scores.argmax(dim=-1, keepdim=True)).squeeze(1)


INT4_GROUP = 32


def int4_fits(linear: nn.Linear, group_size: int = INT4_GROUP) -> bool:
    """Whether torch's CPU int4 kernel takes this layer: inputs in whole groups, outputs in sixteens."""
    return linear.in_features % group_size == 0 and linear.out_features % 16 == 0


class Int4WeightOnlyLinear(WeightOnlyLinear):
    """4-bit weights in asymmetric groups of `group_size` inputs: w = q * scale + low, q in 0..15.

    `max_error` is the largest absolute difference from the original weights: 0 (up to
    float32 rounding) when they were 4-bit in such groups already, as a Q4_1 GGUF's are.
    """

    def __init__(self, linear: nn.Linear, keep_wide: bool = False, group_size: int = INT4_GROUP) -> None:
        if not int4_fits(linear, group_size):
            raise ValueError(f"int4 needs in_features % {group_size} == 0 and out_features % 16 == 0")
        super().__init__(linear, keep_wide)
        weight = linear.weight.detach().float()
        n, k = weight.shape
        groups = weight.view(n, k // group_size, group_size)
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)
        scale = ((high - low) / 15.0).clamp(min=1e-12)
        q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15)
        self.max_error = float((q * scale[..., None] + low[..., None] - groups).abs().max())
        self.group_size = group_size
        self.register_buffer(
            "qweight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).view(n, k), 1)
        )
        # The kernel computes (q - 8) * scale + zero for each group: zero = low + 8 * scale.
        scales_and_zeros = torch.stack([scale, low + 8.0 * scale], dim=-1).transpose(0, 1).contiguous()
        self.register_buffer("scales_and_zeros", scales_and_zeros.to(torch.bfloat16))

    def narrow(self, flat: torch.Tensor) -> torch.Tensor:
        buffers = self._buffers
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            flat, buffers["qweight"], self.group_size, buffers["scales_and_zeros"]
        )


def quantize_int8(model: nn.Module, keep_wide: bool = False) -> nn.Module:
    """Replace every nn.Linear (lm_head included) by its int8 weight-only copy, in place.

    `keep_wide`: also keep a bfloat16 copy of each weight for wide inputs (see
    WeightOnlyLinear), unused until `set_wide_rows` or `calibrate_wide_rows` enables it.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, child_name, Int8WeightOnlyLinear(child, keep_wide, scout=child is head))
    return model


def quantize_int4(model: nn.Module, keep_wide: bool = False, group_size: int = INT4_GROUP) -> float:
    """Replace every nn.Linear by its int4 copy in place, except the LM head and layers the kernel
    does not take, which get the int8 copy; return the largest weight error of the int4 layers.

    The head stays int8: an input embedding tied to it is rarely 4-bit (a Q4_1 GGUF keeps it
    Q8_0), and on the embedded model an int4 head cut greedy agreement with the target from
    0.99 to 0.88 in a one-off measurement (2026-11-23), where int4 inner layers cost nothing.
    Its int4 copy only shortlists the candidates of a greedy argmax (`Int8WeightOnlyLinear.argmax`).
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    worst = 0.0
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            if child is head or not int4_fits(child, group_size):
                setattr(module, child_name, Int8WeightOnlyLinear(child, keep_wide, scout=child is head))
                continue
            linear = Int4WeightOnlyLinear(child, keep_wide, group_size)
            worst = max(worst, linear.max_error)
            setattr(module, child_name, linear)
    return worst


def weights_are_int4(model: nn.Module, group_size: int = INT4_GROUP) -> bool:
    """Whether the model's inner linear layers are already 4-bit in asymmetric groups (from a
    Q4_1 GGUF, say), so an int4 copy loses nothing; checked on the first such layer."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for child in model.modules():
        if isinstance(child, nn.Linear) and child is not head and int4_fits(child, group_size):
            weight = child.weight.detach().float()
            return Int4WeightOnlyLinear(child, False, group_size).max_error <= 1e-6 * float(weight.abs().max())
    return False


def quantize_copy(model: nn.Module, kind: str, keep_wide: bool = False) -> str:
    """Quantize a float32 model in place: `kind` int8, int4, or auto (int4 where the weights are
    4-bit already, else int8). Return the kind used."""
    if kind == "auto":
        kind = "int4" if weights_are_int4(model) else "int8"
    if kind == "int4":
        error = quantize_int4(model, keep_wide=keep_wide)
        log.info("int4 copy: largest weight error %.2g (0: the weights were 4-bit already)", error)
    elif kind == "int8":
        quantize_int8(model, keep_wide=keep_wide)
    else:
        raise ValueError(f"unknown quantization {kind!r}: int8, int4 or auto")
    return kind


def _quantized_linears(model: nn.Module) -> list[WeightOnlyLinear]:
    return [m for m in model.modules() if isinstance(m, WeightOnlyLinear)]


def set_wide_rows(model: nn.Module, rows: int) -> None:
    """Use the bfloat16 copies for inputs of at least `rows` rows; NEVER (or 0) drops the copies."""
    rows = NEVER if rows <= 0 else rows
    for linear in _quantized_linears(model):
        linear.wide_rows = rows
        if rows == NEVER:
            linear.wide_weight = None


def choose_wide_rows(timings: Mapping[int, tuple[float, float]]) -> int:
    """From {rows: (int8 seconds, bfloat16 seconds)} of forwards over that many rows, the fewest rows
    from which bfloat16 was faster at every size measured; NEVER if it was not faster at the widest."""
    chosen = NEVER
    for rows in sorted(timings, reverse=True):
        int8_s, wide_s = timings[rows]
        if wide_s >= int8_s:
            break
        chosen = rows
    return chosen


def calibrate_wide_rows(
    model: nn.Module, forward: Callable[[int], None], sizes: Sequence[int] = (8, 16, 64), repeats: int = 2
) -> int:
    """Time `forward(rows)` with each kernel at each size (best of `repeats`, after one untimed
    run), enable the bfloat16 copies from the size `choose_wide_rows` picks, and return it.
    A model without copies is left as it is (NEVER)."""
    linears = _quantized_linears(model)
    if not linears or any(linear.wide_weight is None for linear in linears):
        return NEVER
    timings: dict[int, tuple[float, float]] = {}
    for rows in sizes:
        best = []
        for threshold in (NEVER, 1):
            for linear in linears:
                linear.wide_rows = threshold
            best.append(best_time(lambda r=rows: forward(r), repeats))
        timings[rows] = (best[0], best[1])
    chosen = choose_wide_rows(timings)
    set_wide_rows(model, chosen)
    log.info(
        "quantized drafter: bfloat16 weights for inputs of %s rows (quantized / bfloat16 ms by rows: %s)",
        "no" if chosen == NEVER else f">= {chosen}",
        ", ".join(f"{rows}: {a * 1e3:.0f} / {b * 1e3:.0f}" for rows, (a, b) in sorted(timings.items())),
    )
    return chosen
