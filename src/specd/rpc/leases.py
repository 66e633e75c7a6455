"""Which lease owner holds which open sequences on a drafter or verifier, and whose lease lapsed.

A lease owner is a gateway instance: it names itself in every open, round and
close, and renews its lease by that traffic or by a KeepAlive while idle. A
gateway that dies, or is cut off, stops renewing; once `lease_s` passes, its
sequences are freed, so slots do not leak when closes never come.

A gateway also holds a presence stream (Attach) to each service. When every one
of an owner's streams has ended (its connections closed: it was killed, or its
host went away) and it neither re-attaches nor sends anything within
`detach_s`, its sequences are freed then, without waiting out the lease; the
lease stays the fallback for a silent partition, where connections stay open.

Every owner has its own namespace of sequence ids: the engine sees
`owner/sequence_id`. A restarted gateway (a new owner id) can therefore neither
reach nor collide with the sequences of the one before it. No gRPC here: the
servicers translate, the engines never see owners.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

SEPARATOR = "/"
# How long an owner whose presence streams all ended may take to come back (a gateway's
# channel reconnects within a second on a healthy network) before its sequences are freed.
DETACH_S = 1.0


def bad_owner(owner: str) -> str:
    """Why `owner` cannot name a lease ("" when it can)."""
    return f"lease_owner must not contain {SEPARATOR!r}" if SEPARATOR in owner else ""


def engine_id(owner: str, sequence_id: str) -> str:
    return f"{owner}{SEPARATOR}{sequence_id}"


def owner_of(key: str) -> str:
    return key.split(SEPARATOR, 1)[0]


def public_message(message: str, owner: str) -> str:
    """An engine message with the owner's prefix taken off the ids it quotes (they appear as repr)."""
    return message.replace(f"'{owner}{SEPARATOR}", "'")


@dataclass
class _Lease:
    renewed: float
    keys: set[str] = field(default_factory=set)
    streams: int = 0  # presence streams open now
    detached_at: float | None = None  # when the last presence stream ended, until the owner is heard from


class Leases:
    """Thread-safe: renewals come from the event loop, opens and closes are recorded on the engine
    thread together with the engine's own change, so a cancelled RPC cannot leave them apart."""

    def __init__(self, lease_s: float, clock: Callable[[], float] = time.monotonic, detach_s: float = DETACH_S) -> None:
        self.lease_s = lease_s  # 0: sequences never expire by the lease (a detach still frees them)
        self.detach_s = detach_s
        self._clock = clock
        self._leases: dict[str, _Lease] = {}
        self._lock = threading.Lock()

    def renew(self, owner: str) -> None:
        now = self._clock()
        with self._lock:
            lease = self._leases.get(owner)
            if lease is None:
                self._leases[owner] = _Lease(now)
            else:
                lease.renewed = now
                # Heard from, so not gone: a presence stream that broke alone must not free live sequences.
                lease.detached_at = None

    def attach(self, owner: str) -> None:
        """A presence stream of `owner` opened."""
        with self._lock:
            lease = self._leases.setdefault(owner, _Lease(self._clock()))
            lease.streams += 1
            lease.renewed = self._clock()
            lease.detached_at = None

    def detach(self, owner: str) -> None:
        """A presence stream of `owner` ended; with none left, its sequences go after detach_s."""
        with self._lock:
            lease = self._leases.get(owner)
            if lease is None:
                return
            lease.streams = max(0, lease.streams - 1)
            if lease.streams == 0:
                lease.detached_at = self._clock()

    def opened(self, owner: str, keys: Iterable[str]) -> None:
        with self._lock:
            lease = self._leases.setdefault(owner, _Lease(self._clock()))
            lease.keys.update(keys)

    def closed(self, keys: Iterable[str]) -> None:
        with self._lock:
            for key in keys:
                lease = self._leases.get(owner_of(key))
                if lease is not None:
                    lease.keys.discard(key)

    def count(self, owner: str) -> int:
        with self._lock:
            lease = self._leases.get(owner)
            return len(lease.keys) if lease is not None else 0

    def expired(self) -> list[str]:
        """Forget every owner not renewed within lease_s, or gone (all presence streams ended) for
        detach_s; returns the sequences they held."""
        now = self._clock()
        keys: list[str] = []
        with self._lock:
            for owner, lease in list(self._leases.items()):
                lapsed = self.lease_s > 0 and lease.renewed < now - self.lease_s
                gone = lease.detached_at is not None and lease.detached_at <= now - self.detach_s
                if lapsed or gone:
                    del self._leases[owner]
                    keys.extend(sorted(lease.keys))
        return keys
