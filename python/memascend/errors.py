"""MemAscend's errors: every failed status of the C++ SDK becomes one of these.

Each carries ``code`` (a :class:`StatusCode`, absl's numbering) and ``message`` (what
the SDK said, naming what it found and the flag that overrides where there is one).
Each also derives from the built-in exception a Python caller would expect
(``InvalidArgumentError`` is a ``ValueError``, ``NotFoundError`` a ``LookupError``...),
so ``except ValueError`` keeps working.
"""
from __future__ import annotations

import enum


class StatusCode(enum.IntEnum):
    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class Error(Exception):
    """A failed status. ``code`` is its StatusCode, ``message`` its text."""

    code: StatusCode = StatusCode.UNKNOWN

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = StatusCode(code)

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"


class CancelledError(Error):
    code = StatusCode.CANCELLED


class InvalidArgumentError(Error, ValueError):
    code = StatusCode.INVALID_ARGUMENT


class NotFoundError(Error, LookupError):
    code = StatusCode.NOT_FOUND


class AlreadyExistsError(Error):
    code = StatusCode.ALREADY_EXISTS


class PermissionDeniedError(Error, PermissionError):
    code = StatusCode.PERMISSION_DENIED


class ResourceExhaustedError(Error, RuntimeError):
    code = StatusCode.RESOURCE_EXHAUSTED


class FailedPreconditionError(Error, RuntimeError):
    code = StatusCode.FAILED_PRECONDITION


class AbortedError(Error):
    code = StatusCode.ABORTED


class OutOfRangeError(Error, IndexError):
    code = StatusCode.OUT_OF_RANGE


class UnimplementedError(Error, NotImplementedError):
    code = StatusCode.UNIMPLEMENTED


class InternalError(Error):
    code = StatusCode.INTERNAL


class UnavailableError(Error, RuntimeError):
    code = StatusCode.UNAVAILABLE


class DataLossError(Error, OSError):
    code = StatusCode.DATA_LOSS


class MemlockWarning(UserWarning):
    """RLIMIT_MEMLOCK is below the host budget chosen by default (OffloadedAdamW), or below
    a TensorStore's with host_backing="auto": the budget is ordinary unlocked memory. The
    message says what to raise for page-locked memory."""


_BY_CODE: dict[int, type[Error]] = {cls.code: cls for cls in (
    CancelledError, InvalidArgumentError, NotFoundError, AlreadyExistsError,
    PermissionDeniedError, ResourceExhaustedError, FailedPreconditionError, AbortedError,
    OutOfRangeError, UnimplementedError, InternalError, UnavailableError, DataLossError)}


def from_status(code: int, message: str) -> Error:
    """The exception for a status (called by the extension)."""
    cls = _BY_CODE.get(code, Error)
    return cls(message) if cls is not Error else Error(message, code)
