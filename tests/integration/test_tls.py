"""TLS on every hop, mutual TLS between gateway and services, and API keys on the gateway's APIs.

One stack: drafter and verifier serve TLS and require client certificates; the
gateway dials them with its client certificate, serves HTTPS and gRPC over TLS,
and takes two API keys (comma-separated, from the environment).
"""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import certs as certgen
import grpc
import httpx
import pytest
import stack as st

from specd.proto.speculative.v1 import gateway_pb2, gateway_pb2_grpc
from specd.rpc.health import check
from specd.rpc.tls import channel_credentials

KEYS = ("key-one", "key-two")
MODEL = "target"


@dataclass
class TlsStack:
    certs: certgen.Certs
    verifier: st.Service
    drafter: st.Service
    gateway: st.Service

    @property
    def https(self) -> str:
        return f"https://{st.HOST}:{self.gateway.port}"

    @property
    def grpc_address(self) -> str:
        return f"{st.HOST}:{self.gateway.grpc_port}"

    def client_credentials(self) -> grpc.ChannelCredentials:
        return channel_credentials(str(self.certs.ca), str(self.certs.client_cert), str(self.certs.client_key))


def _wait(what: str, service: st.Service, ready, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if service.proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {service.proc.returncode}:\n{service.output()}")
        try:
            if ready():
                return
        except (grpc.RpcError, httpx.HTTPError):
            pass
        time.sleep(0.2)
    service.stop()
    raise TimeoutError(f"{what} not ready:\n{service.output()}")


@pytest.fixture(scope="module")
def tls_stack(model_dirs, log_dir, tmp_path_factory) -> Iterator[TlsStack]:
    certs = certgen.make_certs(tmp_path_factory.mktemp("certs"))
    mtls = ["--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key), "--tls-client-ca", str(certs.ca)]
    client = channel_credentials(str(certs.ca), str(certs.client_cert), str(certs.client_key))
    services: list[st.Service] = []
    try:
        backends = {}
        for kind, model in (("verifier", model_dirs["target"]), ("drafter", model_dirs["draft"])):
            port = st.free_port()
            extra = ["--quantize", "none"] if kind == "drafter" else []
            service = st.spawn(
                kind,
                ["--host", st.HOST, "--port", str(port), "--model", str(model), "--dtype", "float32", *extra, *mtls],
                log_dir,
                port,
            )
            services.append(service)
            backends[kind] = service
        for kind, service in backends.items():
            _wait(kind, service, lambda s=service: check(s.address, client, timeout_s=1) == "SERVING")
        http_port, grpc_port = st.free_port(), st.free_port()
        os.environ["SPECD_GATEWAY_API_KEY"] = ",".join(KEYS)
        try:
            gateway = st.spawn(
                "gateway",
                [
                    "--host", st.HOST, "--http-port", str(http_port), "--grpc-port", str(grpc_port),
                    "--verifier", backends["verifier"].address, "--drafter", backends["drafter"].address,
                    "--tokenizer", str(model_dirs["target"]), "--num-speculative-tokens", "3",
                    "--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key),
                    "--backend-tls-ca", str(certs.ca),
                    "--backend-tls-cert", str(certs.client_cert), "--backend-tls-key", str(certs.client_key),
                ],
                log_dir,
                http_port,
            )  # fmt: skip
        finally:
            del os.environ["SPECD_GATEWAY_API_KEY"]
        gateway.grpc_port = grpc_port
        services.append(gateway)
        url = f"https://{st.HOST}:{http_port}/health"
        _wait("gateway", gateway, lambda: httpx.get(url, verify=trust(certs.ca), timeout=2).status_code == 200)
    except BaseException:
        for s in reversed(services):
            s.stop()
        raise
    yield TlsStack(certs, backends["verifier"], backends["drafter"], gateway)
    for s in reversed(services):
        s.stop()


def trust(ca: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(ca))


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_https_completion_through_tls_and_mtls_hops(tls_stack):
    for key in KEYS:
        r = httpx.post(
            tls_stack.https + "/v1/completions",
            json={"model": MODEL, "prompt": "Hello", "max_tokens": 8, "temperature": 0},
            headers=bearer(key),
            verify=trust(tls_stack.certs.ca),
            timeout=60,
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
    health = httpx.get(tls_stack.https + "/health", verify=trust(tls_stack.certs.ca)).json()
    assert health["drafter"] == "ok" and health["verifier"] == "ok"


@pytest.mark.parametrize("headers", [{}, bearer("wrong"), {"Authorization": KEYS[0]}, {"Authorization": "Basic x"}])
def test_http_api_key_refusals(tls_stack, headers):
    for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models")):
        r = httpx.request(
            method,
            tls_stack.https + path,
            json={"model": MODEL, "prompt": "Hello", "max_tokens": 4},
            headers=headers,
            verify=trust(tls_stack.certs.ca),
        )
        assert r.status_code == 401, r.text
        error = r.json()["error"]
        assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
        assert "API key" in error["message"]


def test_probes_stay_open_without_a_key(tls_stack):
    ca = trust(tls_stack.certs.ca)
    assert httpx.get(tls_stack.https + "/health", verify=ca).status_code == 200
    assert httpx.get(tls_stack.https + "/metrics", verify=ca).status_code == 200
    assert check(tls_stack.grpc_address, channel_credentials(str(tls_stack.certs.ca))) == "SERVING"


def test_plaintext_http_to_https_gateway_fails(tls_stack):
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://{st.HOST}:{tls_stack.gateway.port}/health", timeout=5)


def test_wrong_ca_is_refused_by_the_client(tls_stack):
    with pytest.raises(httpx.HTTPError):
        httpx.get(tls_stack.https + "/health", verify=trust(tls_stack.certs.other_ca), timeout=5)
    with pytest.raises(grpc.RpcError) as info:
        check(tls_stack.verifier.address, channel_credentials(str(tls_stack.certs.other_ca)), timeout_s=5)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_grpc_api_key(tls_stack):
    credentials = channel_credentials(str(tls_stack.certs.ca))
    request = gateway_pb2.GenerateRequest(
        model=MODEL, prompt="Hello", params=gateway_pb2.GenerationParams(max_tokens=6, temperature=0)
    )
    with grpc.secure_channel(tls_stack.grpc_address, credentials) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", KEYS[1]),)):
            with pytest.raises(grpc.RpcError) as info:
                stub.Generate(request, metadata=metadata, timeout=30)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as info:
                list(stub.GenerateStream(request, metadata=metadata, timeout=30))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        reply = stub.Generate(request, metadata=(("authorization", f"Bearer {KEYS[1]}"),), timeout=60)
        assert reply.usage.completion_tokens == 6
        streamed = list(stub.GenerateStream(request, metadata=(("authorization", f"Bearer {KEYS[0]}"),), timeout=60))
        assert [t for r in streamed for t in r.token_ids] == list(reply.token_ids)


def test_plaintext_client_to_tls_services_fails(tls_stack):
    for address in (tls_stack.verifier.address, tls_stack.drafter.address, tls_stack.grpc_address):
        with pytest.raises(grpc.RpcError) as info:
            check(address, None, timeout_s=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_mtls_refuses_a_client_without_a_certificate(tls_stack):
    ca = str(tls_stack.certs.ca)
    for backend in (tls_stack.verifier, tls_stack.drafter):
        with pytest.raises(grpc.RpcError) as info:
            check(backend.address, channel_credentials(ca), timeout_s=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert check(backend.address, tls_stack.client_credentials()) == "SERVING"


def test_health_cli_over_mtls(tls_stack):
    c = tls_stack.certs

    def health(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "specd.cli", "health", tls_stack.verifier.address, "--timeout-s", "5", *args],
            capture_output=True,
            text=True,
            timeout=60,
        )

    ok = health("--tls-ca", str(c.ca), "--tls-cert", str(c.client_cert), "--tls-key", str(c.client_key))
    assert ok.returncode == 0 and "SERVING" in ok.stdout, ok.stderr
    for args in ((), ("--tls-ca", str(c.ca))):
        refused = health(*args)
        assert refused.returncode == 1 and "UNAVAILABLE" in refused.stderr
