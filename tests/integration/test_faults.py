"""Faults with real processes: a drafter failure costs speed, never a request; a verifier
failure is explicit; overload is refused at once; nothing is lost or duplicated.

Each test that kills a process starts its own services (loopback, tiny models) and
restarts what it killed on the same port.
"""

from __future__ import annotations

import asyncio
import os
import random
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

from specd.proto.speculative.v1 import (
    drafter_pb2,
    drafter_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    verifier_pb2,
    verifier_pb2_grpc,
)

MODEL = "target"
PROMPTS = list(ALL_PROMPTS[:8])
PIPELINES = ["sequential", "cohort", "ahead", "auto"]
LONGEST = 48


@pytest.fixture(scope="module")
def references(tok, tiny_target) -> dict[str, list[int]]:
    """Target-only greedy tokens of each prompt (a prefix of them for shorter max_tokens)."""
    return greedy_references(tok, tiny_target, PROMPTS, LONGEST)


def expected_text(tok, references, prompt: str, max_tokens: int) -> str:
    return api_text(tok, references[prompt][:max_tokens])


def backend(kind: str, args: list[str], log_dir: Path, port: int | None = None) -> st.Service:
    """Start (or restart, on the same port) a drafter or verifier and wait until it is healthy."""
    return st.ready_backend(st.spawn_backend(kind, args, log_dir, port))


def model_args(path: Path, kind: str = "drafter") -> list[str]:
    return ["--model", str(path), "--dtype", "float32", *(["--quantize", "none"] if kind == "drafter" else [])]


def open_sequences(address: str, kind: str) -> int:
    with grpc.insecure_channel(address) as ch:
        if kind == "verifier":
            stub = verifier_pb2_grpc.VerifierServiceStub(ch)
            return stub.GetVerifierInfo(verifier_pb2.GetVerifierInfoRequest(), timeout=5).open_sequences
        d = drafter_pb2_grpc.DrafterServiceStub(ch)
        return d.GetDrafterInfo(drafter_pb2.GetDrafterInfoRequest(), timeout=5).open_sequences


def wait_until(predicate, timeout_s: float, what: str, interval_s: float = 0.2) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(interval_s)


def wait_closed(*services: st.Service, timeout_s: float = 15.0) -> None:
    for s in services:
        wait_until(lambda s=s: open_sequences(s.address, s.name) == 0, timeout_s, f"{s.name} to close its sequences")


def metrics(gateway: st.Service) -> dict[str, float]:
    text = httpx.get(st.base_url(gateway) + "/metrics", timeout=10).text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples if not s.labels}


def health(gateway: st.Service) -> httpx.Response:
    return httpx.get(st.base_url(gateway) + "/health", timeout=10)


def stop_cleanly(service: st.Service) -> None:
    """SIGTERM must end a service within its grace period with exit code 0."""
    service.proc.send_signal(signal.SIGTERM)
    code = service.proc.wait(30)
    assert code == 0, f"{service.name} exited with {code} on SIGTERM:\n{service.output()[-3000:]}"


@pytest.fixture
def own_stack(request, model_dirs, log_dir) -> Iterator[dict[str, st.Service]]:
    """Verifier, drafter and gateway of this test alone (it kills some of them); a test may
    choose the gateway's --pipeline through indirect parametrisation."""
    pipeline = getattr(request, "param", "sequential")
    services: dict[str, st.Service] = {}
    # Spawned together, then waited for: the gateway waits for its backends itself.
    services["verifier"] = st.spawn_backend("verifier", model_args(model_dirs["target"], "verifier"), log_dir)
    try:
        services["drafter"] = st.spawn_backend("drafter", model_args(model_dirs["draft"]), log_dir)
        services["gateway"] = st.spawn_gateway(
            services["verifier"],
            services["drafter"],
            [
                "--tokenizer", str(model_dirs["target"]),
                "--num-speculative-tokens", "4",
                # Short, so a stall costs little; not so short that a busy CI machine trips it.
                "--drafter-timeout-s", "2",
                "--backend-timeout-s", "10",
                "--log-stats-interval-s", "0",
                "--pipeline", pipeline,
            ],
            log_dir,
        )  # fmt: skip
        st.ready_backend(services["verifier"])
        st.ready_backend(services["drafter"])
        st.ready_gateway(services["gateway"])
        yield services
    finally:
        for s in services.values():
            if s.proc.poll() is None:
                s.proc.send_signal(signal.SIGCONT)
        st.stop_all(list(reversed(services.values())))


