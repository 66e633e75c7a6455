"""The issue's probes against real processes: authenticated backends, text that cannot be
tokenised, huge and slow bodies, too many connections. Every probe gets a 4xx or a closed
connection, the services stay up, and the gateway's memory stays near where it started.

One stack: drafter and verifier that take a backend token from a file, a gateway with the
same file, an API key, and small HTTP limits so the probes finish in seconds.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import httpx
import psutil
import pytest
import stack as st
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from specd.proto.speculative.v1 import (
    common_pb2,
    drafter_pb2,
    drafter_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    verifier_pb2,
    verifier_pb2_grpc,
)
from specd.rpc.health import check

TOKEN = "test-backend-token-0123456789abcdef"
API_KEY = "sk-security-test"
MAX_BODY = 1024 * 1024
READ_TIMEOUT_S = 3.0
MAX_CONNECTIONS = 48
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@dataclass
class SecureStack:
    verifier: st.Service
    drafter: st.Service
    gateway: st.Service

    @property
    def url(self) -> str:
        return st.base_url(self.gateway)


@pytest.fixture(scope="module")
def secure(model_dirs, log_dir, tmp_path_factory) -> Iterator[SecureStack]:
    token_file = tmp_path_factory.mktemp("secrets") / "backend-token"
    token_file.write_text(TOKEN + "\n")
    auth = ["--backend-token-file", str(token_file)]
    services: list[st.Service] = []
    try:
        verifier = st.spawn_backend("verifier", ["--model", str(model_dirs["target"]), *auth], log_dir)
        services.append(verifier)
        drafter = st.spawn_backend("drafter", ["--drafter", "ngram", *auth], log_dir)
        services.append(drafter)
        gateway = st.spawn_gateway(
            verifier,
            drafter,
            [
                "--tokenizer", str(model_dirs["target"]),
                "--served-model-name", "target",
                "--api-key", API_KEY,
                "--http-max-body-bytes", str(MAX_BODY),
                "--http-read-timeout-s", str(READ_TIMEOUT_S),
                "--http-max-connections", str(MAX_CONNECTIONS),
                *auth,
            ],
            log_dir,
        )  # fmt: skip
        services.append(gateway)
        st.ready_backend(verifier)
        st.ready_backend(drafter)
        st.ready_gateway(gateway)
    except BaseException:
        st.stop_all(services)
        raise
    yield SecureStack(verifier, drafter, gateway)
    st.stop_all(list(reversed(services)))


def completion(url: str, prompt: str = "hello", max_tokens: int = 4) -> httpx.Response:
    body = {"model": "target", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=60)


def assert_serving(stack: SecureStack) -> None:
    for service in (stack.verifier, stack.drafter):
        assert service.proc.poll() is None, service.output()
    response = completion(stack.url)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4


def rss(service: st.Service) -> int:
    return psutil.Process(service.proc.pid).memory_info().rss


# -- authenticated backends -----------------------------------------------------------------


def _backend_calls(channel: grpc.Channel, kind: str) -> dict[str, object]:
    """One call of each kind a stranger would try: model info, opening sequences, reflection."""
    spec = common_pb2.SequenceSpec(
        sequence_id="stranger", prompt_token_ids=[1, 2, 3], sampling=common_pb2.SamplingParams(top_p=1.0)
    )
    if kind == "verifier":
        stub = verifier_pb2_grpc.VerifierServiceStub(channel)
        info = (stub.GetVerifierInfo, verifier_pb2.GetVerifierInfoRequest())
        open_ = (stub.OpenVerifySequences, verifier_pb2.OpenVerifySequencesRequest(sequences=[spec]))
    else:
        stub = drafter_pb2_grpc.DrafterServiceStub(channel)
        info = (stub.GetDrafterInfo, drafter_pb2.GetDrafterInfoRequest())
        open_ = (stub.OpenDraftSequences, drafter_pb2.OpenDraftSequencesRequest(sequences=[spec]))
    return {"info": info, "open": open_}


def _reflection_list(channel: grpc.Channel, metadata=()) -> list[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    replies = stub.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5, metadata=metadata
    )
    return [s.name for reply in replies for s in reply.list_services_response.service]


@pytest.mark.parametrize("kind", ["verifier", "drafter"])
def test_a_backend_refuses_callers_without_the_gateways_token(secure, kind):
    service = secure.verifier if kind == "verifier" else secure.drafter
    with grpc.insecure_channel(service.address) as channel:
        calls = _backend_calls(channel, kind)
        for metadata in ((), (("authorization", "Bearer wrong-token-0123456789"),), (("authorization", TOKEN),)):
            for name, (method, request) in calls.items():
                with pytest.raises(grpc.RpcError) as info:
                    method(request, timeout=5, metadata=metadata)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, (name, metadata)
            with pytest.raises(grpc.RpcError) as info:
                _reflection_list(channel, metadata)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # Probes carry no token: health stays open.
        assert check(service.address) == "SERVING"
        # The gateway's token opens everything, and nothing the stranger tried was opened.
        good = (("authorization", f"Bearer {TOKEN}"),)
        method, request = calls["info"]
        assert method(request, timeout=5, metadata=good).open_sequences == 0
        assert any(name.endswith("Service") for name in _reflection_list(channel, good))
    assert_serving(secure)


def test_a_gateway_without_the_token_refuses_to_start(secure, model_dirs, log_dir):
    port = st.free_port()
    gateway = st.spawn(
        "gateway",
        [
            "--host", st.HOST, "--http-port", str(port), "--grpc-port", "0",
            "--verifier", secure.verifier.address, "--drafter", secure.drafter.address,
            "--tokenizer", str(model_dirs["target"]), "--connect-timeout-s", "30",
        ],
        log_dir,
        port,
    )  # fmt: skip
    try:
        assert gateway.proc.wait(90) == 2
    finally:
        gateway.stop()
    output = gateway.output()
    assert "refused the gateway" in output and "backend token" in output, output
    assert "Traceback" not in output


def test_a_backend_on_a_public_address_without_authentication_refuses_to_start(log_dir):
    # The check comes before the model loads (and before anything listens).
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "specd.cli", "verifier", "--host", "0.0.0.0", "--port", str(st.free_port())],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert "--insecure" in result.stderr and "0.0.0.0" in result.stderr
    assert time.monotonic() - started < 60


# -- text that cannot be tokenised ----------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"model": "target", "prompt": "\ud800", "max_tokens": 4}),
        ("/v1/completions", {"model": "target", "prompt": ["ok \udfff"], "max_tokens": 4}),
        ("/v1/chat/completions", {"model": "target", "messages": [{"role": "user", "content": "hi \ud800"}]}),
    ],
)
def test_a_lone_surrogate_is_a_400_with_an_openai_error(secure, path, body):
    # json.dumps writes the surrogate as the escape "\ud800", as a hostile client would.
    raw = json.dumps(body).encode()
    assert b"\\ud" in raw
    response = httpx.post(
        secure.url + path, content=raw, headers={**AUTH, "Content-Type": "application/json"}, timeout=30
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and "surrogate" in error["message"]
    assert error["param"] in ("prompt", "messages")
    assert_serving(secure)


def test_invalid_utf8_over_grpc_is_invalid_argument(secure):
    # A client library cannot even encode a lone surrogate; a raw client can send its bytes.
    good = gateway_pb2.GenerateRequest(model="target", prompt="PLACEHOLDER").SerializeToString()
    raw = good.replace(b"PLACEHOLDER", b"\xed\xa0\x80xxxxxxxx")
    with grpc.insecure_channel(f"{st.HOST}:{secure.gateway.grpc_port}") as channel:
        generate = channel.unary_unary(
            "/speculative.v1.GatewayService/Generate",
            request_serializer=lambda b: b,
            response_deserializer=gateway_pb2.GenerateResponse.FromString,
        )
        with pytest.raises(grpc.RpcError) as info:
            generate(raw, timeout=30, metadata=(("authorization", f"Bearer {API_KEY}"),))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
    assert "UTF-8" in info.value.details()
    stub_reply = gateway_pb2_grpc.GatewayServiceStub(grpc.insecure_channel(f"{st.HOST}:{secure.gateway.grpc_port}"))
    reply = stub_reply.Generate(
        gateway_pb2.GenerateRequest(model="target", prompt="hi", params=gateway_pb2.GenerationParams(max_tokens=2)),
        timeout=60,
        metadata=(("authorization", f"Bearer {API_KEY}"),),
    )
    assert reply.usage.completion_tokens == 2


# -- HTTP limits ----------------------------------------------------------------------------


def _http_connection(stack: SecureStack) -> socket.socket:
    sock = socket.create_connection((st.HOST, stack.gateway.port), timeout=30)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
    return sock


def _head(path: str, extra: str) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: {st.HOST}\r\nAuthorization: Bearer {API_KEY}\r\n"
        f"Content-Type: application/json\r\n{extra}\r\n"
    ).encode()


def _read_reply(sock: socket.socket) -> bytes:
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    return data


def _send_huge(stack: SecureStack, declared: bool, total: int = 100 * 1024 * 1024) -> tuple[bytes, int]:
    """Send (or try to) a `total`-byte body; returns the reply and the bytes the gateway let through."""
    sock = _http_connection(stack)
    framing = f"Content-Length: {total}\r\n" if declared else "Transfer-Encoding: chunked\r\n"
    sock.sendall(_head("/v1/completions", framing))
    chunk = b"x" * (1024 * 1024)
    sent = 0
    sock.settimeout(10)
    try:
        while sent < total:
            piece = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n" if not declared else chunk
            sock.sendall(piece)
            sent += len(chunk)
    except (BrokenPipeError, ConnectionResetError, TimeoutError):
        pass
    reply = _read_reply(sock)
    sock.close()
    return reply, sent


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_six_concurrent_100mb_bodies_get_413_and_memory_stays_near_baseline(secure, declared):
    assert_serving(secure)
    before = rss(secure.gateway)
    results: list[tuple[bytes, int]] = []
    threads = [threading.Thread(target=lambda: results.append(_send_huge(secure, declared))) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    after = rss(secure.gateway)
    assert len(results) == 6
    for reply, sent in results:
        assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
        body = json.loads(reply.split(b"\r\n\r\n", 1)[1])
        assert body["error"]["code"] == "request_too_large"
        assert sent < 100 * 1024 * 1024, "the gateway must stop reading long before the end"
    print(f"gateway RSS {before / 2**20:.0f} MiB before, {after / 2**20:.0f} MiB after six 100 MB bodies")
    # Each refused body held at most the 1 MiB limit; six at once stay far below one 100 MB body.
    assert after - before < 40 * 2**20
    assert_serving(secure)


def test_a_slow_body_is_cut_off_after_the_read_timeout(secure):
    sock = _http_connection(secure)
    sock.sendall(_head("/v1/completions", "Content-Length: 200\r\n"))
    started = time.monotonic()
    closed_after = None
    reply = b""
    sock.settimeout(0.5)
    for _ in range(40):  # one byte a second, as the slow loris, for up to 20 s
        try:
            sock.sendall(b"{")
        except (BrokenPipeError, ConnectionResetError):
            closed_after = time.monotonic() - started
            break
        try:
            data = sock.recv(65536)
        except TimeoutError:
            time.sleep(0.5)
            continue
        except ConnectionResetError:
            data = b""
        reply += data
        if not data or reply.startswith(b"HTTP/1.1 408"):
            closed_after = time.monotonic() - started
            break
    sock.close()
    assert closed_after is not None, "the slow body was never cut off"
    assert closed_after < READ_TIMEOUT_S + 2, closed_after
    assert not reply or reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert_serving(secure)


def test_slow_headers_on_many_connections_are_all_closed(secure):
    # The probe, scaled down: connections that trickle their headers a byte at a time.
    socks = [_http_connection(secure) for _ in range(MAX_CONNECTIONS - 8)]
    for sock in socks:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        sock.settimeout(0.05)
    started = time.monotonic()
    open_ = set(range(len(socks)))
    while open_ and time.monotonic() - started < READ_TIMEOUT_S + 10:
        for i in list(open_):
            try:
                socks[i].sendall(b"X")
                if socks[i].recv(1024) == b"":
                    open_.discard(i)
            except TimeoutError:
                pass
            except (BrokenPipeError, ConnectionResetError):
                open_.discard(i)
        time.sleep(0.5)
    elapsed = time.monotonic() - started
    for sock in socks:
        sock.close()
    assert not open_, f"{len(open_)} of {len(socks)} slow connections still open after {elapsed:.1f}s"
    assert elapsed < READ_TIMEOUT_S + 3
    assert_serving(secure)


def test_connections_beyond_the_limit_get_503_until_the_idle_ones_are_closed(secure):
    idle = [_http_connection(secure) for _ in range(MAX_CONNECTIONS + 2)]
    time.sleep(0.3)
    over = completion(secure.url)
    assert over.status_code == 503, over.text
    for sock in idle:
        assert _read_reply(sock) == b"", "an idle connection is closed without a reply"
        sock.close()
    assert_serving(secure)
