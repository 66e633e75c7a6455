"""Start-up timing one service at a time on a host (specd.engine.timing.alone)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from specd.engine import timing


def test_a_second_service_times_only_after_the_first_is_done(tmp_path: Path) -> None:
    lock = tmp_path / "cache" / "start-up-timing.lock"
    events: list[str] = []
    entered = threading.Event()

    def second() -> None:
        with timing.alone(lock):
            events.append("second times")
        entered.set()

    with timing.alone(lock):
        thread = threading.Thread(target=second)
        thread.start()
        assert not entered.wait(0.3)  # it waits while the first one times
        events.append("first done")
    thread.join(5)
    assert events == ["first done", "second times"]


def test_a_lock_that_cannot_be_made_does_not_stop_the_timing(tmp_path: Path) -> None:
    blocker = tmp_path / "a file"
    blocker.write_text("")
    start = time.perf_counter()
    with timing.alone(blocker / "start-up-timing.lock"):  # its folder would be a file
        pass
    assert time.perf_counter() - start < 1
