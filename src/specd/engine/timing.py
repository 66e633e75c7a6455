"""Start-up measurements that choose between two kernels."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Mapping, Sequence

# A candidate kernel is taken for a row count only where it was faster than the incumbent by more than this share.
MARGIN = 0.1
# The largest forward (tokens) whose float32 products the services time at start-up; past it torch's run.
CALIBRATION_ROWS = 64


def calibration_rows(max_rows: int) -> list[int]:
    """The row counts a calibration times, up to `max_rows`: every one to 16 (one-token steps and
    short verifies, where the choice changes fastest), then 24 and 32, then every 16 to 64, then
    every 32; and `max_rows` itself."""
    rows = list(range(1, min(max_rows, 16) + 1))
    while rows and rows[-1] < max_rows:
        last = rows[-1]
        rows.append(min(max_rows, last + (8 if last < 32 else 16 if last < 64 else 32)))
    return rows


def choose_rows(timings: Mapping[int, tuple[float, float]], margin: float = MARGIN) -> frozenset[int]:
    """From {rows: (incumbent seconds, candidate seconds)}, the row counts where the candidate was
    faster by more than `margin` (a tie keeps the incumbent). A count between the timed ones takes
    the verdict of the next timed count above it."""
    timed = sorted(timings)
    chosen: set[int] = set()
    for below, rows in itertools.pairwise([0, *timed]):
        incumbent, candidate = timings[rows]
        if candidate < incumbent * (1.0 - margin):
            chosen.update(range(below + 1, rows + 1))
    return frozenset(chosen)


def best_time(run: Callable[[], object], repeats: int) -> float:
    """Seconds of the fastest of `repeats` calls of `run`, after one untimed call (first-call set-up)."""
    run()
    times = []
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def best_times(runs: Sequence[Callable[[], object]], repeats: int) -> list[float]:
    """Seconds of the fastest of `repeats` calls of each of `runs`, after one untimed call of each.
    The calls alternate, so load from elsewhere on the machine during the measurement falls on
    every candidate alike rather than on whichever was being timed."""
    for run in runs:
        run()
    best = [float("inf")] * len(runs)
    for _ in range(max(1, repeats)):
        for i, run in enumerate(runs):
            start = time.perf_counter()
            run()
            best[i] = min(best[i], time.perf_counter() - start)
    return best
