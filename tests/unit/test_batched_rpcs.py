"""Batched open/close are all or nothing: nothing changes before every id is checked.

On the engines (each kind), and through a real servicer on an in-process gRPC
server, where the answer a caller sees is a status code.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from tinymodels import backed_kv_bytes

from drafter_service.ngram_engine import NgramDrafter
from drafter_service.servicer import DrafterServicer
from specd.engine.errors import EngineError, ErrorKind
from specd.engine.params import SamplingParams
from specd.engine.tasks import SequenceSpec
from specd.proto.speculative.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc
from specd.rpc.leases import Leases, engine_id
from specd.rpc.service_metrics import ServiceMetrics
from specd.rpc.serving import EngineRunner
from specd.rpc.tracing import Tracing

GREEDY = SamplingParams(temperature=0.0)
PROMPT = [11, 22, 33, 44, 55]
ENGINE_KINDS = ["verifier", "drafter", "ngram"]


@pytest.fixture
def engines(make_verifier, make_drafter, make_ngram):
    limits = {"max_sequences": 4, "max_context": 64, "max_draft_tokens": 4}
    return {"verifier": make_verifier(**limits), "drafter": make_drafter(**limits), "ngram": make_ngram(**limits)}


def all_slots(engine) -> int:
    """The sequences' slots, and a drafter's for fan-out branches beside them."""
    return engine.table.max_sequences + engine.table.branch_slots


@pytest.mark.parametrize("kind", ENGINE_KINDS)
def test_close_with_an_unknown_id_closes_nothing(engines, kind):
    engine = engines[kind]
    errors, _ = engine.open([SequenceSpec("a", PROMPT, GREEDY), SequenceSpec("b", PROMPT, GREEDY)])
    assert errors == [None, None]
    free_before = sorted(engine.table._free)
    with pytest.raises(EngineError) as info:
        engine.close(["a", "ghost", "b"])
    assert info.value.kind == ErrorKind.NOT_FOUND and "ghost" in info.value.message
    assert set(engine.table.seqs) == {"a", "b"}, "a refused close must leave every sequence open"
    assert sorted(engine.table._free) == free_before
    # The same ids, with the unknown one skipped on request, close what is open.
    assert engine.close(["a", "ghost", "b"], ignore_unknown=True) == 2
    assert len(engine.table) == 0 and len(engine.table._free) == all_slots(engine)


@pytest.mark.parametrize("kind", ENGINE_KINDS)
def test_close_counts_a_repeated_id_once(engines, kind):
    engine = engines[kind]
    engine.open([SequenceSpec("a", PROMPT, GREEDY)])
    assert engine.close(["a", "a"]) == 1
    assert sorted(engine.table._free) == list(range(all_slots(engine)))


@pytest.mark.parametrize("kind", ["verifier", "drafter"])
def test_a_failed_prefill_opens_nothing_and_keeps_every_slot(engines, kind, monkeypatch):
    engine = engines[kind]

    def broken_forward(rows):
        raise RuntimeError("out of memory (injected)")

    monkeypatch.setattr(engine.table.lm, "forward", broken_forward)
    with pytest.raises(RuntimeError, match="injected"):
        engine.open([SequenceSpec("a", PROMPT, GREEDY), SequenceSpec("b", PROMPT, GREEDY)])
    assert len(engine.table) == 0
    assert sorted(engine.table._free) == list(range(all_slots(engine))), (
        "slots taken before the prefill failed must come back"
    )
    monkeypatch.undo()
    errors, _ = engine.open([SequenceSpec(f"s{i}", PROMPT, GREEDY) for i in range(4)])
    assert errors == [None] * 4


@pytest.mark.parametrize("kind", ENGINE_KINDS)
def test_open_checks_each_sequence_before_taking_its_slot(engines, kind):
    engine = engines[kind]
    specs = [
        SequenceSpec("ok", PROMPT, GREEDY),
        SequenceSpec("ok", PROMPT, GREEDY),  # a duplicate in the same request
        SequenceSpec("empty", [], GREEDY),
        SequenceSpec("outside", [10**9], GREEDY),
    ]
    errors, _ = engine.open(specs)
    assert errors[0] is None and all(e is not None and e.kind == ErrorKind.INVALID_ARGUMENT for e in errors[1:])
    assert set(engine.table.seqs) == {"ok"}
    assert len(engine.table._free) == all_slots(engine) - 1, "a refused spec must not hold a slot"


def test_servicer_close_is_not_found_and_changes_nothing(vocab_size):
    asyncio.run(_servicer_close(vocab_size))


async def _servicer_close(vocab_size: int) -> None:
    engine = NgramDrafter(vocab_size, 4, 64, 4, 1, 4)
    runner = EngineRunner("test-drafter")
    servicer = DrafterServicer(
        engine, common_pb2.ModelInfo(), runner, Tracing("test"), ServiceMetrics("drafter", engine), Leases(0)
    )
    server = grpc.aio.server()
    drafter_pb2_grpc.add_DrafterServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = drafter_pb2_grpc.DrafterServiceStub(channel)
            specs = [
                common_pb2.SequenceSpec(
                    sequence_id=s, prompt_token_ids=PROMPT, sampling=common_pb2.SamplingParams(top_p=1.0)
                )
                for s in ("open-1", "open-2")
            ]
            reply = await stub.OpenDraftSequences(drafter_pb2.OpenDraftSequencesRequest(sequences=specs))
            assert [r.HasField("error") for r in reply.results] == [False, False]
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.CloseDraftSequences(drafter_pb2.CloseDraftSequencesRequest(sequence_ids=["open-1", "nope"]))
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
            assert set(engine.table.seqs) == {engine_id("", "open-1"), engine_id("", "open-2")}
            reply = await stub.CloseDraftSequences(
                drafter_pb2.CloseDraftSequencesRequest(sequence_ids=["open-1", "nope"], missing_ok=True)
            )
            assert reply.closed == 1 and set(engine.table.seqs) == {engine_id("", "open-2")}
    finally:
        await server.stop(None)
        runner.shutdown()


def test_servicer_open_that_cannot_fit_is_refused_before_any_state_changes(make_verifier):
    engine = make_verifier(max_sequences=2, max_context=64, max_draft_tokens=4)
    engine.lm.warm_up(2)  # as the service does: the cache is made at its bound before any request
    assert engine.table.kv_reserved_bytes() == 2 * 64 * engine.table.kv_bytes_per_token() > 0
    asyncio.run(_servicer_open_too_big(engine))


async def _servicer_open_too_big(engine) -> None:
    from specd.proto.speculative.v1 import verifier_pb2, verifier_pb2_grpc
    from verifier_service.servicer import VerifierServicer

    runner = EngineRunner("test-verifier")
    servicer = VerifierServicer(
        engine, common_pb2.ModelInfo(), runner, Tracing("test"), ServiceMetrics("verifier", engine), Leases(0)
    )
    server = grpc.aio.server()
    verifier_pb2_grpc.add_VerifierServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()

    def spec(sid: str, prompt: list[int]) -> common_pb2.SequenceSpec:
        return common_pb2.SequenceSpec(
            sequence_id=sid, prompt_token_ids=prompt, sampling=common_pb2.SamplingParams(top_p=1.0)
        )

    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = verifier_pb2_grpc.VerifierServiceStub(channel)
            reserved = engine.table.kv_reserved_bytes()
            specs = [spec("a", PROMPT), spec("too-long", list(range(1, 65))), spec("b", PROMPT), spec("c", PROMPT)]
            reply = await stub.OpenVerifySequences(verifier_pb2.OpenVerifySequencesRequest(sequences=specs))
            codes = [r.error.code if r.HasField("error") else None for r in reply.results]
            assert codes == [
                None,
                common_pb2.ERROR_CODE_INVALID_ARGUMENT,
                None,
                common_pb2.ERROR_CODE_RESOURCE_EXHAUSTED,
            ]
            assert set(engine.table.seqs) == {engine_id("", "a"), engine_id("", "b")}
            assert engine.table.kv_reserved_bytes() == reserved, "refusing must not grow the cache"
            assert engine.table.kv_bytes() == backed_kv_bytes(engine.table, 2 * (len(PROMPT) - 1))
            # The prefill at the open is counted: only what opened, all but each prompt's last token.
            sample = servicer.metrics.registry.get_sample_value
            assert sample("specd_verifier_open_prefill_tokens_total") == 2 * (len(PROMPT) - 1)
            assert sample("specd_verifier_open_prefill_seconds_total") > 0
            assert sample("specd_verifier_tokens_fed_total") == 0, "an open is no round"
    finally:
        await server.stop(None)
        runner.shutdown()