@pytest.mark.slow  # 25-100 s here, by machine load: it restarts the drafter and waits for the gateway
@pytest.mark.parametrize("own_stack", PIPELINES, indirect=True)
def test_drafter_killed_mid_stream_costs_no_request(own_stack, model_dirs, log_dir, tok, references):
    gateway, drafter, verifier = own_stack["gateway"], own_stack["drafter"], own_stack["verifier"]
    prompts = (PROMPTS * 2)[:16]

    async def run() -> list[str]:
        async with httpx.AsyncClient(base_url=st.base_url(gateway), timeout=120) as client:
            started = [asyncio.Event() for _ in prompts]
            tasks = [
                asyncio.create_task(st.stream_text(client, p, LONGEST, e))
                for p, e in zip(prompts, started, strict=True)
            ]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
            drafter.proc.kill()  # SIGKILL: no goodbye on any stream
            return await asyncio.wait_for(asyncio.gather(*tasks), 120)

    texts = asyncio.run(run())
    for prompt, text in zip(prompts, texts, strict=True):
        assert text == expected_text(tok, references, prompt, LONGEST), prompt
    lost = metrics(gateway)
    assert lost["specd_drafter_up"] == 0
    assert lost["specd_drafter_failures_total"] >= 1
    body = health(gateway)
    assert body.status_code == 200, body.text  # degraded, still serving
    assert body.json()["drafter"] == "unavailable"

    # Back on the same port: the gateway notices, re-opens sequences there and speculates again.
    own_stack["drafter"] = backend("drafter", model_args(model_dirs["draft"]), log_dir, port=drafter.port)
    wait_until(lambda: health(gateway).json()["drafter"] == "ok", 30, "the gateway to take the drafter back")
    before = metrics(gateway)["specd_spec_decode_num_drafts_total"]
    texts = asyncio.run(_gather_streams(gateway, PROMPTS[:4], LONGEST))
    for prompt, text in zip(PROMPTS[:4], texts, strict=True):
        assert text == expected_text(tok, references, prompt, LONGEST), prompt
    after = metrics(gateway)
    assert after["specd_spec_decode_num_drafts_total"] > before
    # (Not drafter_up == 1 now: on a loaded machine a round of the cold drafter may
    # overrun its deadline again, which is the behaviour under test, not a failure.)
    assert after["specd_drafter_reconnects_total"] >= 1
    wait_closed(verifier, own_stack["drafter"])
    # Graceful shutdown of every service: exit 0 on SIGTERM.
    for name in ("gateway", "drafter", "verifier"):
        stop_cleanly(own_stack[name])


async def _gather_streams(gateway: st.Service, prompts: list[str], max_tokens: int) -> list[str]:
    async with httpx.AsyncClient(base_url=st.base_url(gateway), timeout=120) as client:
        return await asyncio.gather(*(st.stream_text(client, p, max_tokens, None) for p in prompts))


