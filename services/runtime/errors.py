"""Errors a servicer raises to answer a call with a proper gRPC status.

Servicers never call ``context.abort`` themselves: they raise one of these and the
error-mapping interceptor turns it into the status. Any other exception becomes INTERNAL
with its traceback logged, so a bug never takes the server down.

An error may carry several problems (:class:`Problems` collects them): each is a
(field, description) violation, listed in the status details as a ``google.rpc.BadRequest``
and joined into the status message (silod/rpc/errors.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import grpc

from silod.rpc.errors import MAX_VIOLATIONS, FieldViolation, join_paths, summary


class ServiceError(Exception):
    """Base class: an expected failure with a status code and a message for the caller."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(
        self,
        message: str = "",
        *,
        field: str | None = None,
        violations: Sequence[FieldViolation] = (),
        omitted: int = 0,
        code: grpc.StatusCode | None = None,
    ) -> None:
        if code is not None:
            self.code = code
        self.violations = list(violations) if violations else [FieldViolation(field or "", message)]
        self.omitted = omitted
        # The field goes first so that every message names what was wrong.
        self.field = self.violations[0].field or None
        self.detail = self.violations[0].description
        super().__init__(summary(self.violations, omitted))

    @property
    def message(self) -> str:
        return str(self)

    def within(self, prefix: str) -> ServiceError:
        """The same error with every field path under ``prefix`` (e.g. "transitions[3]")."""
        moved = [FieldViolation(join_paths(prefix, v.field), v.description) for v in self.violations]
        return type(self)(violations=moved, omitted=self.omitted, code=self.code)


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


class PermissionDenied(ServiceError):
    code = grpc.StatusCode.PERMISSION_DENIED


class Unavailable(ServiceError):
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(ServiceError):
    """A service this call depends on did not answer in time: retryable, like UNAVAILABLE."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Internal(ServiceError):
    """A bug (here or in a service this call depends on) the caller can do nothing about."""

    code = grpc.StatusCode.INTERNAL


class Problems:
    """Collects every problem of a request, to refuse it once with all of them.

    ``check(fn, *args)`` runs one check and records the InvalidArgument it raises (each
    check raises at its first problem; the request is refused with every check's);
    ``add(field, description)`` records one directly; ``raise_if_any()`` raises a single
    InvalidArgument listing them (at most MAX_VIOLATIONS; the message counts the rest).
    """

    def __init__(self, prefix: str = "") -> None:
        self.prefix = prefix
        self.violations: list[FieldViolation] = []
        self.omitted = 0

    def __bool__(self) -> bool:
        return bool(self.violations or self.omitted)

    def add(self, field: str, description: str) -> None:
        if len(self.violations) >= MAX_VIOLATIONS:
            self.omitted += 1
        else:
            self.violations.append(FieldViolation(join_paths(self.prefix, field), description))

    def extend(self, error: ServiceError) -> None:
        for violation in error.violations:
            self.add(violation.field, violation.description)
        self.omitted += error.omitted

    def check(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> bool:
        """Run ``fn(*args, **kwargs)``; False if it raised InvalidArgument (recorded)."""
        try:
            fn(*args, **kwargs)
        except InvalidArgument as exc:
            self.extend(exc)
            return False
        return True

    def raise_if_any(self) -> None:
        if self:
            raise InvalidArgument(violations=self.violations, omitted=self.omitted)
