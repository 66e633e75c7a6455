"""Sequence leases: owners' namespaces, renewal, expiry, and closes that skip what is not open.

The servicer tests drive a real DrafterServicer over the model-free n-gram engine in process.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from drafter_service.ngram_engine import NgramDrafter
from drafter_service.servicer import DrafterServicer
from specd.proto.speculative.v1 import common_pb2, drafter_pb2
from specd.rpc.leases import Leases, engine_id, public_message
from specd.rpc.service_metrics import ServiceMetrics
from specd.rpc.serving import EngineRunner, expire_leases
from specd.rpc.tracing import Tracing


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_lease_not_renewed_in_time_gives_up_its_sequences() -> None:
    clock = Clock()
    leases = Leases(10.0, clock)
    leases.renew("gw1")
    leases.opened("gw1", [engine_id("gw1", "a"), engine_id("gw1", "b")])
    leases.opened("gw2", [engine_id("gw2", "a")])
    clock.now += 8
    leases.renew("gw2")
    assert leases.expired() == []
    clock.now += 3  # gw1 silent for 11 s, gw2 for 3 s
    assert leases.expired() == ["gw1/a", "gw1/b"]
    assert leases.count("gw1") == 0 and leases.count("gw2") == 1
    assert leases.expired() == []  # once
    leases.closed(["gw2/a"])
    assert leases.count("gw2") == 0
    forever = Leases(0.0, clock)
    forever.opened("gw", ["gw/a"])
    clock.now += 1e6
    assert forever.expired() == []


def test_an_owner_whose_presence_streams_all_ended_is_freed_after_detach_s_unless_it_returns() -> None:
    clock = Clock()
    leases = Leases(30.0, clock, detach_s=1.0)
    for owner in ("gone", "back", "heard", "two"):
        leases.attach(owner)
        leases.opened(owner, [engine_id(owner, "a")])
    leases.attach("two")
    for owner in ("gone", "back", "heard", "two"):
        leases.detach(owner)  # "two" still has a stream open
    clock.now += 0.5
    leases.attach("back")  # re-attached within the window
    leases.renew("heard")  # a round or a KeepAlive: not gone, whatever its stream did
    assert leases.expired() == []
    clock.now += 0.6
    assert leases.expired() == ["gone/a"]
    assert [leases.count(o) for o in ("back", "heard", "two")] == [1, 1, 1]
    clock.now += 20  # the lease, 30 s, still holds the rest
    assert leases.expired() == []
    forever = Leases(0.0, clock, detach_s=1.0)  # no lease: a detach still frees
    forever.attach("gw")
    forever.opened("gw", ["gw/a"])
    forever.detach("gw")
    clock.now += 1
    assert forever.expired() == ["gw/a"]


def test_public_messages_drop_the_owner_prefix() -> None:
    assert public_message("sequence 'gw1/abc' is not open", "gw1") == "sequence 'abc' is not open"
    assert public_message("sequences not open: '/x', '/y'", "") == "sequences not open: 'x', 'y'"


class Aborted(Exception):
    pass


class Context:
    """The part of grpc.aio.ServicerContext the servicer uses."""

    def __init__(self) -> None:
        self.code: grpc.StatusCode | None = None

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.code = code
        raise Aborted(details)


def servicer(lease_s: float) -> DrafterServicer:
    engine = NgramDrafter(1000, 8, 256, 8, 1, 3)
    info = common_pb2.ModelInfo(model_id="ngram", lease_seconds=lease_s)
    return DrafterServicer(
        engine, info, EngineRunner("test-drafter"), Tracing("test"), ServiceMetrics("drafter", engine), Leases(lease_s)
    )


def spec(sid: str) -> common_pb2.SequenceSpec:
    return common_pb2.SequenceSpec(
        sequence_id=sid, prompt_token_ids=[5, 6, 7, 5, 6], sampling=common_pb2.SamplingParams(top_p=1.0)
    )


async def draft(s: DrafterServicer, owner: str, sid: str, committed: int) -> Any:
    async def requests():
        request = drafter_pb2.DraftRequest(round_id=1, lease_owner=owner)
        request.tasks.add(sequence_id=sid, num_committed=committed, num_draft_tokens=2)
        yield request

    (reply,) = [reply async for reply in s.Draft(requests(), Context())]
    return reply


def test_owners_have_their_own_ids_and_reach_only_their_own_sequences() -> None:
    async def go() -> None:
        s = servicer(30.0)
        for owner in ("gw1", "gw2"):
            reply = await s.OpenDraftSequences(
                drafter_pb2.OpenDraftSequencesRequest(sequences=[spec("a")], lease_owner=owner), Context()
            )
            assert not reply.results[0].error.code  # the same id twice: no collision
        assert len(s.engine.table) == 2
        reply = await draft(s, "gw2", "a", 5)
        assert reply.proposals[0].sequence_id == "a" and list(reply.proposals[0].token_ids) == [7, 5]
        # A restarted gateway (another owner) cannot reach its predecessor's sequences.
        reply = await draft(s, "gw3", "a", 5)
        assert reply.proposals[0].error.code == common_pb2.ERROR_CODE_NOT_FOUND
        assert reply.proposals[0].error.message == "sequence 'a' is not open"
        context = Context()
        with pytest.raises(Aborted, match="'a'"):
            await s.CloseDraftSequences(
                drafter_pb2.CloseDraftSequencesRequest(sequence_ids=["a"], lease_owner="gw3"), context
            )
        assert context.code == grpc.StatusCode.NOT_FOUND and len(s.engine.table) == 2
        # missing_ok: what is not open is skipped, what is open is closed.
        reply = await s.CloseDraftSequences(
            drafter_pb2.CloseDraftSequencesRequest(sequence_ids=["a", "zz"], lease_owner="gw1", missing_ok=True),
            Context(),
        )
        assert reply.closed == 1 and set(s.engine.table.seqs) == {"gw2/a"}
        alive = await s.KeepAlive(common_pb2.KeepAliveRequest(lease_owner="gw2"), Context())
        assert alive.open_sequences == 1 and alive.lease_seconds == 30.0
        bad = await s.OpenDraftSequences(
            drafter_pb2.OpenDraftSequencesRequest(sequences=[spec("b")], lease_owner="x/y"), Context()
        )
        assert bad.results[0].error.code == common_pb2.ERROR_CODE_INVALID_ARGUMENT
        s.runner.shutdown()

    asyncio.run(go())


def test_a_silent_owner_s_sequences_are_freed_and_counted_while_a_renewing_one_keeps_its_own() -> None:
    async def go() -> None:
        s = servicer(0.4)
        for owner in ("dead", "alive"):
            await s.OpenDraftSequences(
                drafter_pb2.OpenDraftSequencesRequest(sequences=[spec("a"), spec("b")], lease_owner=owner), Context()
            )
        task = asyncio.create_task(expire_leases("drafter", s.leases, s.engine, s.runner, s.metrics))
        for _ in range(10):  # 1 s: the silent owner's lease lapses, the other keeps renewing
            await asyncio.sleep(0.1)
            await s.KeepAlive(common_pb2.KeepAliveRequest(lease_owner="alive"), Context())
        task.cancel()
        assert set(s.engine.table.seqs) == {"alive/a", "alive/b"}
        assert s.metrics.expired._value.get() == 2
        # The expired owner coming back finds nothing; opening anew works.
        reply = await draft(s, "dead", "a", 5)
        assert reply.proposals[0].error.code == common_pb2.ERROR_CODE_NOT_FOUND
        s.runner.shutdown()

    asyncio.run(go())


def test_an_open_whose_rpc_is_cancelled_still_expires_with_its_lease() -> None:
    async def go() -> None:
        s = servicer(0.3)
        # A gateway that dies mid-open cancels the RPC; the engine thread finishes the open anyway.
        call = asyncio.create_task(
            s.OpenDraftSequences(
                drafter_pb2.OpenDraftSequencesRequest(sequences=[spec("a")], lease_owner="dying"), Context()
            )
        )
        await asyncio.sleep(0)  # it reached the engine thread
        call.cancel()
        await asyncio.sleep(0.05)
        assert set(s.engine.table.seqs) == {"dying/a"}
        assert s.leases.count("dying") == 1
        task = asyncio.create_task(expire_leases("drafter", s.leases, s.engine, s.runner, s.metrics))
        await asyncio.sleep(0.6)
        task.cancel()
        assert not s.engine.table.seqs
        s.runner.shutdown()

    asyncio.run(go())


def test_a_presence_stream_holds_until_cancelled_and_then_detaches_its_owner() -> None:
    async def go() -> None:
        s = servicer(30.0)
        stream = s.Attach(common_pb2.AttachRequest(lease_owner="gw1"), Context())
        first = await anext(stream)
        assert first.detach_seconds == s.leases.detach_s
        pending = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0.05)
        assert not pending.done()  # it holds
        await s.OpenDraftSequences(
            drafter_pb2.OpenDraftSequencesRequest(sequences=[spec("a")], lease_owner="gw1"), Context()
        )
        pending.cancel()  # the caller's connection closed
        with pytest.raises(asyncio.CancelledError):
            await pending
        s.leases.detach_s = 0.0
        assert s.leases.expired() == ["gw1/a"]
        context = Context()
        with pytest.raises(Aborted):
            await anext(s.Attach(common_pb2.AttachRequest(lease_owner="x/y"), context))
        assert context.code == grpc.StatusCode.INVALID_ARGUMENT
        s.runner.shutdown()

    asyncio.run(go())
