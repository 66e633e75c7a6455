"""Errors raised by engines; servicers map them to gRPC status codes."""

from __future__ import annotations

import enum


class ErrorKind(enum.Enum):
    NOT_FOUND = "not_found"
    INVALID_ARGUMENT = "invalid_argument"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    FAILED_PRECONDITION = "failed_precondition"
    INTERNAL = "internal"


class EngineError(Exception):
    """A request an engine refuses; `kind` says which status it maps to."""

    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


def not_found(message: str) -> EngineError:
    return EngineError(ErrorKind.NOT_FOUND, message)


def invalid(message: str) -> EngineError:
    return EngineError(ErrorKind.INVALID_ARGUMENT, message)


def exhausted(message: str) -> EngineError:
    return EngineError(ErrorKind.RESOURCE_EXHAUSTED, message)


def precondition(message: str) -> EngineError:
    return EngineError(ErrorKind.FAILED_PRECONDITION, message)
