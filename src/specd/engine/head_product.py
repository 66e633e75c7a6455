"""The output projection's matrix product: the gemv kernel by rule where it applies, else torch's
chosen per row count by measurement.

On a CPU with float32 weights, `specd.engine.gemv`'s kernel takes the head for every row count up to
the bound it is given (from W's exact 8-bit blocks where it has them: a GGUF's Q8_0 embedding tied to
the head). It sums each logit in the same order whatever the row count, so a position's logits are
bitwise the same in a one-token step and in a verify of any size up to that bound, which is what
greedy exactness needs; a per-row-count choice by timing would let a verify and its steps take
different products, so none is made there.

Where the kernel cannot run, torch's product is chosen per row count. Over a handful of rows its CPU
float32 product hidden·Wᵀ with a large W (the vocabulary projection) can cost about one single-row
product per row, and then less over 4 rows than over 3 (docs/pipeline.md, "Measured, and what chose
the default", has the figures). Computing the same numbers as W·hiddenᵀ, with the vocabulary as the
long side, reads W once however many rows there are. Which is faster depends on the CPU, the torch
build and the row count, so both are timed at start-up for the row counts a verify round produces
and the faster is used for each. The two differ in summation order (a few units in the last place),
and torch's product may itself sum a row differently beside other rows: without the kernel, a
verify's logits can differ in the last bits from the one-token steps'.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from specd.engine import gemv
from specd.engine.timing import CALIBRATION_ROWS, best_times, calibration_rows, choose_rows

log = logging.getLogger(__name__)


class HeadProduct:
    """Applies the LM head to gathered hidden states [rows, hidden], with the product chosen by `calibrate`."""

    def __init__(self, head: nn.Module) -> None:
        self.head = head
        self.transposed_rows: frozenset[int] = frozenset()
        # The kernel takes every row count 1..kernel_max_rows (set together by `calibrate`).
        self.kernel: gemv.Gemv | None = None
        self.kernel_max_rows = 0
        self.blocks: gemv.Blocks | None = None
        # `blocks` repacked for int8-quantized hidden states (calibrate's activations="int8").
        self.packed: gemv.Packed | None = None
        # Only a plain linear layer has a weight to multiply from the other side.
        self.applies = type(head) is nn.Linear

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.applies:
            rows = hidden.shape[0]
            if (
                self.kernel is not None
                and 1 <= rows <= self.kernel_max_rows
                and self.kernel.accepts(hidden, self.head.weight)
            ):
                return self.kernel.linear(hidden, self.head.weight, self.head.bias, self.blocks, self.packed)
            if rows in self.transposed_rows:
                return self._transposed(hidden)
        return self.head(hidden)

    def _transposed(self, hidden: torch.Tensor) -> torch.Tensor:
        assert isinstance(self.head, nn.Linear)
        out = torch.mm(self.head.weight, hidden.t()).t().contiguous()
        if self.head.bias is not None:
            out = out + self.head.bias
        return out

    def calibrate(
        self, max_rows: int, repeats: int = 2, kept: Keep | None = None, activations: str = "float32"
    ) -> frozenset[int]:
        """Take the kernel for 1..`max_rows` rows where it loads and the head is a float32 nn.Linear
        on the CPU; else time torch's two products for the row counts `calibration_rows` gives up to
        `max_rows` (at most CALIBRATION_ROWS; best of `repeats`, after one untimed run) and use the
        transposed one where `choose_rows` says. `kept(measure)`: `measure()`'s row counts, or what
        an earlier start kept for them (`specd.engine.calibration`). Returns the transposed row counts.
        `activations` "int8": W's exact blocks against int8-quantized hidden states where W has them
        (a head without blocks stays float32, and says so); ValueError where the kernel cannot do it."""
        gemv.check_activations(activations)
        self.kernel, self.kernel_max_rows, self.blocks, self.transposed_rows = None, 0, None, frozenset()
        self.packed = None
        if not self.applies or max_rows < 1:
            if activations == "int8":
                gemv.require_int8(None, "the LM head")
            return frozenset()
        assert isinstance(self.head, nn.Linear)
        weight = self.head.weight
        kernel = gemv.load() if weight.device.type == "cpu" and weight.dtype == torch.float32 else None
        if activations == "int8":
            gemv.require_int8(kernel, "the LM head")
        if kernel is not None:
            kernel.set_threads(torch.get_num_threads())
            self.kernel, self.kernel_max_rows, self.blocks = kernel, max_rows, gemv.as_blocks(weight)
            if activations == "int8" and self.blocks is not None:
                self.packed = gemv.pack_int8(self.blocks)
            log.info(
                "LM head: the gemv kernel for 1 to %d rows%s, %s activations",
                max_rows,
                f" from W's exact {self.blocks.kind} blocks" if self.blocks is not None else "",
                "int8" if self.packed is not None else "float32",
            )
            return frozenset()
        self.transposed_rows = frozenset((kept or _measured)(lambda: sorted(self._time(max_rows, repeats))))
        log.info(
            "LM head: W·hᵀ for %s",
            f"rows {sorted(self.transposed_rows)}" if self.transposed_rows else "no row count",
        )
        return self.transposed_rows

    def _time(self, max_rows: int, repeats: int) -> frozenset[int]:
        """The row counts whose transposed product `choose_rows` takes, timed."""
        assert isinstance(self.head, nn.Linear)
        weight = self.head.weight
        timings: dict[int, tuple[float, float]] = {}
        with torch.inference_mode():
            for rows in calibration_rows(min(max_rows, CALIBRATION_ROWS)):
                hidden = torch.randn(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
                runs = [lambda h=hidden: self.head(h), lambda h=hidden: self._transposed(h)]
                timings[rows] = tuple(best_times(runs, repeats))  # type: ignore[assignment]
        log.info(
            "LM head timed, plain / transposed ms by rows: %s",
            ", ".join(f"{rows}: {a * 1e3:.1f} / {b * 1e3:.1f}" for rows, (a, b) in sorted(timings.items())),
        )
        return choose_rows(timings)


# What a caller passes to keep a timing's outcome: called with the measurement, returns its value.
Keep = Callable[[Callable[[], list[int]]], list[int]]


def _measured(measure: Callable[[], list[int]]) -> list[int]:
    return measure()
