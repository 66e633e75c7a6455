"""Fair shares: how many sequences each client holds at once, and whose waiting sequence goes next.

A client is its API key where the gateway has keys, else its address. `--max-sequences-per-key`
caps what one client holds (waiting or running; a request with n choices holds n): past it, the
request is refused at once with 429 and Retry-After, so one client cannot take every batch slot.
Admission picks, among the waiting sequences, the oldest of the client that runs the fewest, so
a client with many waiting cannot keep another's first request waiting behind all of its own.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from gateway.failures import GenerationError


class Shares:
    def __init__(self, max_per_client: int = 0) -> None:
        self.max_per_client = max_per_client  # 0: no cap
        self.held: Counter[str] = Counter()

    def take(self, client: str, count: int) -> None:
        """Count `count` more sequences against `client`; raises GenerationError (429) past the cap."""
        if self.max_per_client and self.held[client] + count > self.max_per_client:
            raise GenerationError(
                429,
                f"this client already holds {self.held[client]} of its {self.max_per_client} sequences "
                f"(--max-sequences-per-key) and this request needs {count} more",
                "rate_limit_exceeded",
            )
        self.held[client] += count

    def give_back(self, client: str) -> None:
        self.held[client] -= 1
        if self.held[client] <= 0:
            del self.held[client]


def fairest(waiting: Sequence[Any], running: Iterable[Any]) -> int:
    """Index in `waiting` (oldest first) of the next sequence to admit: the oldest of the client with
    the fewest sequences running. Each item has a `client`."""
    counts = Counter(s.client for s in running)
    best, best_count = 0, None
    seen: set[str] = set()
    for i, s in enumerate(waiting):
        if s.client in seen:
            continue
        seen.add(s.client)
        if best_count is None or counts[s.client] < best_count:
            best, best_count = i, counts[s.client]
            if best_count == 0:
                break
    return best
