"""The verifier's side of the one-hop exchange: a round's drafts, joined with its verify by round id.

In the one-hop exchange (docs/architecture.md, "One hop per round") the gateway sends the verifier
its part of a round (the verify tasks, without drafts) at the same time as it sends the drafter its
part, and the drafter sends its drafts here itself. The two meet in `DraftJoin`, keyed by the
gateway instance (the lease owner) and its round id. Either may come first. A verify waits for its
drafts at most the time the gateway gave it, and is verified without them past it, or at once where
the gateway released the round (its drafter failed): a drafter that is down or late costs that
round its drafts, never the round.

Round ids of one gateway only grow, so a delivery for a round at or before the latest verify that
does not await it is refused with the reason (its verify went on without it, or never asked).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

from specd.engine.tasks import SparseDist

# Deliveries held for verifies that have not come yet, and gateways whose latest round is kept.
EARLY_LIMIT = 256
OWNER_LIMIT = 1024


@dataclass(frozen=True)
class Drafts:
    """One sequence's delivered drafts: the chain, and for a sampled sequence each draft's q."""

    tokens: list[int]
    dists: list[SparseDist]


# A round's delivery: drafts by sequence id, or None where the gateway released the round.
Delivery = Mapping[str, Drafts] | None


def drafts_for(limit: int, drafts: Drafts | None) -> tuple[list[int], list[SparseDist]]:
    """The drafts a task that awaits at most `limit` of them verifies: the chain's first `limit`,
    with their distributions; none where the drafter sent none, or distributions that do not
    match its drafts (the verifier cannot check drafts without their q)."""
    if drafts is None or limit <= 0:
        return [], []
    if drafts.dists and len(drafts.dists) != len(drafts.tokens):
        return [], []
    return drafts.tokens[:limit], drafts.dists[:limit]


class DraftJoin:
    """Deliveries waiting for their verify, and verifies waiting for their delivery."""

    def __init__(self, early_limit: int = EARLY_LIMIT, owner_limit: int = OWNER_LIMIT) -> None:
        self._waiting: dict[tuple[str, int], asyncio.Future[Delivery]] = {}
        self._early: OrderedDict[tuple[str, int], Delivery] = OrderedDict()
        self._latest: OrderedDict[str, int] = OrderedDict()  # each gateway's latest round awaiting drafts
        self._early_limit = early_limit
        self._owner_limit = owner_limit
        self.refused = 0  # deliveries refused (late or unknown rounds)

    def deliver(self, owner: str, round_id: int, delivery: Delivery) -> str:
        """Hand a round its drafts (None: release it). Returns "" if taken, else why not."""
        key = (owner, round_id)
        waiter = self._waiting.get(key)
        if waiter is not None and not waiter.done():
            waiter.set_result(delivery)
            return ""
        if round_id <= self._latest.get(owner, 0):
            self.refused += 1
            who = f"gateway {owner!r}" if owner else "the anonymous gateway"
            return (
                f"round {round_id} of {who} awaits no drafts: its verify went on without them "
                "(they came after its wait, or it was released), or it never asked for them"
            )
        self._early[key] = delivery
        while len(self._early) > self._early_limit:
            self._early.popitem(last=False)
        return ""

    async def wait(self, owner: str, round_id: int, timeout_s: float) -> Delivery:
        """The round's delivery, once it comes; None past `timeout_s` or where it was released."""
        self._latest[owner] = max(round_id, self._latest.get(owner, 0))
        self._latest.move_to_end(owner)
        while len(self._latest) > self._owner_limit:
            self._latest.popitem(last=False)
        key = (owner, round_id)
        if key in self._early:
            return self._early.pop(key)
        waiter: asyncio.Future[Delivery] = asyncio.get_running_loop().create_future()
        self._waiting[key] = waiter
        try:
            async with asyncio.timeout(timeout_s):
                return await waiter
        except TimeoutError:
            return None
        finally:
            del self._waiting[key]
            self._forget_before(owner, round_id)

    def _forget_before(self, owner: str, round_id: int) -> None:
        """Deliveries of this gateway's earlier rounds can no longer be taken."""
        for key in [k for k in self._early if k[0] == owner and k[1] < round_id]:
            del self._early[key]