async def _drafter_up(gateway: st.Service, until_s: float) -> float:
    """specd_drafter_up once it reads 0, or as it reads after `until_s`."""
    deadline = time.monotonic() + until_s
    while (up := metrics(gateway)["specd_drafter_up"]) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    return up


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_drafter_frozen_past_its_deadline(gateway_for, backends, tok, references, pipeline):
    # The session's backends: the drafter is thawed, and what it held closed, before the test ends.
    verifier, drafter = backends
    gateway = gateway_for(4, "--drafter-timeout-s", "2", "--backend-timeout-s", "10", "--pipeline", pipeline)
    prompts = PROMPTS

    async def run() -> list[str]:
        async with httpx.AsyncClient(base_url=st.base_url(gateway), timeout=120) as client:
            started = [asyncio.Event() for _ in prompts]
            tasks = [
                asyncio.create_task(st.stream_text(client, p, LONGEST, e))
                for p, e in zip(prompts, started, strict=True)
            ]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
            drafter.proc.send_signal(signal.SIGSTOP)
            try:
                return await asyncio.wait_for(asyncio.gather(*tasks), 120)
            finally:
                # Kept frozen until past its deadline: the streams may end sooner, target-only, when
                # what they waited on was a drafter prefill in flight (no round waits for one), and
                # that prefill's deadline is what marks the drafter down then.
                frozen = await _drafter_up(gateway, until_s=2 + 8)
                drafter.proc.send_signal(signal.SIGCONT)
                assert frozen == 0

    t0 = time.monotonic()
    texts = asyncio.run(run())
    assert time.monotonic() - t0 < 60
    for prompt, text in zip(prompts, texts, strict=True):
        assert text == expected_text(tok, references, prompt, LONGEST), prompt
    # Thawed, it is taken back, and what it held from before the stall is closed there.
    wait_until(lambda: health(gateway).json()["drafter"] == "ok", 30, "the gateway to take the drafter back")
    texts = asyncio.run(_gather_streams(gateway, PROMPTS[:2], 16))
    assert texts == [expected_text(tok, references, p, 16) for p in PROMPTS[:2]]
    wait_closed(verifier, drafter)


def test_verifier_killed_fails_fast_then_recovers(own_stack, model_dirs, log_dir, tok, references):
    gateway, verifier = own_stack["gateway"], own_stack["verifier"]
    body = {"model": MODEL, "prompt": "Go on", "max_tokens": 400, "temperature": 0, "ignore_eos": True}

    async def run() -> tuple[list[httpx.Response], float]:
        async with httpx.AsyncClient(base_url=st.base_url(gateway), timeout=60) as client:
            tasks = [asyncio.create_task(client.post("/v1/completions", json=body)) for _ in range(4)]
            # Wait until the requests are running, then kill the verifier under them.
            deadline = time.monotonic() + 30
            while (await client.get("/health")).json()["running"] < 4:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            verifier.proc.kill()
            killed = time.monotonic()
            replies = await asyncio.gather(*tasks)
            return replies, time.monotonic() - killed

    replies, elapsed = asyncio.run(run())
    for r in replies:
        assert r.status_code == 503, r.text
        assert r.json()["error"]["type"] == "server_error" and r.json()["error"]["message"]
        assert r.headers["retry-after"]
    assert elapsed < 10, f"requests took {elapsed:.1f}s to fail after the verifier died"
    assert health(gateway).status_code == 503
    # A request while it is down is refused at once with 503.
    r = httpx.post(st.base_url(gateway) + "/v1/completions", json={**body, "max_tokens": 4}, timeout=30)
    assert r.status_code == 503 and "error" in r.json()
    with grpc.insecure_channel(f"{st.HOST}:{gateway.grpc_port}") as ch:
        stub = gateway_pb2_grpc.GatewayServiceStub(ch)
        params = gateway_pb2.GenerationParams(max_tokens=4, temperature=0.0)
        with pytest.raises(grpc.RpcError) as info:
            stub.Generate(gateway_pb2.GenerateRequest(prompt="Hi", params=params), timeout=30)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE

    own_stack["verifier"] = backend(
        "verifier", model_args(model_dirs["target"], "verifier"), log_dir, port=verifier.port
    )
    wait_until(lambda: health(gateway).status_code == 200, 30, "the gateway to be ready again")
    texts = asyncio.run(_gather_streams(gateway, PROMPTS[:4], 24))
    assert texts == [expected_text(tok, references, p, 24) for p in PROMPTS[:4]]
    wait_closed(own_stack["verifier"], own_stack["drafter"])


