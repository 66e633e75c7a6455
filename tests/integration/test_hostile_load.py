"""The event loop stays free: while hostile requests (megabytes of prompt, hundreds of thousands of
messages or choices) arrive, a small greedy request's latency, and the gaps of a running stream,
stay within a bound of their idle values."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import stack as st
from hostile_probe import describe, hostile, measure


def rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))) / 1024


@pytest.mark.parametrize("attack", [0, 1, 2])
def test_a_small_request_stays_fast_while_hostile_requests_arrive(gateway_for, attack):
    gateway = gateway_for(0)
    before = rss_mb(gateway.proc.pid)
    probe = asyncio.run(measure(st.base_url(gateway), [hostile(st.MODEL)[attack]]))
    time.sleep(0.5)  # the last trims
    after = rss_mb(gateway.proc.pid)
    print(f"{describe(probe)}; gateway RSS {before:.0f} -> {after:.0f} MB")
    assert probe.statuses and set(probe.statuses) == {400}, sorted(set(probe.statuses))
    # Within 2x idle, plus a fifth of a second: idle values here are tens of milliseconds, where two shared
    # cores' scheduling alone moves a gap by that much (test_real_model holds the embedded stack to 2x
    # with no slack). Before, the gateway stalled 3.5-4.3 s here.
    assert probe.loaded < 2 * probe.idle + 0.2, probe
    assert probe.loaded_stream.longest_gap < 2 * probe.idle_stream.longest_gap + 0.2, probe
    # Large bodies' memory goes back (the heap is trimmed after each): before, RSS stayed at +780 MB.
    assert after < before + 150, (before, after)
