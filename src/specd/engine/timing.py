"""Start-up measurements that choose between two kernels."""

from __future__ import annotations

import time
from collections.abc import Callable


def best_time(run: Callable[[], object], repeats: int) -> float:
    """Seconds of the fastest of `repeats` calls of `run`, after one untimed call (first-call set-up)."""
    run()
    times = []
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)
