"""Errors a servicer raises to answer a call with a proper gRPC status.

Servicers never call ``context.abort`` themselves: they raise one of these and the
error-mapping interceptor turns it into the status. Any other exception becomes INTERNAL
with its traceback logged, so a bug never takes the server down.
"""

from __future__ import annotations

import grpc


class ServiceError(Exception):
    """Base class: an expected failure with a status code and a message for the caller."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, *, field: str | None = None) -> None:
        # The field goes first so that every message names what was wrong.
        self.field = field
        self.detail = message
        super().__init__(f"{field}: {message}" if field else message)

    @property
    def message(self) -> str:
        return str(self)


class InvalidArgument(ServiceError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(ServiceError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(ServiceError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(ServiceError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Aborted(ServiceError):
    """A lost race (e.g. a plan commit at a version someone else took): re-read and retry."""

    code = grpc.StatusCode.ABORTED


class Unauthenticated(ServiceError):
    code = grpc.StatusCode.UNAUTHENTICATED


class Unavailable(ServiceError):
    code = grpc.StatusCode.UNAVAILABLE
