"""Optional per-API-key request rate limits for the HTTP API."""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict

from asyncio_throttle import Throttler

# A request may wait this long for its key's next slot (smoothing a burst)
# before it is refused with 429.
MAX_WAIT_S = 0.2
# Throttlers kept for the most recently seen keys; an evicted key starts afresh.
MAX_KEYS = 10_000


class RateLimiter:
    """`rate` requests per second for each API key (the Authorization bearer token); 0 disables."""

    def __init__(self, rate: float, max_wait_s: float = MAX_WAIT_S) -> None:
        self.rate = rate
        self.max_wait_s = max_wait_s
        self._throttlers: OrderedDict[str, Throttler] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.rate > 0

    def _throttler(self, key: str) -> Throttler:
        throttler = self._throttlers.get(key)
        if throttler is None:
            # Throttler counts whole requests per period: below 1/s, one per 1/rate seconds.
            throttler = Throttler(round(self.rate), 1.0) if self.rate >= 1 else Throttler(1, 1.0 / self.rate)
            self._throttlers[key] = throttler
            if len(self._throttlers) > MAX_KEYS:
                self._throttlers.popitem(last=False)
        else:
            self._throttlers.move_to_end(key)
        return throttler

    async def allow(self, key: str) -> bool:
        """True when the key may send a request now (after at most max_wait_s)."""
        if not self.enabled:
            return True
        try:
            await asyncio.wait_for(self._throttler(key).acquire(), self.max_wait_s)
        except asyncio.TimeoutError:
            return False
        return True


def tenant(key: str) -> str:
    """The drafter's tag for an API key's requests (SequenceSpec.tenant): a digest, so the key
    itself never leaves the gateway."""
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def api_key(authorization: str | None) -> str:
    """The bearer token of an Authorization header; requests without one share the key ''."""
    if authorization and authorization[:7].lower() == "bearer ":
        return authorization[7:].strip()
    return ""
