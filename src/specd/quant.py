"""Weight-only int8 quantization for a cheap draft copy of the target.

Per-output-channel symmetric int8 weights, activations in bfloat16, through
torch's own `_weight_int8pack_mm` kernel. On the embedded model this copy agrees
with the float32 target on ~96.5% of greedy positions at ~1/3 of its step cost
(measurements in the benchmarking issue); agreement is what speculation needs,
and exactness does not depend on it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from specd.timing import best_time

log = logging.getLogger(__name__)

# Never: an input this wide does not happen.
NEVER = 2**62


class Int8WeightOnlyLinear(nn.Module):
    """An nn.Linear with int8 weights; optionally also a bfloat16 copy for wide inputs.

    The int8 kernel reads a quarter of float32's bytes, which is what a step over a few
    rows needs. Over many rows (a prompt's prefill, a large batch) the product is
    compute-bound instead, and where the CPU multiplies bfloat16 matrices fast (AMX) a
    plain bfloat16 product can beat the int8 kernel; elsewhere it is slower. Which holds
    is measured, not assumed. `wide_rows` says from how many rows the copy is used (NEVER: not at all);
    `calibrate_wide_rows` measures it.
    """

    def __init__(self, linear: nn.Linear, keep_wide: bool = False) -> None:
        super().__init__()
        weight = linear.weight.detach().float()
        scales = weight.abs().amax(dim=1).clamp(min=1e-8) / 127.0
        qweight = torch.round(weight / scales[:, None]).clamp(-128, 127).to(torch.int8)
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("scales", scales.to(torch.bfloat16))
        bias = linear.bias.detach().to(torch.bfloat16) if linear.bias is not None else None
        self.register_buffer("bias", bias)
        # The original weights in bfloat16 (not the int8 ones widened: those would cost
        # agreement for no speed), and not saved with the module.
        wide = linear.weight.detach().to(torch.bfloat16).contiguous() if keep_wide else None
        self.register_buffer("wide_weight", wide, persistent=False)
        self.wide_rows = NEVER

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1]).to(torch.bfloat16)
        if self.wide_weight is not None and flat.shape[0] >= self.wide_rows:
            out = nn.functional.linear(flat, self.wide_weight)
        else:
            out = torch.ops.aten._weight_int8pack_mm(flat, self.qweight, self.scales)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*shape[:-1], self.out_features).to(x.dtype)


def quantize_int8(model: nn.Module, keep_wide: bool = False) -> nn.Module:
    """Replace every nn.Linear (lm_head included) by its int8 weight-only copy, in place.

    `keep_wide`: also keep a bfloat16 copy of each weight for wide inputs (see
    Int8WeightOnlyLinear), unused until `set_wide_rows` or `calibrate_wide_rows` enables it.
    """
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, child_name, Int8WeightOnlyLinear(child, keep_wide))
    return model


def _int8_linears(model: nn.Module) -> list[Int8WeightOnlyLinear]:
    return [m for m in model.modules() if isinstance(m, Int8WeightOnlyLinear)]


def set_wide_rows(model: nn.Module, rows: int) -> None:
    """Use the bfloat16 copies for inputs of at least `rows` rows; NEVER (or 0) drops the copies."""
    rows = NEVER if rows <= 0 else rows
    for linear in _int8_linears(model):
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
    linears = _int8_linears(model)
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
        "int8 drafter: bfloat16 weights for inputs of %s rows (int8 / bfloat16 ms by rows: %s)",
        "no" if chosen == NEVER else f">= {chosen}",
        ", ".join(f"{rows}: {a * 1e3:.0f} / {b * 1e3:.0f}" for rows, (a, b) in sorted(timings.items())),
    )
    return chosen
