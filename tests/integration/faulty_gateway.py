"""`specd gateway` with one planted bug, for the fault-isolation test: applying a verdict raises
for every sequence whose max_tokens is VICTIM_MAX_TOKENS, once it has a few tokens.

Run as `python faulty_gateway.py GATEWAY-FLAGS...`; the services it talks to are the real ones.
"""

from __future__ import annotations

import sys
from typing import Any

from gateway.round.scheduler import Scheduler
from specd.cli import main

VICTIM_MAX_TOKENS = 23
_commit = Scheduler._commit


def _failing_commit(self: Scheduler, seq: Any, new_tokens: list[int], logprobs: Any = ()) -> None:
    if seq.max_tokens == VICTIM_MAX_TOKENS and len(seq.output) >= 3:
        raise RuntimeError("injected by the fault-isolation test")
    _commit(self, seq, new_tokens, logprobs)


if __name__ == "__main__":
    Scheduler._commit = _failing_commit  # type: ignore[method-assign]
    main(["gateway", *sys.argv[1:]])
