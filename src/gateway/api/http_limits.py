"""Limits on what one HTTP client can make the gateway hold: body size and read time.

uvicorn bounds neither. A client with a valid key could send a 100 MB body (the
gateway buffered it whole), or keep a connection open forever by sending its
headers or body a byte at a time. Here:

- the body is read before the app sees the request, counted as it arrives: past
  the limit the client gets 413 at once (from Content-Length, before any of it is
  read), so memory per request stays bounded by the limit, not by the client;
- headers, and then the body, must each arrive within the read timeout, or the
  connection is closed (408 when a response can still be sent).

The connection limit is uvicorn's own `limit_concurrency` (503 beyond it).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from gateway.api.body_screen import BodyScreen
from specd.heap import trim_heap

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


def error_body(message: str, code: str, param: str | None = None) -> bytes:
    return json.dumps(
        {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}}
    ).encode()


async def _refuse(send: Send, status: int, message: str, code: str, param: str | None = None) -> None:
    body = error_body(message, code, param)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                # The rest of the body is never read: the connection cannot be reused.
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class _Refused(Exception):
    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


# Bodies at least this large leave enough freed memory behind to be worth a heap trim.
TRIM_AFTER_BYTES = 1 << 20


def body_limits(app: App, max_body_bytes: int, read_timeout_s: float, screen: BodyScreen | None = None) -> App:
    """ASGI middleware: read the whole body within the limits, then hand it to `app`.

    Reading it here (it is at most `max_body_bytes`) keeps the refusal out of the
    app: once the app has started on a request it cannot be told cleanly that
    the rest of the body will never come. A large body goes through `screen` first
    (gateway.api.body_screen), so one the app would refuse is refused without the
    event loop parsing it.
    """

    async def limited(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        try:
            declared = _content_length(scope)
            if declared is not None and declared > max_body_bytes:
                raise _Refused(413, _too_large(max_body_bytes), "request_too_large")
            body = await asyncio.wait_for(_read_body(receive, max_body_bytes), read_timeout_s)
        except _Refused as refused:
            await _refuse(send, refused.status, refused.message, refused.code)
            return
        except asyncio.TimeoutError:
            await _refuse(send, 408, f"the request body did not arrive within {read_timeout_s:g} s", "request_timeout")
            return
        if body is None:  # the client went away mid-body
            return
        refusal = None if screen is None else await screen.refusal(scope.get("path", ""), body)
        if refusal is not None:
            await _refuse(send, 400, *refusal)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            # After the body, the app only waits for the disconnect.
            return await receive()

        await app(scope, replay, send)
        if len(body) >= TRIM_AFTER_BYTES:
            # Its parse and its tokens are freed now, but glibc keeps the pages: hand them back.
            del body
            await asyncio.get_running_loop().run_in_executor(None, trim_heap)

    return limited


def _too_large(limit: int) -> str:
    return f"the request body exceeds the limit of {limit} bytes (--http-max-body-bytes)"


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers") or ():
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                raise _Refused(400, "Content-Length is not a number", "invalid_request") from None
    return None


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _Refused(413, _too_large(limit), "request_too_large")
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


def read_deadline_protocol(timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing connections whose request headers take over `timeout_s`.

    The clock starts when the connection opens and again after each response (for
    the next request on a kept-alive connection); it stops once the headers are
    in, where `body_limits` takes over for the body.
    """

    class ReadDeadlineH11Protocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            if not self.transport.is_closing():
                self._deadline = self.loop.call_later(timeout_s, self._expired)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self) -> None:
            self._deadline = None
            waiting_for_headers = self.cycle is None or self.cycle.response_complete
            if waiting_for_headers and not self.transport.is_closing():
                self.transport.close()

    return ReadDeadlineH11Protocol
