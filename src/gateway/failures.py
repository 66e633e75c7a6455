"""Every way a request can fail, and what each looks like over HTTP, OpenAI's error body and gRPC.

One table, so the HTTP API, the gRPC API and the scheduler cannot drift apart: the
scheduler raises or emits a `GenerationError` with an HTTP status, and both APIs
render it from `FAILURES`.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from specd.proto.speculative.v1 import common_pb2


@dataclass(frozen=True)
class FailureKind:
    openai_type: str
    grpc_status: grpc.StatusCode
    # Whether a client should retry after a moment (HTTP Retry-After).
    retry: bool = False


FAILURES: dict[int, FailureKind] = {
    400: FailureKind("invalid_request_error", grpc.StatusCode.INVALID_ARGUMENT),
    401: FailureKind("authentication_error", grpc.StatusCode.UNAUTHENTICATED),
    404: FailureKind("invalid_request_error", grpc.StatusCode.NOT_FOUND),
    413: FailureKind("invalid_request_error", grpc.StatusCode.RESOURCE_EXHAUSTED),
    429: FailureKind("rate_limit_error", grpc.StatusCode.RESOURCE_EXHAUSTED, retry=True),
    # 499: the client went away; nobody reads the answer, but logs and spans name it.
    499: FailureKind("invalid_request_error", grpc.StatusCode.CANCELLED),
    500: FailureKind("server_error", grpc.StatusCode.INTERNAL),
    503: FailureKind("server_error", grpc.StatusCode.UNAVAILABLE, retry=True),
    504: FailureKind("server_error", grpc.StatusCode.DEADLINE_EXCEEDED),
}


def failure_kind(status: int) -> FailureKind:
    if status in FAILURES:
        return FAILURES[status]
    return FAILURES[500] if status >= 500 else FAILURES[400]


class GenerationError(Exception):
    """A request that cannot be served; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str, code: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code

    @property
    def kind(self) -> FailureKind:
        return failure_kind(self.status)


class InvalidParameter(GenerationError):
    """A parameter outside its range; `param` names it, as OpenAI's error body does."""

    def __init__(self, param: str, message: str, code: str = "invalid_value") -> None:
        super().__init__(400, message, code)
        self.param = param


CANCELLED = GenerationError(499, "the client closed the request", "cancelled")


def unavailable(message: str) -> GenerationError:
    return GenerationError(503, message, "service_unavailable")


def internal(message: str) -> GenerationError:
    return GenerationError(500, message, "internal_error")


def verifier_round_error(error: common_pb2.SequenceError) -> GenerationError:
    """The request-level error for a sequence the verifier refused in a round."""
    if error.code in (
        common_pb2.ERROR_CODE_NOT_FOUND,
        common_pb2.ERROR_CODE_FAILED_PRECONDITION,
        common_pb2.ERROR_CODE_UNAVAILABLE,
    ):
        # A restarted or unreachable verifier has lost the sequence: the request cannot go on, a new one can.
        return unavailable(f"the verifier lost the sequence: {error.message}")
    return internal(f"verifier refused the round: {error.message}")


def open_error(error: common_pb2.SequenceError) -> GenerationError:
    """The request-level error for a sequence the verifier would not open."""
    if error.code == common_pb2.ERROR_CODE_INVALID_ARGUMENT:
        return GenerationError(400, error.message)
    if error.code == common_pb2.ERROR_CODE_RESOURCE_EXHAUSTED:
        return unavailable(f"the verifier is full: {error.message}")
    if error.code == common_pb2.ERROR_CODE_UNAVAILABLE:
        return unavailable(f"no verifier could open the sequence: {error.message}")
    return internal(f"the verifier could not open the sequence: {error.message}")
