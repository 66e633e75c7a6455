"""TLS credentials for the gRPC hops, and API keys for the gateway's APIs.

Every service takes PEM file paths, never PEM text: certificates rotate on disk
(Kubernetes secrets, cert-manager, systemd credentials) and paths keep them out
of `ps` and the environment.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import grpc

from specd.ports import PortUnavailable


class TlsConfigError(ValueError):
    """A TLS option that cannot work: a missing half of a pair, an unreadable file."""


# Probes (kubelet's native gRPC probe, `specd health`) carry no metadata, and use Check. Watch
# holds a stream open per call: without a key, anyone could hold thousands.
OPEN_GRPC_PREFIXES = ("/grpc.health.v1.Health/Check",)


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise TlsConfigError(f"cannot read the {what} {path!r}: {exc.strerror}") from None


def server_credentials(cert: str, key: str, client_ca: str = "") -> grpc.ServerCredentials | None:
    """TLS for a gRPC server; with `client_ca`, clients must present a certificate it signed (mTLS).

    None (plaintext) when no certificate is configured.
    """
    if not cert and not key:
        if client_ca:
            raise TlsConfigError("a client CA (mutual TLS) needs the server's own certificate and key too")
        return None
    if not (cert and key):
        raise TlsConfigError("TLS needs both a certificate and a key")
    pair = [(_read(key, "TLS key"), _read(cert, "TLS certificate"))]
    if client_ca:
        return grpc.ssl_server_credentials(
            pair, root_certificates=_read(client_ca, "client CA"), require_client_auth=True
        )
    return grpc.ssl_server_credentials(pair)


def channel_credentials(ca: str, cert: str = "", key: str = "") -> grpc.ChannelCredentials | None:
    """TLS for a client channel, verifying the server against `ca`; `cert`/`key` are the client's own (mTLS).

    None (plaintext) when no CA is configured: TLS is opt-in per hop.
    """
    if bool(cert) != bool(key):
        raise TlsConfigError("a client certificate needs its key, and a key its certificate")
    if not ca:
        if cert:
            raise TlsConfigError("a client certificate (mutual TLS) needs the CA that verifies the server too")
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca, "CA certificate"),
        private_key=_read(key, "client key") if key else None,
        certificate_chain=_read(cert, "client certificate") if cert else None,
    )


def server_name_option(server_name: str) -> list[tuple[str, Any]]:
    """Checks the server's certificate against `server_name` instead of the dialed host."""
    return [("grpc.ssl_target_name_override", server_name)] if server_name else []


def add_port(server: grpc.aio.Server, address: str, credentials: grpc.ServerCredentials | None) -> int:
    """Bind `address` for `server`; the port bound (the one the OS picked, for port 0)."""
    try:
        bound = (
            server.add_secure_port(address, credentials)
            if credentials is not None
            else server.add_insecure_port(address)
        )
    except RuntimeError:  # grpcio raises where older releases returned 0
        bound = 0
    if bound == 0:
        raise PortUnavailable(f"cannot listen on {address}: another process holds the port, or the address is not here")
    return bound


class ApiKeyError(ValueError):
    """A configured API key that no HTTP client could send."""


class ApiKeys:
    """The accepted API keys; empty means the API is open."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._keys = [k.encode() for k in keys if k]
        for i, key in enumerate(self._keys, 1):
            # HTTP carries header values as bytes, and clients send visible ASCII: anything else
            # could never match, so it is a start-up error rather than a key nobody can use.
            if not all(0x21 <= b <= 0x7E for b in key):
                raise ApiKeyError(
                    f"API key {i} has characters an HTTP header cannot carry: use visible ASCII without spaces "
                    "or commas (e.g. openssl rand -hex 32)"
                )

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def allows(self, authorization: str | bytes | None) -> bool:
        """Whether an `Authorization` value (HTTP's bytes, or gRPC's text) is `Bearer <one of the keys>`."""
        if not self._keys:
            return True
        raw = authorization if isinstance(authorization, bytes) else (authorization or "").encode("utf-8", "replace")
        scheme, _, token = raw.strip().partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        presented = token.strip()
        # Compare against every key so timing does not reveal which one nearly matched.
        return sum(hmac.compare_digest(presented, k) for k in self._keys) > 0


def http_api_key_middleware(app: Any, keys: ApiKeys, open_paths: Iterable[str]) -> Any:
    """ASGI middleware: 401 with an OpenAI-style error body unless the request carries a key."""
    if not keys.enabled:
        return app
    open_set = frozenset(open_paths)
    body = (
        b'{"error":{"message":"invalid or missing API key: send Authorization: Bearer <key>",'
        b'"type":"invalid_request_error","param":null,"code":"invalid_api_key"}}'
    )

    async def guarded(scope: dict[str, Any], receive: Callable[[], Awaitable[Any]], send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in open_set:
            await app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or ())
        if keys.allows(headers.get(b"authorization", b"")):
            await app(scope, receive, send)
            return
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    return guarded


API_KEY_REFUSAL = "invalid or missing API key (authorization: Bearer <key>)"


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for calls without `authorization: Bearer <key>` metadata (health stays open)."""

    def __init__(self, keys: ApiKeys, refusal: str = API_KEY_REFUSAL) -> None:
        self._keys = keys
        self._refusal = refusal

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method or ""
        if handler is None or method.startswith(OPEN_GRPC_PREFIXES):
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        if self._keys.allows(metadata.get("authorization")):
            return handler
        return _refusal(handler, self._refusal)


def _refusal(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    # The refusal must have the method's own shape (unary or streaming) to be served.
    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    kwargs = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse, **kwargs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse, **kwargs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse, **kwargs)
    return grpc.unary_unary_rpc_method_handler(refuse, **kwargs)