def test_overload_gets_429_at_once_and_the_rest_complete(gateway_for, tok, references):
    max_batch, max_waiting = 2, 4
    gateway = gateway_for(4, "--max-batch", str(max_batch), "--max-waiting", str(max_waiting))
    n = 4 * max_waiting

    async def one(client: httpx.AsyncClient, prompt: str) -> tuple[httpx.Response, float]:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": LONGEST, "temperature": 0, "ignore_eos": True}
        t0 = time.monotonic()
        r = await client.post("/v1/completions", json=body)
        return r, time.monotonic() - t0

    async def run():
        async with httpx.AsyncClient(base_url=st.base_url(gateway), timeout=120) as client:
            return await asyncio.gather(*(one(client, PROMPTS[i % len(PROMPTS)]) for i in range(n)))

    replies = asyncio.run(run())
    refused = [(r, dt) for r, dt in replies if r.status_code == 429]
    served = [(i, r) for i, (r, _) in enumerate(replies) if r.status_code != 429]
    assert len(refused) >= n - 2 * (max_batch + max_waiting), [r.status_code for r, _ in replies]
    for r, dt in refused:
        assert dt < 5, f"a refusal took {dt:.2f}s"
        assert r.json()["error"]["type"] == "rate_limit_error" and r.headers["retry-after"]
    for i, r in served:
        assert r.status_code == 200, r.text
        prompt = PROMPTS[i % len(PROMPTS)]
        assert r.json()["choices"][0]["text"] == expected_text(tok, references, prompt, LONGEST)


def test_request_timeout_fails_clearly_and_frees_the_sequence(gateway_for, backends):
    gateway = gateway_for(4, "--request-timeout-s", "0.3")
    body = {"model": MODEL, "prompt": "Go on", "max_tokens": 450, "temperature": 0, "ignore_eos": True}
    t0 = time.monotonic()
    r = httpx.post(st.base_url(gateway) + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 504, r.text
    assert r.json()["error"]["code"] == "timeout"
    assert time.monotonic() - t0 < 5
    wait_closed(*backends)


def test_gateway_sigterm_finishes_in_flight_requests_and_exits_0(backends, model_dirs, log_dir, tok, references):
    verifier, drafter = backends
    gateway = st.start_gateway(
        verifier,
        drafter,
        ["--tokenizer", str(model_dirs["target"]), "--num-speculative-tokens", "4", "--shutdown-grace-s", "60"],
        log_dir,
    )
    try:

        async def run() -> tuple[list[str], int]:
            async with httpx.AsyncClient(base_url=st.base_url(gateway), timeout=120) as client:
                started = [asyncio.Event() for _ in PROMPTS[:4]]
                tasks = [
                    asyncio.create_task(st.stream_text(client, p, LONGEST, e))
                    for p, e in zip(PROMPTS[:4], started, strict=True)
                ]
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
                gateway.proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.2)
                body = {"model": MODEL, "prompt": "late", "max_tokens": 4}
                late = (await client.post("/v1/completions", json=body)).status_code
                return await asyncio.gather(*tasks), late

        texts, late = asyncio.run(run())
        assert texts == [expected_text(tok, references, p, LONGEST) for p in PROMPTS[:4]]
        assert late == 503  # draining: no new requests
        assert gateway.proc.wait(30) == 0
    finally:
        gateway.stop()
    wait_closed(verifier, drafter)


def test_rate_limit_per_api_key(gateway_for):
    gateway = gateway_for(4, "--rate-limit", "2")
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1, "temperature": 0}

    def burst(key: str) -> list[int]:
        headers = {"Authorization": f"Bearer {key}"}
        return [
            httpx.post(st.base_url(gateway) + "/v1/completions", json=body, headers=headers, timeout=30).status_code
            for _ in range(5)
        ]

    codes = burst("alice")
    assert codes.count(200) >= 2 and 429 in codes, codes
    assert 200 in burst("bob")  # another key has its own budget


