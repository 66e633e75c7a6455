"""The one-hop exchange with real processes on loopback: a gateway with --exchange direct beside one
with the gateway exchange, over the same verifier and a drafter that delivers to it.

Greedy output is the target's alone through either exchange; the drafts do travel the one hop
(the verifier verifies drafts it got from the drafter); a round's time outside the forwards is
measured; a drafter killed mid-stream costs speed, never a token; a delivery for a round the
verifier no longer awaits is refused with its reason.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
import stack as st
from prometheus_client.parser import text_string_to_metric_families
from references import PROMPTS as ALL_PROMPTS
from references import api_text, greedy_references

from specd.proto.speculative.v1 import verifier_pb2, verifier_pb2_grpc
from specd.tools.benchstats import round_costs

PROMPTS = list(ALL_PROMPTS[:4])
TOKENS = 24
GATEWAY = ["--num-speculative-tokens", "3", "--tokenizer"]


@pytest.fixture(scope="module")
def references(tok, tiny_target) -> dict[str, list[int]]:
    return greedy_references(tok, tiny_target, PROMPTS, TOKENS)


def texts(tok, references) -> list[str]:
    return [api_text(tok, references[p][:TOKENS]) for p in PROMPTS]


def metrics(gateway: st.Service) -> dict[str, float]:
    body = httpx.get(f"{st.base_url(gateway)}/metrics", timeout=5).text
    flat = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            labels = "".join(f"|{k}={v}" for k, v in sorted(sample.labels.items()))
            flat[sample.name + labels] = sample.value
    return flat


def model_args(path: Path) -> list[str]:
    return ["--model", str(path), "--dtype", "float32"]


@pytest.fixture(scope="module")
def one_hop(model_dirs, log_dir) -> Iterator[tuple[st.Service, st.Service, st.Service]]:
    """A verifier, a drafter delivering to it, and two gateways over them: direct and gateway. The
    drafter is the target itself, so that its drafts are accepted: the tiny draft model's rarely are."""
    verifier = st.spawn_backend("verifier", model_args(model_dirs["target"]), log_dir)
    services = [verifier]
    try:
        drafter = st.spawn_backend(
            "drafter",
            [*model_args(model_dirs["target"]), "--quantize", "none", "--deliver-to", verifier.address],
            log_dir,
        )
        services.append(drafter)
        common = [*GATEWAY, str(model_dirs["target"])]
        direct = st.spawn_gateway(verifier, drafter, [*common, "--exchange", "direct"], log_dir)
        services.append(direct)
        gateway = st.spawn_gateway(verifier, drafter, common, log_dir)
        services.append(gateway)
        for service in (verifier, drafter):
            st.ready_backend(service)
        st.ready_gateway(direct)
        st.ready_gateway(gateway)
    except BaseException:
        st.stop_all(services)
        raise
    yield verifier, direct, gateway
    st.stop_all(list(reversed(services)))


def test_greedy_output_is_the_targets_through_either_exchange(one_hop, tok, references):
    _, direct, gateway = one_hop
    before = metrics(direct)
    through_direct = st.complete_texts(st.base_url(direct), PROMPTS, TOKENS)
    after = metrics(direct)
    assert through_direct == texts(tok, references)
    assert st.complete_texts(st.base_url(gateway), PROMPTS, TOKENS) == through_direct
    # The rounds went the one hop, and the drafts the verifier got from the drafter were verified
    # (the gateway's requests carry none: it reads what was verified from the verifier's answer).
    assert after["specd_one_hop_rounds_total"] > before.get("specd_one_hop_rounds_total", 0)
    assert after["specd_one_hop_missed_rounds_total"] == 0
    accepted = "specd_spec_decode_num_accepted_tokens_total"
    assert after[accepted] - before[accepted] >= TOKENS  # a draft of the target's own is always right
    costs = round_costs(before, after)
    assert costs["round_drafter_forward_ms"] > 0 and costs["round_verifier_forward_ms"] > 0
    assert 0 < costs["round_outside_forwards_ms"] < costs["round_round_ms"]


def test_a_late_delivery_is_refused_with_its_reason(one_hop):
    verifier, _, _ = one_hop

    async def run() -> tuple[verifier_pb2.VerifyResponse, verifier_pb2.DeliveryAck]:
        async with grpc.aio.insecure_channel(verifier.address) as channel:
            stub = verifier_pb2_grpc.VerifierServiceStub(channel)
            verify = stub.Verify()
            task = verifier_pb2.VerifyTask(sequence_id="nobody", num_committed=3, direct_drafts=2)
            await verify.write(
                verifier_pb2.VerifyRequest(round_id=7, tasks=[task], lease_owner="probe", drafts_wait_ms=1)
            )
            reply = await verify.read()
            deliver = stub.Deliver()
            late = verifier_pb2.DeliveredDrafts(sequence_id="nobody", token_ids=[1, 2])
            await deliver.write(verifier_pb2.DraftDelivery(lease_owner="probe", round_id=7, drafts=[late]))
            ack = await asyncio.wait_for(deliver.read(), 30)  # only a refusal is answered
            verify.cancel()
            deliver.cancel()
            return reply, ack

    reply, ack = asyncio.run(run())
    # Its wait over, the round was verified without drafts (the sequence is not open: its own error).
    assert reply.drafts_missing and not reply.results[0].direct_draft_token_ids
    assert ack.round_id == 7 and "round 7 of gateway 'probe' awaits no drafts" in ack.error


def test_a_drafter_killed_mid_stream_costs_no_token(model_dirs, log_dir, tok, references):
    verifier = st.spawn_backend("verifier", model_args(model_dirs["target"]), log_dir)
    services = [verifier]
    try:
        drafter = st.spawn_backend(
            "drafter",
            [*model_args(model_dirs["draft"]), "--quantize", "none", "--deliver-to", verifier.address],
            log_dir,
        )
        services.append(drafter)
        gateway = st.spawn_gateway(
            verifier,
            drafter,
            # A drafter deadline (the verifier's wait for drafts) longer than the test allows a request: a
            # round whose drafts died with the drafter goes on once the gateway releases it, not after that.
            [*GATEWAY, str(model_dirs["target"]), "--exchange", "direct", "--drafter-timeout-s", "60"],
            log_dir,
        )
        services.append(gateway)
        for service in (verifier, drafter):
            st.ready_backend(service)
        st.ready_gateway(gateway)

        async def stream_then_kill() -> tuple[str, float]:
            started = asyncio.Event()
            async with httpx.AsyncClient(base_url=st.base_url(gateway), timeout=120) as client:
                text = asyncio.create_task(st.stream_text(client, PROMPTS[0], TOKENS, started))
                await started.wait()
                drafter.proc.send_signal(signal.SIGKILL)
                killed = time.monotonic()
                return await text, time.monotonic() - killed

        text, after_kill_s = asyncio.run(stream_then_kill())
        assert text == texts(tok, references)[0] and after_kill_s < 30
        # Target-only now, through the same gateway, and as exact.
        assert st.complete_texts(st.base_url(gateway), PROMPTS[1:2], TOKENS) == texts(tok, references)[1:2]
        assert metrics(gateway)["specd_drafter_up"] == 0
    finally:
        st.stop_all(list(reversed(services)))
