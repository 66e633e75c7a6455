"""Replica pools: placement, splitting a round by replica and reassembling it, failures, DNS membership."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from gateway.backends import BackendError
from gateway.config import GatewayConfig
from gateway.endpoints import Endpoint, parse_endpoints, resolve_host
from gateway.pool import DrafterPool, VerifierPool
from gateway.pool_metrics import PoolCollector
from specd.proto.speculative.v1 import common_pb2, drafter_pb2, verifier_pb2

T = TypeVar("T")


def run(coro: Awaitable[T]) -> T:
    async def main() -> T:
        return await coro

    return asyncio.run(main())


def model_info(
    max_sequences: int = 8, max_context: int = 512, sha: str = "abc", vocab: int = 100, model_id: str = "m"
) -> Any:
    return common_pb2.ModelInfo(
        model_id=model_id,
        lease_seconds=30.0,
        tokenizer=common_pb2.TokenizerFingerprint(vocab_size=vocab, vocab_sha256=sha, special_token_ids={"eos": 2}),
        max_context=max_context,
        model_vocab_size=vocab,
        max_sequences=max_sequences,
        max_draft_tokens=8,
    )


class FakeClient:
    """A replica in process: answers with tokens that say which replica and task produced them."""

    def __init__(self, address: str, server_name: str = "", info: Any = None) -> None:
        self.address = address
        self.server_name = server_name
        self.number = int(address.rsplit(":", 1)[1])
        self._info = info or model_info()
        self.info: Any = None
        self.kind = common_pb2.DRAFTER_KIND_MODEL
        self.serving = True
        self.fail_rounds = False
        self.fail_open = False
        self.fail_close = False
        self.open_ids: set[str] = set()
        self.requests: list[Any] = []
        self.calls: list[tuple[str, list[str]]] = []  # ("open" | "close", ids), in order
        self.keep_alives = 0
        self.closed = False

    async def healthy(self, timeout_s: float = 2.0) -> bool:
        return self.serving

    async def load_info(self) -> Any:
        self.info = self._info
        return self.info

    async def open(self, specs: list[Any]) -> list[Any]:
        if self.fail_open:
            raise BackendError(f"replica {self.address} is down")
        self.calls.append(("open", [s.sequence_id for s in specs]))
        self.open_ids.update(s.sequence_id for s in specs)
        return [common_pb2.OpenResult(sequence_id=s.sequence_id) for s in specs]

    async def close_sequences(self, ids: list[str], missing_ok: bool = False) -> None:
        if self.fail_close:
            raise BackendError(f"replica {self.address}: DEADLINE_EXCEEDED")
        self.calls.append(("close", list(ids)))
        self.open_ids.difference_update(ids)

    async def keep_alive(self) -> Any:
        self.keep_alives += 1
        return common_pb2.KeepAliveResponse(open_sequences=len(self.open_ids))

    async def verify(self, request: Any) -> Any:
        self.requests.append(request)
        if self.fail_rounds:
            raise BackendError(f"replica {self.address} round failed")
        await asyncio.sleep(0.001 * self.number % 5)  # replies finish out of order
        reply = verifier_pb2.VerifyResponse(round_id=request.round_id)
        reply.timings.total_ns = 1000 * self.number
        reply.timings.forward_ns = 10 * self.number
        for task in request.tasks:
            assert task.sequence_id in self.open_ids
            reply.results.add(sequence_id=task.sequence_id, next_token_id=self.number, num_accepted=task.num_committed)
        return reply

    async def draft(self, request: Any) -> Any:
        self.requests.append(request)
        if self.fail_rounds:
            raise BackendError(f"replica {self.address} round failed")
        reply = drafter_pb2.DraftResponse(round_id=request.round_id)
        reply.timings.total_ns = 1000 * self.number
        for task in request.tasks:
            reply.proposals.add(sequence_id=task.sequence_id, token_ids=[self.number] * task.num_draft_tokens)
        return reply

    async def close(self) -> None:
        self.closed = True


def make_pool(
    spec: str = "127.0.0.1:1,127.0.0.1:2",
    cls: type = VerifierPool,
    infos: dict[str, Any] | None = None,
    resolver: Callable[[str, int], Awaitable[list[str]]] | None = None,
) -> tuple[Any, dict[str, FakeClient]]:
    clients: dict[str, FakeClient] = {}

    def factory(address: str, server_name: str) -> FakeClient:
        clients[address] = FakeClient(address, server_name, (infos or {}).get(address))
        if cls is VerifierPool:
            del clients[address].kind  # as VerifierClient: only drafters have a kind
        return clients[address]

    kwargs: dict[str, Any] = {"health_interval_s": 3600.0}  # tests run the checks themselves
    if resolver is not None:
        kwargs["resolver"] = resolver
    return cls(spec, factory, **kwargs), clients


async def started(pool: Any) -> Any:
    await pool.wait_ready(5)
    await pool.load_info()
    return pool


def specs(*ids: str) -> list[Any]:
    return [common_pb2.SequenceSpec(sequence_id=i, prompt_token_ids=[1, 2]) for i in ids]


def verify_request(ids: list[str], round_id: int = 7) -> Any:
    request = verifier_pb2.VerifyRequest(round_id=round_id)
    for n, sid in enumerate(ids):
        request.tasks.add(sequence_id=sid, num_committed=n)
    return request


def test_parse_endpoints() -> None:
    assert parse_endpoints("a:1, dns:///svc.ns:50052,[::1]:3,") == [
        Endpoint("a", 1),
        Endpoint("svc.ns", 50052, dns=True),
        Endpoint("::1", 3),
    ]
    for bad in ("a", "a:", "a:x", "dns:///svc", "dns://x/svc:1", ":5", "a:70000"):
        with pytest.raises(ValueError, match="bad backend endpoint"):
            parse_endpoints(bad)


def test_info_sums_sequences_and_takes_the_smallest_limits() -> None:
    async def go() -> None:
        infos = {"127.0.0.1:1": model_info(8, 512), "127.0.0.1:2": model_info(16, 256)}
        pool = await started(make_pool(infos=infos)[0])
        assert pool.info.max_sequences == 24
        assert pool.info.max_context == 256
        assert pool.fingerprint is not None and pool.fingerprint.vocab_sha256 == "abc"
        await pool.close()

    run(go())


def test_replicas_that_disagree_refuse_to_start() -> None:
    async def go() -> None:
        pool = make_pool(infos={"127.0.0.1:2": model_info(sha="other")})[0]
        await pool.wait_ready(5)
        with pytest.raises(BackendError, match=r"127.0.0.1:1 and 127.0.0.1:2 differ: tokenizer"):
            await pool.load_info()
        pool = make_pool(infos={"127.0.0.1:2": model_info(vocab=99)})[0]
        await pool.wait_ready(5)
        with pytest.raises(BackendError, match="differ"):
            await pool.load_info()

    run(go())


def test_new_sequences_go_to_the_least_loaded_replica() -> None:
    async def go() -> None:
        pool, clients = make_pool("127.0.0.1:1,127.0.0.1:2,127.0.0.1:3")
        await started(pool)
        await pool.open(specs(*(f"s{i}" for i in range(9))))
        assert [len(c.open_ids) for c in clients.values()] == [3, 3, 3]
        await pool.close_sequences(sorted(clients["127.0.0.1:2"].open_ids)[:2])
        await pool.open(specs("new1", "new2"))
        assert pool.replica_of("new1") == pool.replica_of("new2") == "127.0.0.1:2"
        # One at a time, equal loads take turns.
        pool2, clients2 = make_pool()
        await started(pool2)
        for i in range(4):
            await pool2.open(specs(f"t{i}"))
        assert [len(c.open_ids) for c in clients2.values()] == [2, 2]
        await pool.close()
        await pool2.close()

    run(go())


def test_a_round_is_split_by_replica_and_reassembled_in_task_order() -> None:
    async def go() -> None:
        pool, clients = make_pool()
        await started(pool)
        ids = [f"s{i}" for i in range(6)]
        await pool.open(specs(*ids))
        order = ["s5", "s0", "s3", "s2", "s4", "s1"]
        reply = await pool.verify(verify_request(order))
        assert reply.round_id == 7
        assert [r.sequence_id for r in reply.results] == order
        for n, result in enumerate(reply.results):
            assert not result.error.code
            assert result.num_accepted == n  # each task's own fields travelled with it
            assert f"127.0.0.1:{result.next_token_id}" == pool.replica_of(result.sequence_id)
        # Each replica saw only its own sequences, in one exchange; the round waits for the slowest.
        for client in clients.values():
            (request,) = client.requests
            assert {t.sequence_id for t in request.tasks} == client.open_ids
        assert reply.timings.total_ns == 2000 and reply.timings.forward_ns == 20
        await pool.close()

    run(go())


def test_one_replica_only_passes_the_round_through() -> None:
    async def go() -> None:
        pool, clients = make_pool("127.0.0.1:1")
        await started(pool)
        await pool.open(specs("a", "b"))
        request = verify_request(["b", "a"])
        await pool.verify(request)
        assert clients["127.0.0.1:1"].requests == [request]
        await pool.close()

    run(go())


def test_a_failed_replica_costs_only_its_sequences_and_takes_no_new_ones() -> None:
    async def go() -> None:
        pool, clients = make_pool()
        await started(pool)
        ids = [f"s{i}" for i in range(4)]
        await pool.open(specs(*ids))
        bad = clients["127.0.0.1:2"]
        bad.fail_rounds = True
        reply = await pool.verify(verify_request(ids))
        for result in reply.results:
            if pool.replica_of(result.sequence_id) == bad.address:
                assert result.error.code == common_pb2.ERROR_CODE_UNAVAILABLE
                assert "verifier replica 127.0.0.1:2 failed" in result.error.message
            else:
                assert not result.error.code and result.next_token_id == 1
        assert [r["healthy"] for r in pool.status()] == [True, False]
        await pool.open(specs("n1", "n2"))
        assert pool.replica_of("n1") == pool.replica_of("n2") == "127.0.0.1:1"
        # Its health check passes again: it takes new sequences (it is the least loaded).
        bad.fail_rounds = False
        await pool._check(pool.replicas[bad.address])
        await pool.close_sequences([s for s in ids if pool.replica_of(s) == bad.address])
        await pool.open(specs("n3"))
        assert pool.replica_of("n3") == bad.address
        await pool.close()

    run(go())


def test_health_checks_stop_and_resume_placement() -> None:
    async def go() -> None:
        pool, clients = make_pool()
        await started(pool)
        clients["127.0.0.1:1"].serving = False
        await asyncio.gather(*(pool._check(r) for r in pool.replicas.values()))
        await pool.open(specs("a", "b", "c"))
        assert {pool.replica_of(s) for s in "abc"} == {"127.0.0.1:2"}
        assert await pool.healthy()
        clients["127.0.0.1:2"].serving = False
        await asyncio.gather(*(pool._check(r) for r in pool.replicas.values()))
        assert not await pool.healthy()
        clients["127.0.0.1:1"].serving = True
        await asyncio.gather(*(pool._check(r) for r in pool.replicas.values()))
        await pool.open(specs("d"))
        assert pool.replica_of("d") == "127.0.0.1:1"
        await pool.close()

    run(go())


def test_a_replica_that_went_down_is_asked_often_and_taken_back_as_soon_as_it_answers() -> None:
    """Between health checks the pool waits its interval, but for a replica that served and went
    down (a verifier the supervisor is restarting) it asks every READY_POLL_S: taken back at once."""

    async def go() -> None:
        clients: dict[str, FakeClient] = {}
        asked: list[str] = []

        class Counted(FakeClient):
            async def healthy(self, timeout_s: float = 2.0) -> bool:
                asked.append(self.address)
                return self.serving

        def factory(address: str, server_name: str) -> FakeClient:
            clients[address] = Counted(address, server_name)
            del clients[address].kind
            return clients[address]

        pool = VerifierPool("127.0.0.1:1", factory, health_interval_s=2.0)
        await started(pool)
        clients["127.0.0.1:1"].serving = False
        await asyncio.sleep(2.2)  # the watcher's check at its interval finds it down
        assert not pool.replicas["127.0.0.1:1"].up
        before = len(asked)
        await asyncio.sleep(1.0)
        assert len(asked) - before >= 5, f"asked {len(asked) - before} times in 1 s while it was down"
        clients["127.0.0.1:1"].serving = True
        await asyncio.sleep(0.4)
        assert pool.replicas["127.0.0.1:1"].up
        await pool.close()

    run(go())


def test_every_replica_failing_fails_the_round() -> None:
    async def go() -> None:
        pool, clients = make_pool()
        await started(pool)
        await pool.open(specs("a", "b"))
        for client in clients.values():
            client.fail_rounds = True
        with pytest.raises(BackendError, match="every verifier replica of the round failed"):
            await pool.verify(verify_request(["a", "b"]))
        await pool.close()

    run(go())


def test_an_open_that_fails_moves_to_another_replica() -> None:
    async def go() -> None:
        pool, clients = make_pool()
        await started(pool)
        clients["127.0.0.1:1"].fail_open = True
        results = await pool.open(specs("a", "b", "c", "d"))
        assert [r.sequence_id for r in results] == ["a", "b", "c", "d"]
        assert not any(r.error.code for r in results)
        assert {pool.replica_of(s) for s in "abcd"} == {"127.0.0.1:2"}
        clients["127.0.0.1:2"].fail_open = True
        with pytest.raises(BackendError, match="no verifier replica could open"):
            await pool.open(specs("e"))
        await pool.close()

    run(go())


def test_an_open_lost_in_transit_is_closed_where_it_may_have_landed() -> None:
    async def go() -> None:
        pool, clients = make_pool()
        await started(pool)
        stalled = clients["127.0.0.1:1"]
        real_open = stalled.open

        async def opens_then_times_out(batch: list[Any]) -> list[Any]:
            await real_open(batch)  # it did open them, but the answer never arrived
            raise BackendError("DEADLINE_EXCEEDED")

        stalled.open = opens_then_times_out  # type: ignore[method-assign]
        await pool.open(specs("a", "b"))
        in_vain = set(stalled.open_ids)
        assert in_vain  # it holds what it opened in vain
        # Owed at once, not at the sequences' end: they live on the other replica meanwhile.
        assert pool.owed.owed(pool.replicas[stalled.address]) == in_vain
        await pool._check(pool.replicas[stalled.address])  # healthy again
        await pool._deliver_owed()
        assert not stalled.open_ids and clients["127.0.0.1:2"].open_ids == {"a", "b"}
        assert pool.owed.total == 0
        await pool.close()

    run(go())


def test_an_open_lost_in_transit_on_the_only_replica_is_closed_though_the_request_failed() -> None:
    async def go() -> None:
        pool, clients = make_pool("127.0.0.1:1")
        await started(pool)
        only = clients["127.0.0.1:1"]
        real_open = only.open

        async def opens_then_times_out(batch: list[Any]) -> list[Any]:
            await real_open(batch)
            raise BackendError("DEADLINE_EXCEEDED")

        only.open = opens_then_times_out  # type: ignore[method-assign]
        with pytest.raises(BackendError, match="no verifier replica could open"):
            await pool.open(specs("a"))
        # The scheduler failed the request and never closes it: the pool does.
        await pool._check(pool.replicas[only.address])
        await pool._deliver_owed()
        assert not only.open_ids
        await pool.close()

    run(go())


def test_a_close_that_fails_is_retried_until_it_lands() -> None:
    async def go() -> None:
        pool, clients = make_pool("127.0.0.1:1")
        await started(pool)
        client = clients["127.0.0.1:1"]
        await pool.open(specs("a", "b"))
        client.fail_close = True
        with pytest.raises(BackendError, match="retrying in the background"):
            await pool.close_sequences(["a", "b"])
        assert pool.replica_of("a") is None  # the scheduler is done with them ...
        replica = pool.replicas[client.address]
        assert pool.owed.owed(replica) == {"a", "b"}  # ... the pool is not
        await pool._deliver_owed()  # still failing: still owed
        assert client.open_ids == {"a", "b"} and pool.owed.total == 2
        registry = CollectorRegistry()
        registry.register(PoolCollector([pool]))
        assert (
            'specd_backend_owed_closes{address="127.0.0.1:1",service="verifier"} 2.0'
            in generate_latest(registry).decode()
        )
        client.fail_close = False
        await pool._deliver_owed()
        assert not client.open_ids and pool.owed.total == 0
        await pool.close()

    run(go())


def test_an_owed_close_lands_before_the_same_id_is_opened_there_again() -> None:
    async def go() -> None:
        pool, clients = make_pool("127.0.0.1:1", cls=DrafterPool)
        await started(pool)
        client = clients["127.0.0.1:1"]
        await pool.open(specs("a"))
        client.fail_close = True
        with pytest.raises(BackendError):
            await pool.close_sequences(["a"])
        client.fail_close = False
        client.calls.clear()
        await pool.open(specs("a"))  # a drafter re-opening a sequence it lost
        assert client.calls == [("close", ["a"]), ("open", ["a"])]
        assert client.open_ids == {"a"} and pool.owed.total == 0
        # While the owed close cannot land, the open does not go there either.
        client.fail_close = True
        with pytest.raises(BackendError):
            await pool.close_sequences(["a"])
        with pytest.raises(BackendError, match="no drafter replica could open"):
            await pool.open(specs("a"))
        assert client.calls == [("close", ["a"]), ("open", ["a"])]  # no second open
        await pool.close()

    run(go())


def test_leases_are_renewed_on_every_replica_that_is_up() -> None:
    async def go() -> None:
        pool, clients = make_pool()
        await started(pool)
        assert pool.lease_renew_s == pytest.approx(10.0)  # a third of the 30 s lease
        clients["127.0.0.1:2"].serving = False
        await pool._check(pool.replicas["127.0.0.1:2"])
        await pool._renew_leases()
        assert [c.keep_alives for c in clients.values()] == [1, 0]
        await pool.close()

    run(go())


def test_a_single_replica_that_comes_back_with_another_tokenizer_is_refused(caplog) -> None:
    async def go() -> None:
        pool, clients = make_pool("127.0.0.1:1")
        await started(pool)
        client = clients["127.0.0.1:1"]
        replica = pool.replicas[client.address]
        client.serving = False  # it goes away ...
        await pool._check(replica)
        client.serving, client._info = True, model_info(sha="other", vocab=101)  # ... and returns changed
        await pool._check(replica)
        assert not replica.up and replica.refused and not await pool.healthy()
        assert "refusing verifier at 127.0.0.1:1: its tokenizer differs from the gateway's (vocab size 101 != 100" in (
            caplog.text
        )
        with pytest.raises(BackendError, match="no verifier replica could open"):
            await pool.open(specs("a"))
        await pool._check(replica)  # it stays out, and says so once
        assert caplog.text.count("refusing verifier") == 1
        client._info = model_info()  # put right: it is taken back
        await pool._check(replica)
        assert replica.up and not replica.refused and await pool.healthy()
        await pool.close()

    run(go())


def test_a_replica_that_comes_back_with_another_model_or_kind_is_refused(caplog) -> None:
    async def go() -> None:
        pool, clients = make_pool("127.0.0.1:1", cls=DrafterPool)
        await started(pool)
        client = clients["127.0.0.1:1"]
        replica = pool.replicas[client.address]
        for change, message in (
            (lambda: setattr(client, "_info", model_info(model_id="other")), "serving model 'other', not 'm'"),
            (lambda: setattr(client, "kind", common_pb2.DRAFTER_KIND_NGRAM), "drafter kind"),
        ):
            client.serving = False
            await pool._check(replica)
            change()
            client.serving = True
            await pool._check(replica)
            assert replica.refused and not replica.up, message
            assert message in caplog.text
            client._info, client.kind = model_info(), common_pb2.DRAFTER_KIND_MODEL
            await pool._check(replica)
            assert replica.up
        await pool.close()

    run(go())


def test_close_goes_to_each_sequence_s_replica() -> None:
    async def go() -> None:
        pool, clients = make_pool()
        await started(pool)
        await pool.open(specs("a", "b", "c", "d"))
        await pool.close_sequences(["a", "b", "c", "d", "unknown"])
        assert all(not c.open_ids for c in clients.values())
        assert pool.replica_of("a") is None
        await pool.close()

    run(go())


def test_drafter_pool_splits_drafts() -> None:
    async def go() -> None:
        pool, clients = make_pool(cls=DrafterPool)
        await started(pool)
        assert pool.kind == common_pb2.DRAFTER_KIND_MODEL
        await pool.open(specs("a", "b", "c"))
        clients["127.0.0.1:1"].fail_rounds = True
        request = drafter_pb2.DraftRequest(round_id=3)
        for sid in ("c", "b", "a"):
            request.tasks.add(sequence_id=sid, num_draft_tokens=2)
        reply = await pool.draft(request)
        assert [p.sequence_id for p in reply.proposals] == ["c", "b", "a"]
        for p in reply.proposals:
            if pool.replica_of(p.sequence_id) == "127.0.0.1:1":
                assert p.error.code == common_pb2.ERROR_CODE_UNAVAILABLE and not p.token_ids
            else:
                assert list(p.token_ids) == [2, 2]
        await pool.close()

    run(go())


def test_dns_names_are_resolved_again_and_vanished_pods_drain() -> None:
    answers = {"svc": ["10.0.0.1:50052", "10.0.0.2:50052"]}

    async def resolver(host: str, port: int) -> list[str]:
        if host not in answers:
            raise OSError("no such host")
        return answers[host]

    async def go() -> None:
        pool, clients = make_pool("dns:///svc:50052", resolver=resolver)
        await started(pool)
        assert sorted(pool.replicas) == ["10.0.0.1:50052", "10.0.0.2:50052"]
        assert clients["10.0.0.1:50052"].server_name == "svc"  # TLS checks the Service name
        await pool.open(specs("a", "b"))
        on_gone = next(s for s in "ab" if pool.replica_of(s) == "10.0.0.2:50052")
        # Scaled: one pod left, a new one came.
        answers["svc"] = ["10.0.0.1:50052", "10.0.0.3:50052"]
        await pool.resolve()
        await pool._check(pool.replicas["10.0.0.3:50052"])
        assert pool.replicas["10.0.0.2:50052"].removed  # kept while it still holds a sequence
        await pool.open(specs("c", "d", "e"))
        assert {pool.replica_of(s) for s in "cde"} <= {"10.0.0.1:50052", "10.0.0.3:50052"}
        assert pool.replica_of("c") != "10.0.0.2:50052"
        await pool.close_sequences([on_gone])
        assert "10.0.0.2:50052" not in pool.replicas and clients["10.0.0.2:50052"].closed
        # A failed lookup keeps what the name had.
        answers.clear()
        await pool.resolve()
        assert sorted(pool.replicas) == ["10.0.0.1:50052", "10.0.0.3:50052"]
        await pool.close()

    run(go())


def test_a_joining_replica_with_another_tokenizer_is_refused() -> None:
    answers = ["10.0.0.1:1"]

    async def resolver(host: str, port: int) -> list[str]:
        return list(answers)

    async def go() -> None:
        infos = {"10.0.0.2:1": model_info(sha="other"), "10.0.0.3:1": model_info(max_context=64)}
        pool, _ = make_pool("dns:///svc:1", infos=infos, resolver=resolver)
        await started(pool)
        answers.extend(["10.0.0.2:1", "10.0.0.3:1"])
        await pool.resolve()
        await asyncio.gather(*(pool._check(r) for r in pool.replicas.values()))
        status = {s["address"]: s for s in pool.status()}
        assert status["10.0.0.2:1"].get("refused") and status["10.0.0.3:1"].get("refused")
        await pool.open(specs("a", "b"))
        assert {pool.replica_of(s) for s in "ab"} == {"10.0.0.1:1"}
        await pool.close()

    run(go())


def test_per_replica_metrics() -> None:
    async def go() -> None:
        pool, _ = make_pool()
        await started(pool)
        await pool.open(specs("a", "b", "c"))
        registry = CollectorRegistry()
        registry.register(PoolCollector([pool, None]))
        text = generate_latest(registry).decode()
        assert 'specd_backend_up{address="127.0.0.1:1",service="verifier"} 1.0' in text
        assert 'specd_backend_open_sequences{address="127.0.0.1:1",service="verifier"} 2.0' in text
        assert 'specd_backend_open_sequences{address="127.0.0.1:2",service="verifier"} 1.0' in text
        assert 'specd_backend_sequences_placed_total{address="127.0.0.1:2",service="verifier"} 1.0' in text
        await pool.close()

    run(go())


def test_resolve_host_lists_every_address_with_the_port() -> None:
    addresses = run(resolve_host("localhost", 50052))
    assert "127.0.0.1:50052" in addresses
    assert all(a.endswith(":50052") for a in addresses)


def test_gateway_flags_take_lists_and_reject_malformed_entries(capsys) -> None:
    config = GatewayConfig.from_args(["--verifier", "a:1,dns:///svc:2", "--drafter", ""])
    assert [e.dns for e in parse_endpoints(config.verifier)] == [False, True]
    with pytest.raises(SystemExit):
        GatewayConfig.from_args(["--verifier", "a:1,dns:///svc"])
    assert "bad backend endpoint 'dns:///svc'" in capsys.readouterr().err
