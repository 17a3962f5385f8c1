"""The one rule for errors from a service this one calls on behalf of its caller.

A servicer that calls another silod service (the scheduler the metadata service, the
estimator and the cache server the metadata service, ...) turns the downstream status into
its own answer with :func:`translate` (or :func:`forward` around the call):

- INVALID_ARGUMENT, NOT_FOUND, FAILED_PRECONDITION, ALREADY_EXISTS, OUT_OF_RANGE caused by a
  field the caller gave: the same code, each problem named by the *caller's* field path.
  ``fields`` says which downstream request fields came from which caller fields
  ({"job_id": "queries[3].job_id"}; :data:`PASS_THROUGH` when the caller's request went down
  unchanged). A refusal of anything else (a field this service made up) is this service's
  bug: INTERNAL, logged.
- ABORTED (a lost race): ABORTED; the caller re-reads and retries.
- UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, CANCELLED: retryable (UNAVAILABLE /
  DEADLINE_EXCEEDED / RESOURCE_EXHAUSTED): the caller may try again later.
- UNAUTHENTICATED, PERMISSION_DENIED: UNAVAILABLE (this service's credentials for the other
  are wrong: an operator's fix, not the caller's).
- Anything else (INTERNAL, UNKNOWN, UNIMPLEMENTED, DATA_LOSS): INTERNAL, logged.

A downstream error a servicer lets escape is translated by the error-mapping interceptor with
no fields, so it is never answered as UNKNOWN and stays retryable when it was.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, TypeVar

import grpc

from services.runtime.errors import (
    Aborted,
    DeadlineExceeded,
    Internal,
    ServiceError,
    Unavailable,
)
from services.runtime.structured_logging import get_logger
from silod.rpc.errors import field_violations, renamed

T = TypeVar("T")
_log = get_logger("silod.rpc")

PASS_THROUGH: Mapping[str, str] = {"": ""}  # every downstream field is the caller's, same path
CALLER_CODES = frozenset({
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.OUT_OF_RANGE,
})
RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.CANCELLED: grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
}


def translate(
    exc: grpc.RpcError, what: str, fields: Mapping[str, str] | None = None, *, default_field: str = ""
) -> ServiceError:
    """This service's answer to a downstream failure of ``what`` (e.g. "metadata GetJobModel").

    ``default_field``: the caller's field a downstream refusal without a field path is about
    (a NOT_FOUND "no such job" of a call made for the caller's job_id).
    """
    code = exc.code() if callable(getattr(exc, "code", None)) else grpc.StatusCode.UNKNOWN
    details = (exc.details() if callable(getattr(exc, "details", None)) else "") or code.name
    if code in CALLER_CODES and fields is not None:
        violations = field_violations(exc)
        if not violations and (default_field or fields is PASS_THROUGH):
            return ServiceError(details, field=default_field or None, code=code)
        moved = renamed(violations, dict(fields)) if violations else None
        if moved is not None:
            return ServiceError(violations=moved, code=code)
    if code == grpc.StatusCode.ABORTED:
        return Aborted(details)
    if code in RETRYABLE:
        if code is grpc.StatusCode.DEADLINE_EXCEEDED:
            return DeadlineExceeded(f"{what}: no answer in time ({details})")
        return ServiceError(f"{what}: {code.name}: {details}", code=RETRYABLE[code])
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return Unavailable(f"{what} refused this service's credentials ({code.name}: {details}); "
                           "the operator must fix its token")
    # A refusal of what this service sent, or a failure downstream: a bug, not the caller's doing.
    _log.error("downstream call failed", extra={"call": what, "code": code.name, "details": details[:500]})
    return Internal(f"{what} failed ({code.name}); see the server logs")


async def forward(call: Awaitable[T], what: str, fields: Mapping[str, str] | None = PASS_THROUGH,
                  *, default_field: str = "") -> T:
    """``await call``, with a downstream failure translated by :func:`translate`."""
    try:
        return await call
    except grpc.aio.AioRpcError as exc:
        raise translate(exc, what, fields, default_field=default_field) from None


async def forward_stream(
    requests: AsyncIterator[Any], open_call: Callable[[AsyncIterator[Any]], Any], what: str,
    fields: Mapping[str, str] | None = PASS_THROUGH,
) -> Any:
    """Relay a caller's request stream to a downstream client-streaming call; its answer.

    The caller's stream is read here, not inside the downstream call: if reading it fails (a
    message the runtime refuses, a caller that went away), the downstream call is cancelled and
    that error answers the caller. Handed to the downstream stub directly, the error would end
    the stub's sending task silently and leave both calls waiting forever.
    """
    queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=16)
    end = object()

    async def relay() -> AsyncIterator[Any]:
        while (item := await queue.get()) is not end:
            yield item

    async def pump() -> None:
        async for message in requests:
            await queue.put(message)
        await queue.put(end)

    call = open_call(relay())
    pumping = asyncio.ensure_future(pump())
    answering = asyncio.ensure_future(forward(call, what, fields))
    try:
        await asyncio.wait({pumping, answering}, return_when=asyncio.FIRST_COMPLETED)
        if pumping.done() and not pumping.cancelled() and pumping.exception() is not None:
            call.cancel()
            raise pumping.exception()  # type: ignore[misc]
        return await answering
    finally:
        for task in (pumping, answering):
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
