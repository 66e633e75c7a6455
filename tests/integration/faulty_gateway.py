"""`specd gateway` with one planted bug, for the fault-isolation test: applying a verdict raises
for every sequence whose max_tokens is VICTIM_MAX_TOKENS, once it has a few tokens.

Run as `python faulty_gateway.py GATEWAY-FLAGS...`; the services it talks to are the real ones.
"""

from __future__ import annotations

import sys
from typing import Any

from gateway.round import apply as round_apply
from specd.cli import main

VICTIM_MAX_TOKENS = 23
_commit = round_apply.commit


def _failing_commit(seq: Any, new_tokens: list[int], *args: Any) -> None:
    if seq.max_tokens == VICTIM_MAX_TOKENS and len(seq.output) >= 3:
        raise RuntimeError("injected by the fault-isolation test")
    _commit(seq, new_tokens, *args)


if __name__ == "__main__":
    round_apply.commit = _failing_commit
    main(["gateway", *sys.argv[1:]])
