"""The drafter's prefill runs beside the rounds: no round waits for a joining sequence's prefill there."""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

from fake_backends import FakeDrafter, FakeVerifier, reference
from test_chunked_prefill import LONG
from test_scheduler import GREEDY, collect, scheduler

from gateway.backends import BackendError
from gateway.round.scheduler import GenerationParams

PREFILL_S = 0.15  # each of the drafter's prefill exchanges (an open, a chunk): many verifies long
VERIFY_S = 0.005


class SlowPrefillDrafter(FakeDrafter):
    """A drafter whose prefill is slow and whose drafts are quick; it records when it prefilled."""

    def __init__(self) -> None:
        super().__init__()
        self.open_delay_s = PREFILL_S
        self.prefills: list[tuple[float, float]] = []  # (start, end) of each prefill exchange

    async def open(self, specs: list[Any]) -> list[Any]:
        start = time.perf_counter()
        try:
            return await super().open(specs)
        finally:
            self.prefills.append((start, time.perf_counter()))

    async def draft(self, request: Any) -> Any:
        if any(t.prefill_tokens for t in request.tasks):
            start = time.perf_counter()
            await asyncio.sleep(PREFILL_S)
            self.prefills.append((start, time.perf_counter()))
        return await super().draft(request)


def timed_verifies(verifier: Any) -> list[float]:
    """The times `verifier` is asked to verify, filled in as it is."""
    calls: list[float] = []
    verify = verifier.verify

    async def timed(request: Any) -> Any:
        calls.append(time.perf_counter())
        return await verify(request)

    verifier.verify = timed
    return calls


def run(drafter: SlowPrefillDrafter, verifier: FakeVerifier) -> tuple[list[Any], list[float], str, float]:
    """A short request drafting, then a long one joining; the times the verifier was called, and
    the sequence-rounds counted target-only while their drafter cache was not ready."""
    sched = scheduler(verifier, drafter, prefill_chunk_tokens=64)
    sched.drafter_prefill.fits = lambda busy_ns=0.0: 64  # type: ignore[method-assign]
    # Joins at admission are sized to the verifier's open, beside it, and are not this test's subject.
    sched._early_joins = lambda batch, prefilled: ([], {})  # type: ignore[method-assign]
    calls = timed_verifies(verifier)

    async def main() -> Any:
        sched.start()
        try:
            short = sched.submit([3, 4, 5], GenerationParams(200, GREEDY))
            while len(calls) < 3:
                await asyncio.sleep(0)
            long = sched.submit(LONG, GenerationParams(150, GREEDY))
            outs = await asyncio.gather(collect(sched, short), collect(sched, long))
            return outs, long.id
        finally:
            await sched.stop()

    outs, long_id = asyncio.run(main())
    return outs, calls, long_id, sched.metrics.drafter_unready_rounds._value.get()


def test_rounds_go_on_target_only_while_the_drafter_prefills_and_draft_after() -> None:
    drafter = SlowPrefillDrafter()
    verifier = FakeVerifier(drafter=drafter, delay_s=VERIFY_S)
    ((short_ids, _), (long_ids, _)), calls, long_id, unready = run(drafter, verifier)
    assert short_ids == reference([3, 4, 5], 200) and long_ids == reference(LONG, 150)  # as target-only
    assert len(drafter.prefills) >= 2  # the open and a chunk at least, each PREFILL_S long
    # No round waits for a prefill: the verifier is called at least every PREFILL_S / 2 throughout.
    first_prefill = drafter.prefills[0][0]
    gaps = [b - a for a, b in itertools.pairwise(calls) if b > first_prefill]
    assert gaps and max(gaps) < PREFILL_S / 2, max(gaps)
    # Rounds ran while each prefill was pending, and the long request was verified target-only in them.
    drafts = {}  # per verify request: drafts checked for the long request (None: not in it)
    for request, at in zip(verifier.requests, calls, strict=True):
        tasks = [t for t in request.tasks if t.sequence_id == long_id and not t.prefill_tokens]
        drafts[at] = len(tasks[0].draft_token_ids) if tasks else None
    waited = 0
    for start, end in drafter.prefills:
        inside = [at for at in calls if start < at < end]
        assert len(inside) >= 3
        assert all(drafts[at] in (None, 0) for at in inside)
        waited += sum(drafts[at] == 0 for at in inside)
    # The metric counts those rounds (and any other a sequence spent waiting for the drafter).
    assert unready >= waited > 0
    # Once the drafter's prefill is done, the long request drafts.
    done = drafter.prefills[-1][1]
    assert sum(n or 0 for at, n in drafts.items() if at > done) > 0


DEADLINE_S = 0.3  # the drafter's deadline, which its client enforces: a frozen open fails after it


class FreezingDrafter(FakeDrafter):
    """A drafter that freezes once told to: an open then fails at its deadline, as the client fails it."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = False
        self.events: list[tuple[str, list[str]]] = []  # opens and closes, in the order they ended

    async def open(self, specs: list[Any]) -> list[Any]:
        if self.frozen:
            await asyncio.sleep(DEADLINE_S)
            self.events.append(("open failed", [s.sequence_id for s in specs]))
            raise BackendError("deadline exceeded")
        results = await super().open(specs)
        self.events.append(("open", [s.sequence_id for s in specs]))
        return results

    async def close_sequences(self, ids: list[str]) -> None:
        await super().close_sequences(ids)
        self.events.append(("close", list(ids)))


def test_a_drafter_frozen_mid_prefill_is_marked_down_and_stalls_no_round() -> None:
    """A request finishing target-only while its open hangs on a frozen drafter: no round waits
    for that open, its failure at the deadline marks the drafter down, and the id it left there
    is closed only after it."""
    drafter = FreezingDrafter()
    verifier = FakeVerifier(drafter=drafter, delay_s=VERIFY_S)
    sched = scheduler(verifier, drafter)
    sched._early_joins = lambda batch, prefilled: ([], {})  # type: ignore[method-assign]
    calls = timed_verifies(verifier)

    async def main() -> tuple[Any, Any, str]:
        sched.start()
        try:
            long = sched.submit([3, 4, 5], GenerationParams(600, GREEDY))
            while not drafter.events:  # the long request is open on the drafter
                await asyncio.sleep(0.001)
            drafter.frozen = True
            short = sched.submit([6, 7], GenerationParams(4, GREEDY))
            outs = await asyncio.gather(collect(sched, long), collect(sched, short))
            return outs[0], outs[1], short.id
        finally:
            await sched.stop()

    (long_ids, _), (short_ids, _), short_id = asyncio.run(main())
    assert long_ids == reference([3, 4, 5], 600) and short_ids == reference([6, 7], 4)
    assert ("open failed", [short_id]) in drafter.events
    assert "open failed" in sched.drafter_link.last_error  # marked down by the prefill beside the rounds
    # No round waited for the frozen open, though the short request finished while it hung.
    gaps = [b - a for a, b in itertools.pairwise(calls)]
    assert max(gaps) < DEADLINE_S / 2, max(gaps)
    # Its id, which the drafter may hold, is closed there only once the open has ended.
    ends = [i for i, (kind, ids) in enumerate(drafter.events) if short_id in ids]
    assert drafter.events[ends[0]][0] == "open failed" and all(drafter.events[i][0] == "close" for i in ends[1:])
