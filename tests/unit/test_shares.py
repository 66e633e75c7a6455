"""Fair shares: a client's cap on sequences held at once (n counts n), and admission fair across clients."""

from __future__ import annotations

import asyncio
import types

import pytest
from fake_backends import EOS, FakeVerifier
from test_scheduler import GREEDY, CharTokenizer, collect

from gateway.failures import GenerationError
from gateway.round.scheduler import GenerationParams, Scheduler
from gateway.round.shares import Shares, fairest


def test_a_client_past_its_cap_gets_429_and_its_share_comes_back_as_sequences_end() -> None:
    shares = Shares(8)
    shares.take("a", 8)
    with pytest.raises(GenerationError, match=r"already holds 8 of its 8 sequences .* needs 1 more") as exc:
        shares.take("a", 1)
    assert exc.value.status == 429 and exc.value.code == "rate_limit_exceeded"
    shares.take("b", 8)  # another client's share is its own
    shares.give_back("a")
    shares.take("a", 1)
    assert Shares(0).take("a", 10_000) is None  # 0: no cap


def test_the_next_admitted_is_the_oldest_of_the_client_running_fewest() -> None:
    seq = [types.SimpleNamespace(client=c) for c in ("a", "a", "a", "b", "c")]
    assert fairest(seq, []) == 0
    assert fairest(seq, [seq[0]]) == 3  # a runs one; b runs none and waits longest of the rest
    assert fairest(seq[1:3], [seq[0]]) == 0  # only a waits


def test_one_clients_many_choices_leave_room_for_anothers_request() -> None:
    async def main() -> tuple[list[int], str]:
        sched = Scheduler(CharTokenizer(), FakeVerifier(), None, 0, 4, [EOS], max_sequences_per_key=8)
        sched.start()
        try:
            params = GenerationParams(40, GREEDY, ignore_eos=True)
            hog = sched.submit_group([3, 4], [params] * 8, client="hog")
            with pytest.raises(GenerationError) as refused:
                sched.submit_group([3, 4], [params] * 8, client="hog")
            other = sched.submit_group([5], [GenerationParams(4, GREEDY, ignore_eos=True)], client="other")[0]
            # The batch holds 4: the other client's sequence goes in the first free slot, before the hog's rest.
            ids, _ = await collect(sched, other)
            running_hog = sum(not s.done for s in hog)
            await asyncio.gather(*(collect(sched, s) for s in hog))
            assert sched.shares.held == {}
            return ids, f"{refused.value.status} {running_hog}"
        finally:
            await sched.stop()

    ids, outcome = asyncio.run(main())
    assert len(ids) == 4
    assert outcome == "429 8"  # it finished while all 8 of the hog's were still running or waiting
