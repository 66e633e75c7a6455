"""How long a forward took on its device, for a round's timings."""

from __future__ import annotations

import time

import torch


class DeviceClock:
    """Started before a forward's launch, stopped after it. On the CPU the forward has run when its
    call returns, so its time is the wall time between the two. On a GPU the call returns once the
    work is queued and the work itself lands in the next readback; two CUDA events on the stream
    time the work, read once that readback has waited for them (`elapsed_ns` after it adds no wait)."""

    def __init__(self, device: torch.device) -> None:
        self._events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        if device.type == "cuda":
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()
        self.start_ns = time.time_ns()
        self.stop_ns = self.start_ns

    def stop(self) -> None:
        self.stop_ns = time.time_ns()
        if self._events is not None:
            self._events[1].record()

    def elapsed_ns(self) -> int:
        """The forward's time: the device's between the events on a GPU, else the wall time."""
        if self._events is None:
            return self.stop_ns - self.start_ns
        start, end = self._events
        end.synchronize()
        return int(start.elapsed_time(end) * 1e6)
