"""Who may call a drafter or verifier: the gateway, proven by a shared token or a client certificate.

Anyone who reaches a backend port could otherwise open sequences until the
service is full, and read the model through reflection. The token travels as
`authorization: Bearer TOKEN` metadata on every call of the gateway's channels
(health checks too, though those stay open for probes); mutual TLS
(`specd.rpc.tls`) proves the same with a certificate, and both can be on at once.
"""

from __future__ import annotations

import ipaddress
import secrets
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc

from specd.rpc.tls import ApiKeyInterceptor, ApiKeys

# One variable for all three services, so one secret configures a deployment.
BACKEND_TOKEN_ENV = "SPECD_BACKEND_TOKEN"
# A token is a secret, not a password: short ones are refused rather than guessed.
MIN_TOKEN_CHARS = 16


class BackendAuthError(ValueError):
    """A token option that cannot work: an unreadable or empty file, a short token."""


def new_token() -> str:
    return secrets.token_urlsafe(32)


def child_environment(environ: Mapping[str, str]) -> tuple[dict[str, str], bool]:
    """The environment `specd up` gives its children: the caller's, with a fresh token unless one is set.

    Returns it and whether the token was made here. Through the environment, not
    a flag, so the token never shows in `ps`.
    """
    env = dict(environ)
    given = [BACKEND_TOKEN_ENV, *(f"SPECD_{s}_BACKEND_TOKEN_FILE" for s in ("DRAFTER", "VERIFIER", "GATEWAY"))]
    if any(env.get(name) for name in given):
        return env, False
    env[BACKEND_TOKEN_ENV] = new_token()
    return env, True


def load_tokens(token: str, token_file: str) -> tuple[str, ...]:
    """The accepted tokens, from the option's text or the file (comma-separated; the first is the one sent)."""
    if token_file:
        try:
            token = Path(token_file).read_text()
        except OSError as exc:
            raise BackendAuthError(f"cannot read the backend token file {token_file!r}: {exc.strerror}") from None
        if not token.strip():
            raise BackendAuthError(f"the backend token file {token_file!r} is empty")
    tokens = tuple(t.strip() for t in token.split(",") if t.strip())
    short = [t for t in tokens if len(t) < MIN_TOKEN_CHARS]
    if short:
        raise BackendAuthError(
            f"a backend token needs at least {MIN_TOKEN_CHARS} characters (make one: openssl rand -hex 32)"
        )
    return tokens


def is_loopback(host: str) -> bool:
    """Whether only this machine can reach `host` (names other than localhost are not trusted to be)."""
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def exposure_problem(host: str, authenticated: bool, insecure: bool) -> str | None:
    """Why a backend must not listen on `host` as configured, or None when it may."""
    if authenticated or insecure or is_loopback(host):
        return None
    return (
        f"refusing to listen on {host} with no client authentication: anyone who reaches the port could "
        f"open sequences and read the model. Set a backend token ({BACKEND_TOKEN_ENV} or --backend-token-file, "
        "the same on the gateway) or mutual TLS (--tls-client-ca), or pass --insecure to accept the risk"
    )


def server_interceptors(tokens: Sequence[str]) -> list[grpc.aio.ServerInterceptor]:
    """UNAUTHENTICATED for every call without a token but health checks (reflection and model info included)."""
    if not tokens:
        return []
    return [
        ApiKeyInterceptor(
            ApiKeys(tokens), refusal="this service answers only its gateway: missing or wrong backend token"
        )
    ]


def token_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """The metadata that carries the token on one call (none without a token)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


def client_interceptors(token: str) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors adding the token to every call of a channel (all four call shapes)."""
    if not token:
        return []
    (header,) = token_metadata(token)

    def with_token(details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), header)
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )

    class UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
        async def intercept_unary_unary(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
            return await continuation(with_token(details), request)

    class UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
        async def intercept_unary_stream(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
            return await continuation(with_token(details), request)

    class StreamUnary(grpc.aio.StreamUnaryClientInterceptor):
        async def intercept_stream_unary(self, continuation: Callable[..., Any], details: Any, requests: Any) -> Any:
            return await continuation(with_token(details), requests)

    class StreamStream(grpc.aio.StreamStreamClientInterceptor):
        async def intercept_stream_stream(self, continuation: Callable[..., Any], details: Any, requests: Any) -> Any:
            return await continuation(with_token(details), requests)

    return [UnaryUnary(), UnaryStream(), StreamUnary(), StreamStream()]
