"""The one-hop exchange (gateway/round/direct.py) with in-process fakes joined by the verifier's own
DraftJoin: the drafter hands its drafts to the verifier, the gateway never carries them."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from fake_backends import BrokenDrafter, FakeDrafter, FakeVerifier, reference
from test_scheduler import generate, scheduler

from gateway.round.direct import DirectRound, await_drafts, qualifies, take_delivered
from gateway.round.messages import DraftItem, ProtocolError, RoundPlan
from specd.proto.speculative.v1 import verifier_pb2
from verifier_service.draft_join import DraftJoin, Drafts, drafts_for

PROMPTS = [[3, 4, 5], [9], [1, 2, 3, 4, 5, 6, 7]]
OWNER = "gw"


class DirectVerifier(FakeVerifier):
    """Takes the drafts of the tasks that await them from the join, as the verifier service does."""

    def __init__(self, join: DraftJoin, delay_s: float = 0.0) -> None:
        super().__init__(delay_s)
        self.join = join
        self.awaited = 0  # tasks that awaited their drafts
        self.carried = 0  # tasks whose own request carried drafts
        self.releases = 0

    async def release(self, round_id: int) -> None:
        self.releases += 1
        self.join.deliver(OWNER, round_id, None)

    async def verify(self, request: Any) -> Any:
        direct = [t for t in request.tasks if t.direct_drafts]
        self.carried += sum(bool(t.draft_token_ids) for t in request.tasks)
        delivery = await self.join.wait(OWNER, request.round_id, request.drafts_wait_ms / 1000) if direct else {}
        for task in direct:
            self.awaited += 1
            tokens, _ = drafts_for(task.direct_drafts, (delivery or {}).get(task.sequence_id))
            task.draft_token_ids.extend(tokens)
        reply = await super().verify(request)
        reply.drafts_missing = delivery is None
        for task, result in zip(request.tasks, reply.results, strict=True):
            if task.direct_drafts:
                result.direct_draft_token_ids.extend(task.draft_token_ids)
                del task.draft_token_ids[:]  # the gateway's request stays without them
        return reply


class DeliveringDrafter(FakeDrafter):
    def __init__(self, join: DraftJoin, late_s: float = 0.0) -> None:
        super().__init__()
        self.join = join
        self.late_s = late_s  # deliver this long after drafting
        self.delivered = 0

    async def draft(self, request: Any) -> Any:
        reply = await super().draft(request)
        if request.deliver_to_verifier:
            await asyncio.sleep(self.late_s)
            drafts = {p.sequence_id: Drafts(list(p.token_ids), []) for p in reply.proposals if p.token_ids}
            self.join.deliver(OWNER, request.round_id, drafts)
            self.delivered += 1
        return reply


def one_hop(verifier: DirectVerifier, drafter: Any, wait_s: float = 1.0, **kw: Any) -> Any:
    sched = scheduler(verifier, drafter, **kw)
    sched.exchange.direct = DirectRound(sched.exchange, verifier.release, wait_s)
    return sched


def test_the_drafts_go_straight_to_the_verifier_and_the_output_is_the_targets() -> None:
    join = DraftJoin()
    verifier, drafter = DirectVerifier(join), DeliveringDrafter(join)
    sched = one_hop(verifier, drafter)
    results = generate(sched, PROMPTS)
    assert [ids for ids, _ in results] == [reference(p, 24) for p in PROMPTS]
    assert drafter.delivered > 0 and verifier.awaited > 0
    assert verifier.carried == 0  # the gateway sent no drafts itself
    assert sched.metrics.snapshot()["accepted"] > 0


def test_a_failed_drafter_releases_its_round_at_once() -> None:
    join = DraftJoin()
    verifier = DirectVerifier(join)
    # A wait far longer than the test: only the release lets the round go on.
    sched = one_hop(verifier, BrokenDrafter(), wait_s=60.0)
    started = time.monotonic()
    results = generate(sched, PROMPTS[:1])
    assert [ids for ids, _ in results] == [reference(PROMPTS[0], 24)]
    assert verifier.releases >= 1 and time.monotonic() - started < 10
    assert sched.drafter_link is not None and not sched.drafter_link.up


def test_a_late_drafter_costs_its_rounds_their_drafts_not_the_round() -> None:
    join = DraftJoin()
    verifier, drafter = DirectVerifier(join), DeliveringDrafter(join, late_s=5.0)
    sched = one_hop(verifier, drafter, wait_s=0.02)
    started = time.monotonic()
    results = generate(sched, PROMPTS[:1], max_tokens=8)
    assert [ids for ids, _ in results] == [reference(PROMPTS[0], 8)]
    assert time.monotonic() - started < 2.5  # no round waited for the late drafter itself
    assert sched.exchange.direct.missed._value.get() >= 1
    assert sched.drafter_link is not None and not sched.drafter_link.up


def test_a_delivery_for_a_round_no_longer_awaited_is_refused_with_its_reason() -> None:
    async def main() -> tuple[Any, str, str, Any]:
        join = DraftJoin()
        early = join.deliver("a", 2, {"s": Drafts([1, 2], [])})  # before its verify: kept
        got = await join.wait("a", 2, 1.0)
        missed = await join.wait("a", 3, 0.01)
        late = join.deliver("a", 3, {"s": Drafts([1], [])})
        return got, early, late, missed

    got, early, late, missed = asyncio.run(main())
    assert early == "" and got == {"s": Drafts([1, 2], [])} and missed is None
    assert "round 3 of gateway 'a' awaits no drafts" in late


def test_a_released_round_is_verified_without_drafts_at_once() -> None:
    async def main() -> tuple[Any, float]:
        join = DraftJoin()
        waiting = asyncio.create_task(join.wait("a", 1, 60.0))
        await asyncio.sleep(0)
        started = time.monotonic()
        assert join.deliver("a", 1, None) == ""
        return await waiting, time.monotonic() - started

    delivery, waited = asyncio.run(main())
    assert delivery is None and waited < 1.0


def test_drafts_for_takes_at_most_the_tasks_k_and_never_drafts_without_their_q() -> None:
    assert drafts_for(2, Drafts([5, 6, 7], [])) == ([5, 6], [])
    assert drafts_for(2, Drafts([5, 6, 7], ["q1"])) == ([], [])  # type: ignore[list-item]
    assert drafts_for(0, Drafts([5], [])) == ([], []) and drafts_for(3, None) == ([], [])


class Seq:
    def __init__(self, sid: str) -> None:
        self.id = sid


def test_only_plain_sequential_rounds_qualify() -> None:
    s = Seq("a")
    assert qualifies(RoundPlan(pre_draft=[DraftItem(s, 3)]))  # type: ignore[arg-type]
    assert not qualifies(RoundPlan())
    assert not qualifies(RoundPlan(pre_draft=[DraftItem(s, 3, siblings=1)]))  # type: ignore[arg-type]
    assert not qualifies(RoundPlan(pre_draft=[DraftItem(s, 3)], ahead=[DraftItem(s, 3, assumed=())]))  # type: ignore[arg-type]


def test_the_verdicts_are_read_against_what_the_verifier_verified() -> None:
    request = verifier_pb2.VerifyRequest(round_id=1)
    request.tasks.add(sequence_id="a", num_committed=3)
    request.tasks.add(sequence_id="b", num_committed=3)
    assert await_drafts(request, [DraftItem(Seq("a"), 3)], {"a": 3, "b": 2}) == 1  # type: ignore[arg-type]
    assert [t.direct_drafts for t in request.tasks] == [3, 0]
    reply = verifier_pb2.VerifyResponse(round_id=1)
    reply.results.add(sequence_id="a", direct_draft_token_ids=[7, 8])
    reply.results.add(sequence_id="b")
    assert take_delivered(request, reply) == {"a": 2}
    assert list(request.tasks[0].draft_token_ids) == [7, 8]
    reply.results[0].direct_draft_token_ids.extend([9, 10])
    request.tasks[0].ClearField("draft_token_ids")
    with pytest.raises(ProtocolError):
        take_delivered(request, reply)


def test_direct_needs_one_drafter_and_one_verifier() -> None:
    from gateway.config import GatewayConfig

    GatewayConfig(exchange="direct").validate()
    with pytest.raises(ValueError, match="needs a drafter"):
        GatewayConfig(exchange="direct", drafter="").validate()
    with pytest.raises(ValueError, match="one drafter and one verifier"):
        GatewayConfig(exchange="direct", verifier="127.0.0.1:1,127.0.0.1:2").validate()
    with pytest.raises(ValueError, match="one drafter and one verifier"):
        GatewayConfig(exchange="direct", drafter="dns:///drafters:50051").validate()


def test_specd_up_gives_the_drafter_the_verifier_and_the_links_tls() -> None:
    import argparse

    from specd.up_tls import drafter_delivery

    args = argparse.Namespace(
        exchange="direct",
        verifier_port=7,
        tls_ca="ca.pem",
        tls_server_name="",
        host="h",
        tls_client_cert="c",
        tls_client_key="k",
    )
    assert drafter_delivery(args) == [
        "--deliver-to", "127.0.0.1:7",
        "--deliver-tls-ca", "ca.pem", "--deliver-tls-server-name", "h",
        "--deliver-tls-cert", "c", "--deliver-tls-key", "k",
    ]  # fmt: skip
    assert drafter_delivery(argparse.Namespace(exchange="gateway")) == []


def test_the_drafters_delivery_tls_options_need_a_verifier_to_deliver_to() -> None:
    from drafter_service.config import DrafterConfig

    with pytest.raises(ValueError, match="apply to --deliver-to"):
        DrafterConfig(deliver_tls_ca="ca.pem").validate()
    with pytest.raises(ValueError, match="go together"):
        DrafterConfig(deliver_to="v:1", deliver_tls_ca="ca.pem", deliver_tls_cert="c").validate()
