"""Hostile requests against a running gateway (issue 39, item 1): what the red-team probe sent, and a
small request's latency and a stream's gaps measured idle and while they arrive."""

from __future__ import annotations

import asyncio
import itertools
import json
import statistics
import time
from dataclasses import dataclass

import httpx
import stack as st


def small(model: str) -> dict:
    return {"model": model, "prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}


def hostile(model: str) -> list[tuple[str, dict]]:
    """What the red-team probe of issue 39 sent: each stalled the gateway for seconds before."""
    pick = [{"role": "user", "content": "pick"}]
    return [
        ("/v1/completions", {"model": model, "prompt": "word " * 1_200_000, "max_tokens": 1}),
        ("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "a"}] * 200_000}),
        ("/v1/chat/completions", {"model": model, "messages": pick, "guided_choice": ["c"] * 100_000}),
    ]


async def latency(client: httpx.AsyncClient, model: str) -> float:
    start = time.monotonic()
    r = await client.post("/v1/completions", json=small(model))
    assert r.status_code == 200, r.text
    return time.monotonic() - start


@dataclass(frozen=True)
class Stream:
    seconds: float  # from the request to the last chunk
    longest_gap: float  # the longest wait between two chunks


# Streams measured each time, idle and loaded: their medians are compared, so one scheduling hiccup
# of a shared 2-core machine does not decide, while a gateway stalled by the attack still fails.
STREAMS = 3


@dataclass(frozen=True)
class Probe:
    idle: float  # a small request's median latency, idle
    loaded: float  # the same while the attack runs
    idle_stream: Stream
    loaded_stream: Stream
    statuses: list[int]  # the attacks' replies


async def stream(client: httpx.AsyncClient, model: str) -> Stream:
    """A 24-token stream's time and longest gap."""
    body = {**small(model), "max_tokens": 24, "stream": True}
    start = time.monotonic()
    arrivals = []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.monotonic())
    return Stream(arrivals[-1] - start, max(b - a for a, b in itertools.pairwise(arrivals)))


async def median_stream(client: httpx.AsyncClient, model: str) -> Stream:
    """The median time and the median longest gap of STREAMS streams, one after another."""
    runs = [await stream(client, model) for _ in range(STREAMS)]
    return Stream(statistics.median(r.seconds for r in runs), statistics.median(r.longest_gap for r in runs))


async def measure(url: str, attacks: list[tuple[str, dict]], model: str = st.MODEL) -> Probe:
    """A small request's median latency and a stream's (median of STREAMS), idle and while each
    attack is sent over and over by two clients; the attacks' statuses."""
    bodies = [(path, json.dumps(body).encode()) for path, body in attacks]
    headers = {"content-type": "application/json"}
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        await latency(client, model)  # warm
        idle = statistics.median([await latency(client, model) for _ in range(5)])
        idle_stream = await median_stream(client, model)
        statuses: list[int] = []
        stop = asyncio.Event()

        async def attacker(path: str, body: bytes) -> None:
            async with httpx.AsyncClient(base_url=url, timeout=120) as own:
                while not stop.is_set():
                    statuses.append((await own.post(path, content=body, headers=headers)).status_code)

        attackers = [asyncio.create_task(attacker(p, b)) for p, b in bodies * 2]
        await asyncio.sleep(1.0)  # the attack under way
        loaded = statistics.median([await latency(client, model) for _ in range(5)])
        loaded_stream = await median_stream(client, model)
        stop.set()
        await asyncio.gather(*attackers)
    return Probe(idle, loaded, idle_stream, loaded_stream, statuses)


def describe(probe: Probe) -> str:
    return (
        f"small request {probe.idle * 1000:.0f} ms idle, {probe.loaded * 1000:.0f} ms under attack; "
        f"a 24-token stream {probe.idle_stream.seconds * 1000:.0f} ms idle (longest gap "
        f"{probe.idle_stream.longest_gap * 1000:.0f}), {probe.loaded_stream.seconds * 1000:.0f} ms under attack "
        f"(longest gap {probe.loaded_stream.longest_gap * 1000:.0f}); {len(probe.statuses)} refused"
    )
