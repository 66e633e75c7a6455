"""Whether the drafter can be used now, and getting it back when it was lost.

Speculation is an optimisation: the verifier alone finishes every sequence. So a
drafter that crashes, stalls past its deadline or answers out of protocol is
marked down, its sequences continue target-only (k=0), and a background task
polls its health with backoff. Once it answers again the sequences are opened
on it anew from their committed tokens and speculation resumes.

A drafter that comes back may still hold sequences from before (it was only
stalled) or none at all (it restarted). Either way the gateway forgets what it
believed was open there and remembers the ids as stale: they are closed on the
drafter (unknown ids are fine) before any of them is opened again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge

from gateway.backends import DrafterClient, not_found_error

log = logging.getLogger(__name__)

FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 10.0


class DrafterLink:
    def __init__(
        self,
        drafter: DrafterClient,
        registry: CollectorRegistry | None,
        on_up: Callable[[], None] = lambda: None,
        first_backoff_s: float = FIRST_BACKOFF_S,
        max_backoff_s: float = MAX_BACKOFF_S,
    ) -> None:
        self.drafter = drafter
        self.up = True
        self.stale: set[str] = set()
        self.last_error = ""
        self._on_up = on_up
        self._first_backoff_s = first_backoff_s
        self._max_backoff_s = max_backoff_s
        # Consecutive failures without a good round in between: a drafter that
        # answers health checks but fails every round must not be retried at
        # full rate, each try costing a round its deadline.
        self._streak = 0
        self._task: asyncio.Task[None] | None = None
        self._up_gauge = Gauge("specd_drafter_up", "1 while the drafter is used, 0 while lost", registry=registry)
        self._up_gauge.set(1)
        self.failures = Counter(
            "specd_drafter_failures", "Drafter calls that failed (crash, deadline, protocol error)", registry=registry
        )
        self.reconnects = Counter("specd_drafter_reconnects", "Times the drafter came back", registry=registry)

    def succeeded(self) -> None:
        self._streak = 0

    def mark_down(self, reason: str, ids_on_drafter: Iterable[str]) -> None:
        """The drafter failed: forget what is open there and start polling for it."""
        self.failures.inc()
        self.stale.update(ids_on_drafter)
        self.last_error = reason
        if not self.up:
            return
        self.up = False
        # Rounds start on a fresh stream once it is back: this one may be dead or mid-exchange.
        self.drafter.reset_rounds()
        self._streak += 1
        self._up_gauge.set(0)
        log.warning("drafter lost (%s); its sequences continue target-only", reason)
        self._task = asyncio.create_task(self._reconnect(), name="specd-drafter-reconnect")

    async def _reconnect(self) -> None:
        delay = min(self._max_backoff_s, self._first_backoff_s * 2 ** (self._streak - 1))
        while True:
            await asyncio.sleep(delay)
            # Closing the stale ids before it counts as up means no sequence the
            # scheduler opens there afterwards can be closed by mistake.
            if await self.drafter.healthy(timeout_s=self.drafter.timeout_s) and await self._close_stale():
                break
            delay = min(self._max_backoff_s, delay * 2)
        self.up = True
        self._up_gauge.set(1)
        self.reconnects.inc()
        log.info("drafter is back at %s; speculation resumes", self.drafter.address)
        self._on_up()

    async def flush_stale(self) -> bool:
        """Close on the drafter every id it may still hold from before it was lost.

        Returns False (and marks the drafter down again) if the drafter fails.
        """
        if await self._close_stale():
            return True
        self.mark_down("closing stale sequences failed", ())
        return False

    async def _close_stale(self) -> bool:
        if not self.stale:
            return True
        ids = sorted(self.stale)
        try:
            await self.drafter.close_sequences(ids)
        except Exception as exc:
            if not not_found_error(exc):
                log.debug("closing stale sequences on the drafter failed: %s", exc)
                return False
        self.stale.difference_update(ids)
        return True

    def status(self) -> str:
        return "ok" if self.up else "unavailable"

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
