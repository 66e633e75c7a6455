"""The output projection's matrix product, chosen per row count by measurement.

Over a handful of rows, torch's CPU float32 product hidden·Wᵀ with a large W (the
vocabulary projection) can cost about one single-row product per row, and then less
over 4 rows than over 3 (docs/pipeline.md, "Measured, and what chose the default", has the
figures). Computing the same numbers as W·hiddenᵀ, with the vocabulary as the long
side, reads W once however many rows there are. Which
product is faster depends on the CPU, the torch build and the row count, so the
service measures both at start-up for the row counts a verify round produces (one per
verified position) and uses the faster one for each. The two differ only in summation
order (a few units in the last place); greedy exactness is relative to the same
service's target-only output, whose single-row product is timed and chosen the same way.
On a CPU with float32 weights a third product is timed too, `specd.engine.gemv`'s kernel,
which reads W once for up to 8 rows and sums each logit in the same order whatever the
row count, from W's exact 8-bit blocks where it has them (a GGUF's Q8_0 embedding tied to the head).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from specd.engine import gemv
from specd.engine.timing import best_times, calibration_rows, choose_rows

log = logging.getLogger(__name__)


class HeadProduct:
    """Applies the LM head to gathered hidden states [rows, hidden], with the product chosen per row count."""

    def __init__(self, head: nn.Module) -> None:
        self.head = head
        self.transposed_rows: frozenset[int] = frozenset()
        # Rows taken by `kernel` (set together by `calibrate`); they win over transposed_rows.
        self.kernel_rows: frozenset[int] = frozenset()
        self.kernel: gemv.Gemv | None = None
        self.blocks: gemv.Blocks | None = None
        # Only a plain linear layer has a weight to multiply from the other side.
        self.applies = type(head) is nn.Linear

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.applies:
            rows = hidden.shape[0]
            if rows in self.kernel_rows and self.kernel is not None and self.kernel.accepts(hidden, self.head.weight):
                return self.kernel.linear(hidden, self.head.weight, self.head.bias, self.blocks)
            if rows in self.transposed_rows:
                return self._transposed(hidden)
        return self.head(hidden)

    def _transposed(self, hidden: torch.Tensor) -> torch.Tensor:
        assert isinstance(self.head, nn.Linear)
        out = torch.mm(self.head.weight, hidden.t()).t().contiguous()
        if self.head.bias is not None:
            out = out + self.head.bias
        return out

    def choices(self) -> dict[str, list[int]]:
        """What `calibrate` chose, to keep (`specd.engine.calibration`) and `apply_choices` at a later start."""
        return {"transposed": sorted(self.transposed_rows), "kernel": sorted(self.kernel_rows)}

    def apply_choices(self, choices: dict[str, list[int]]) -> None:
        """Take the row counts a calibration chose (`choices`) without timing."""
        if not self.applies:
            return
        assert isinstance(self.head, nn.Linear)
        weight = self.head.weight
        kernel = gemv.load() if choices["kernel"] and weight.device.type == "cpu" else None
        if kernel is not None:
            kernel.set_threads(torch.get_num_threads())
        self.kernel, self.blocks = kernel, gemv.as_blocks(weight) if kernel is not None else None
        self.kernel_rows = frozenset(choices["kernel"]) if kernel is not None else frozenset()
        self.transposed_rows = frozenset(choices["transposed"]) - self.kernel_rows

    def calibrate(self, max_rows: int, repeats: int = 2) -> frozenset[int]:
        """Time the products for the row counts `calibration_rows` gives up to `max_rows` (best of
        `repeats`, after one untimed run) and use the transposed one where `choose_rows` says, then
        the kernel (where it runs) where it beat the faster of those two by `choose_rows`'s margin;
        returns the transposed row counts."""
        if not self.applies or max_rows < 1:
            return frozenset()
        assert isinstance(self.head, nn.Linear)
        weight = self.head.weight
        kernel = gemv.load() if weight.device.type == "cpu" and weight.dtype == torch.float32 else None
        blocks = gemv.as_blocks(weight) if kernel is not None else None
        if kernel is not None:
            kernel.set_threads(torch.get_num_threads())
        timings: dict[int, tuple[float, float]] = {}
        kernel_timings: dict[int, float] = {}
        with torch.inference_mode():
            for rows in calibration_rows(max_rows):
                hidden = torch.randn(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
                runs = [lambda h=hidden: self.head(h), lambda h=hidden: self._transposed(h)]
                if kernel is not None:
                    runs.append(lambda h=hidden, k=kernel: k.linear(h, weight, self.head.bias, blocks))
                times = best_times(runs, repeats)
                timings[rows] = (times[0], times[1])
                if kernel is not None:
                    kernel_timings[rows] = times[2]
        transposed = choose_rows(timings)
        torch_best = {rows: timings[rows][rows in transposed] for rows in timings}
        self.kernel, self.blocks = kernel, blocks
        self.kernel_rows = choose_rows({rows: (torch_best[rows], t) for rows, t in kernel_timings.items()})
        self.transposed_rows = transposed - self.kernel_rows
        log.info(
            "LM head: W·hᵀ for %s, the gemv kernel for %s%s (plain / transposed / kernel ms by rows: %s)",
            f"rows {sorted(self.transposed_rows)}" if self.transposed_rows else "no row count",
            f"rows {sorted(self.kernel_rows)}" if self.kernel_rows else "no row count",
            f" from W's exact {blocks.kind} blocks" if blocks is not None else "",
            ", ".join(
                f"{rows}: {a * 1e3:.1f} / {b * 1e3:.1f} / "
                + (f"{kernel_timings[rows] * 1e3:.1f}" if rows in kernel_timings else "-")
                for rows, (a, b) in sorted(timings.items())
            ),
        )
        return self.transposed_rows
