"""Closes the gateway owes a replica: retried until the replica confirms them.

A close can fail in transit (a deadline, a replica that is down), and an open
that fails in transit may still have opened its sequences there. Either way the
replica may hold sequences the gateway no longer tracks, and while the gateway
lives it keeps renewing its lease on them, so they would never expire. Each such
id is owed to that replica until a close with `missing_ok` (an id that is not
open is fine: the replica restarted, or the open never arrived) goes through.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Iterable
from typing import Any

log = logging.getLogger(__name__)


class OwedCloses:
    def __init__(self, service: str) -> None:
        self.service = service
        self._owed: dict[Hashable, set[str]] = {}

    def add(self, replica: Hashable, ids: Iterable[str]) -> None:
        self._owed.setdefault(replica, set()).update(ids)

    def owed(self, replica: Hashable) -> set[str]:
        return set(self._owed.get(replica, ()))

    def forget(self, replica: Hashable) -> None:
        """The replica is gone for good (its name no longer resolves to it)."""
        self._owed.pop(replica, None)

    @property
    def total(self) -> int:
        return sum(len(ids) for ids in self._owed.values())

    async def deliver(self, replica: Hashable, client: Any, only: Iterable[str] | None = None) -> bool:
        """Send the owed closes (all, or those among `only`); True when none of them is owed any more."""
        owed = self._owed.get(replica, set())
        ids = sorted(owed if only is None else owed.intersection(only))
        if not ids:
            return True
        try:
            await client.close_sequences(ids, missing_ok=True)
        except Exception as exc:
            log.debug("owed closes to the %s at %s failed again: %s", self.service, client.address, exc)
            return False
        owed.difference_update(ids)
        if not owed:
            self._owed.pop(replica, None)
        log.info("closed %d sequence(s) owed to the %s at %s", len(ids), self.service, client.address)
        return True