# The issue asks for 1,000 requests at concurrency 32; about a minute here (tiny models).
# SPECD_SOAK_REQUESTS=100 makes a quicker run.
SOAK_REQUESTS = int(os.environ.get("SPECD_SOAK_REQUESTS", "1000"))
SOAK_CONCURRENCY = int(os.environ.get("SPECD_SOAK_CONCURRENCY", "32"))
SOAK_CANCEL_RATE = 0.15
# What a soak tests is each sequence's life (open, rounds beside others, cancel or finish, close), not
# its length: short outputs turn the batch over more often for the same time, and the longest still
# spans rounds of every k.
SOAK_LENGTHS = (4, 8, 16, 32)


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


@pytest.mark.slow
def test_soak_with_random_cancellations(gateway_for, backends, tok, references):
    """SPECD_SOAK_REQUESTS requests at SPECD_SOAK_CONCURRENCY, some cancelled mid-stream."""
    gateway = gateway_for(4)
    verifier, drafter = backends
    rng = random.Random(6)
    plan = [
        (PROMPTS[rng.randrange(len(PROMPTS))], rng.choice(SOAK_LENGTHS), rng.random() < SOAK_CANCEL_RATE)
        for _ in range(SOAK_REQUESTS)
    ]
    outcome = {"completed": 0, "cancelled": 0, "mismatched": 0, "errors": 0}

    async def one(client: httpx.AsyncClient, prompt: str, max_tokens: int, cancel: bool) -> None:
        body = {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        parts: list[str] = []
        cut = rng.randint(1, 3)
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                outcome["errors"] += 1
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                payload = httpx.Response(200, content=line[6:]).json()
                if "error" in payload:
                    outcome["errors"] += 1
                    return
                parts.append(payload["choices"][0]["text"])
                if cancel and len(parts) >= cut:
                    outcome["cancelled"] += 1
                    return  # leaving the block closes the connection mid-stream
        outcome["completed"] += 1
        if "".join(parts) != expected_text(tok, references, prompt, max_tokens):
            outcome["mismatched"] += 1

    async def run(requests) -> None:
        limit = asyncio.Semaphore(SOAK_CONCURRENCY)

        async def bounded(*args) -> None:
            async with limit:
                await one(client, *args)

        async with httpx.AsyncClient(base_url=st.base_url(gateway), timeout=120) as client:
            await asyncio.wait_for(asyncio.gather(*(bounded(*p) for p in requests)), 600)

    procs = {"verifier": verifier.proc.pid, "drafter": drafter.proc.pid, "gateway": gateway.proc.pid}
    warm = max(SOAK_CONCURRENCY, SOAK_REQUESTS // 3)
    t0 = time.monotonic()
    asyncio.run(run(plan[:warm]))
    wait_closed(verifier, drafter)
    rss_warm = {name: rss_bytes(pid) for name, pid in procs.items()}
    asyncio.run(run(plan[warm:]))
    elapsed = time.monotonic() - t0
    wait_closed(verifier, drafter)
    rss_end = {name: rss_bytes(pid) for name, pid in procs.items()}
    print(
        f"soak: {SOAK_REQUESTS} requests at concurrency {SOAK_CONCURRENCY} in {elapsed:.0f}s: {outcome}; "
        f"RSS after warm-up {rss_warm}, at the end {rss_end}"
    )
    assert outcome["errors"] == 0 and outcome["mismatched"] == 0, outcome
    assert outcome["completed"] + outcome["cancelled"] == SOAK_REQUESTS
    for name in procs:
        assert rss_end[name] <= rss_warm[name] * 1.10, f"{name} RSS grew: {rss_warm[name]} -> {rss_end[name]}"
