"""A sequence's standing with the drafter, as one explicit state machine.

The verifier alone can finish every sequence, so the drafter is an optimisation a
sequence may join, lose and re-join. Every change of that standing goes through
`DrafterMembership`, which refuses transitions that make no sense (opening a
sequence that is already open, say) instead of letting flags drift apart.

    OFF ──want──▶ PENDING ──opened──▶ ACTIVE ──park──▶ PARKED
                   ▲  │                 │                │
                   │  └──refused──▶ OFF │                │
                   └────── lost / drafter down ◀─────────┘
    ACTIVE / PARKED ──lost for good (past MAX_REJOINS)──▶ OFF

`DRAFTER_TRANSITIONS` is the table; every change goes through it.

- OFF: never drafts (no drafter, speculation off, the drafter refused it, or it
  was lost too often).
- PENDING: to be opened on the drafter from its committed tokens (after its first
  token, or once a lost drafter is back).
- ACTIVE: open on the drafter and drafting.
- PARKED: open on the drafter but no longer drafting (its drafts were refused);
  it is closed there when it retires.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class DrafterState(enum.Enum):
    OFF = "off"
    PENDING = "pending"
    ACTIVE = "active"
    PARKED = "parked"


class MembershipError(RuntimeError):
    """A transition the state machine does not allow: a gateway bug, never a client's fault."""


# How often a sequence is re-opened on a drafter that answers it has lost it.
MAX_REJOINS = 3

_OPEN = frozenset({DrafterState.ACTIVE, DrafterState.PARKED})

# event: (the states it may leave, the state it enters). `lost` past MAX_REJOINS ends in OFF.
DRAFTER_TRANSITIONS: dict[str, tuple[frozenset[DrafterState], DrafterState]] = {
    "want": (frozenset({DrafterState.OFF}), DrafterState.PENDING),
    "opened": (frozenset({DrafterState.PENDING}), DrafterState.ACTIVE),
    "refused": (frozenset({DrafterState.PENDING}), DrafterState.OFF),
    "park": (frozenset({DrafterState.ACTIVE, DrafterState.PARKED}), DrafterState.PARKED),
    "lost": (_OPEN, DrafterState.PENDING),
    "lost_for_good": (_OPEN, DrafterState.OFF),
    "drafter_down": (_OPEN, DrafterState.PENDING),
}


@dataclass
class DrafterMembership:
    state: DrafterState = DrafterState.OFF
    # Committed tokens the drafter has been told about (valid while open there).
    synced: int = 0
    rejoins: int = 0
    # For a drafter that reads hidden states: the position up to which it has been sent them
    # (valid while open there).
    hidden_sent: int = 0

    @property
    def on_drafter(self) -> bool:
        """Open on the drafter, so it must be closed there when it retires."""
        return self.state in _OPEN

    @property
    def drafting(self) -> bool:
        return self.state is DrafterState.ACTIVE

    @property
    def pending(self) -> bool:
        return self.state is DrafterState.PENDING

    def _move(self, event: str) -> None:
        allowed, to = DRAFTER_TRANSITIONS[event]
        if self.state not in allowed:
            raise MembershipError(f"{event} is not allowed in state {self.state.value}")
        self.state = to

    def _check_open(self, what: str) -> None:
        """What the drafter was told only counts while the sequence is open there."""
        if not self.on_drafter:
            raise MembershipError(f"{what} is not allowed in state {self.state.value}")

    def want(self) -> None:
        """Join the drafter once it has a first token."""
        self._move("want")

    def opened(self, committed: int) -> None:
        self._move("opened")
        self.synced = committed
        self.hidden_sent = 0

    def refused(self) -> None:
        """The drafter would not open it: it runs target-only for good."""
        self._move("refused")

    def synced_to(self, committed: int) -> None:
        self._check_open("synced_to")
        self.synced = committed

    def sent_hidden(self, end: int) -> None:
        self._check_open("sent_hidden")
        self.hidden_sent = max(self.hidden_sent, end)

    def park(self) -> None:
        """Its drafts were refused: stop drafting, but it stays open on the drafter until it retires."""
        self._move("park")

    def lost(self) -> None:
        """The drafter lost this sequence alone (it restarted): open it there again, a few times at most."""
        self._move("lost" if self.rejoins < MAX_REJOINS else "lost_for_good")
        self.rejoins += 1

    def drafter_down(self) -> None:
        """The whole drafter failed: whatever was open there is gone; re-open once it is back."""
        self._move("drafter_down")
