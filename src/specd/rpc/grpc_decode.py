"""A request message that does not parse is the caller's error: INVALID_ARGUMENT, not UNKNOWN.

grpcio answers a deserializer's exception with UNKNOWN ("Unexpected DecodeError"),
which reads like a server fault. Protobuf refuses, among others, string fields
that are not UTF-8 (a lone surrogate's bytes): those are bad input like any other.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError


class _Undecodable:
    """Stands in for a request that failed to parse, until the handler can refuse it."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


async def _refuse(context: grpc.aio.ServicerContext, bad: _Undecodable) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the request message does not parse: {bad.reason}")


class DecodeErrorInterceptor(grpc.aio.ServerInterceptor):
    """Turns a request that fails to deserialise into INVALID_ARGUMENT, for every method's shape."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        return _wrapped(handler)


def _wrapped(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    original = handler.request_deserializer

    def deserialize(data: bytes) -> Any:
        try:
            return original(data)
        except DecodeError as exc:
            return _Undecodable(str(exc))

    kwargs = {"request_deserializer": deserialize, "response_serializer": handler.response_serializer}
    if handler.request_streaming:
        behaviour = handler.stream_stream if handler.response_streaming else handler.stream_unary

        async def checked_requests(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
            async for request in requests:
                if isinstance(request, _Undecodable):
                    await _refuse(context, request)
                yield request

        if handler.response_streaming:

            async def stream_stream(requests: Any, context: grpc.aio.ServicerContext) -> Any:
                async for reply in behaviour(checked_requests(requests, context), context):
                    yield reply

            return grpc.stream_stream_rpc_method_handler(stream_stream, **kwargs)

        async def stream_unary(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            return await behaviour(checked_requests(requests, context), context)

        return grpc.stream_unary_rpc_method_handler(stream_unary, **kwargs)

    if handler.response_streaming:
        unary_stream_behaviour = handler.unary_stream

        async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, _Undecodable):
                await _refuse(context, request)
            async for reply in unary_stream_behaviour(request, context):
                yield reply

        return grpc.unary_stream_rpc_method_handler(unary_stream, **kwargs)

    unary_unary_behaviour = handler.unary_unary

    async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, _Undecodable):
            await _refuse(context, request)
        return await unary_unary_behaviour(request, context)

    return grpc.unary_unary_rpc_method_handler(unary_unary, **kwargs)
