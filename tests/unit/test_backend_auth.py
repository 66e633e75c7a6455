"""Backend tokens and the refusal to serve a public address unauthenticated (no servers here),
and the HTTP body limits as an ASGI middleware with a fake client."""

from __future__ import annotations

import asyncio

import pytest

from drafter_service.config import DrafterConfig
from gateway.api.http_limits import body_limits
from gateway.config import GatewayConfig
from specd.rpc.backend_auth import (
    BACKEND_TOKEN_ENV,
    BackendAuthError,
    child_environment,
    exposure_problem,
    is_loopback,
    load_tokens,
)
from verifier_service.config import VerifierConfig

TOKEN = "0123456789abcdef-token"


@pytest.fixture(autouse=True)
def no_token_in_the_environment(monkeypatch):
    monkeypatch.delenv(BACKEND_TOKEN_ENV, raising=False)


def test_tokens_come_from_the_option_or_a_file(tmp_path):
    assert load_tokens("", "") == ()
    assert load_tokens(f" {TOKEN} ", "") == (TOKEN,)
    assert load_tokens(f"{TOKEN},{TOKEN}-next", "") == (TOKEN, f"{TOKEN}-next")
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    assert load_tokens("", str(path)) == (TOKEN,)
    path.write_text("\n")
    with pytest.raises(BackendAuthError, match="empty"):
        load_tokens("", str(path))
    with pytest.raises(BackendAuthError, match="cannot read"):
        load_tokens("", str(tmp_path / "missing"))
    with pytest.raises(BackendAuthError, match="at least 16"):
        load_tokens("short", "")


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("127.3.2.1", True), ("::1", True), ("[::1]", True), ("localhost", True),
     ("0.0.0.0", False), ("::", False), ("10.0.0.5", False), ("verifier.internal", False)],
)  # fmt: skip
def test_only_loopback_addresses_count_as_private(host, loopback):
    assert is_loopback(host) is loopback
    assert (exposure_problem(host, authenticated=False, insecure=False) is None) is loopback
    assert exposure_problem(host, authenticated=True, insecure=False) is None
    assert exposure_problem(host, authenticated=False, insecure=True) is None


@pytest.mark.parametrize("config", [VerifierConfig, DrafterConfig])
def test_a_backend_on_a_public_address_needs_a_token_mutual_tls_or_insecure(config, monkeypatch, capsys):
    with pytest.raises(SystemExit):
        config.from_args(["--host", "0.0.0.0"])
    assert "--insecure" in capsys.readouterr().err
    # Server-side TLS alone does not say who the client is.
    with pytest.raises(SystemExit):
        config.from_args(["--host", "0.0.0.0", "--tls-cert", "c.pem", "--tls-key", "k.pem"])
    assert config.from_args(["--host", "0.0.0.0", "--insecure"]).insecure
    assert config.from_args(["--host", "0.0.0.0", "--backend-token-file", "/run/secrets/t"]).backend_token_file
    mtls = ["--tls-cert", "c.pem", "--tls-key", "k.pem", "--tls-client-ca", "ca.pem"]
    assert config.from_args(["--host", "0.0.0.0", *mtls]).tls_client_ca
    assert config.from_args([]).host == "127.0.0.1", "loopback by default needs nothing"
    monkeypatch.setenv(BACKEND_TOKEN_ENV, TOKEN)
    assert config.from_args(["--host", "0.0.0.0"]).backend_token == TOKEN
    with pytest.raises(SystemExit):
        config.from_args(["--backend-token-file", "/run/secrets/t"])  # two sources: which one?


def test_every_service_reads_the_one_token_variable_and_help_hides_it(monkeypatch, capsys):
    monkeypatch.setenv(BACKEND_TOKEN_ENV, TOKEN)
    assert GatewayConfig.from_args([]).backend_token == TOKEN
    assert VerifierConfig.from_args([]).backend_token == TOKEN
    with pytest.raises(SystemExit):
        GatewayConfig.from_args(["--help"])
    help_text = capsys.readouterr().out
    assert BACKEND_TOKEN_ENV in help_text and TOKEN not in help_text


def test_specd_up_makes_a_token_unless_one_is_given():
    env, generated = child_environment({"PATH": "/bin"})
    assert generated and len(env[BACKEND_TOKEN_ENV]) >= 32 and env["PATH"] == "/bin"
    again, _ = child_environment({})
    assert again[BACKEND_TOKEN_ENV] != env[BACKEND_TOKEN_ENV], "a fresh token for every run"
    env, generated = child_environment({BACKEND_TOKEN_ENV: TOKEN})
    assert not generated and env[BACKEND_TOKEN_ENV] == TOKEN
    env, generated = child_environment({"SPECD_VERIFIER_BACKEND_TOKEN_FILE": "/t"})
    assert not generated and BACKEND_TOKEN_ENV not in env


# -- HTTP body limits -----------------------------------------------------------------------


def run_limited(headers: list[tuple[bytes, bytes]], chunks: list[bytes], delay_s: float = 0.0, timeout_s: float = 5):
    """Drive the middleware with a fake client; returns (status, body the app saw, chunks read)."""
    seen: dict[str, object] = {}
    sent: list[dict] = []
    read = 0

    async def app(scope, receive, send):
        message = await receive()
        seen["body"] = message["body"]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def receive():
        nonlocal read
        await asyncio.sleep(delay_s)
        read += 1
        return {"type": "http.request", "body": chunks[read - 1], "more_body": read < len(chunks)}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}
    asyncio.run(body_limits(app, 100, timeout_s)(scope, receive, send))
    return sent[0]["status"], seen.get("body"), read


def test_a_body_within_the_limit_reaches_the_app_whole():
    assert run_limited([], [b"a" * 60, b"b" * 40]) == (200, b"a" * 60 + b"b" * 40, 2)


def test_a_declared_oversized_body_is_refused_before_any_of_it_is_read():
    status, body, read = run_limited([(b"content-length", b"104857600")], [b"x" * 50] * 10)
    assert (status, body, read) == (413, None, 0)


def test_an_undeclared_oversized_body_is_refused_once_it_passes_the_limit():
    status, body, read = run_limited([], [b"x" * 50] * 10)
    assert (status, body, read) == (413, None, 3)


def test_a_body_slower_than_the_read_timeout_gets_408():
    status, body, read = run_limited([], [b"x"] * 10, delay_s=0.05, timeout_s=0.2)
    assert status == 408 and body is None and read < 10
