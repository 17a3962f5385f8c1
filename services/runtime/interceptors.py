"""Server interceptors every silod process runs: request log + metrics, and error mapping
(with the identifier check of every request, silod/rpc/identifiers.py, before the servicer runs,
and the downstream-error rule of services/runtime/downstream.py for what a servicer lets escape).

gRPC gives an interceptor only the method name and metadata; to act around the call itself
it has to return a new method handler. :func:`wrap_handler` does that once for the four
call shapes, so each interceptor is a single ``around(call, request, context)`` coroutine
and unary and streaming calls get exactly the same treatment.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from services.runtime import metrics
from services.runtime.downstream import translate
from services.runtime.errors import Problems, ServiceError
from services.runtime.structured_logging import get_logger, request_id_var
from silod.rpc.errors import DETAILS_KEY, MAX_MESSAGE_CHARS, status_details
from silod.rpc.identifiers import message_problems

Behavior = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]
Around = Callable[[Behavior, Any, grpc.aio.ServicerContext], Awaitable[Any]]

_log = get_logger("silod.rpc")

_HANDLER_FACTORIES = {
    (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
    (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
    (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
    (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler),
}


def _as_coroutine(behavior: Callable[..., Any], response_streaming: bool) -> Behavior:
    """Turn any servicer method into ``async (request, context) -> response | None``.

    Streaming responses are sent with ``context.write`` so the caller sees a single await
    that ends when the stream does (exceptions included). Sync methods are called on the
    event loop: in silod only the generated base classes have them, and they raise at once.
    """

    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        result = behavior(request, context)
        if not response_streaming:
            return await result if inspect.isawaitable(result) else result
        if hasattr(result, "__aiter__"):
            # aclosing: a cancelled watch must run its generator's cleanup now, not at GC.
            async with contextlib.aclosing(result) as messages:
                async for message in messages:
                    await context.write(message)
        elif inspect.isawaitable(result):
            await result  # reader/writer style: the method writes itself
        elif result is not None:
            for message in result:
                await context.write(message)
        return None

    return call


def wrap_handler(handler: grpc.RpcMethodHandler, around: Around) -> grpc.RpcMethodHandler:
    """A handler of the same shape whose behavior is ``around(original, request, context)``."""
    attr, factory = _HANDLER_FACTORIES[(handler.request_streaming, handler.response_streaming)]
    inner = _as_coroutine(getattr(handler, attr), handler.response_streaming)

    async def behavior(request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await around(inner, request, context)

    return factory(
        behavior,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


def _request_id(metadata: Any) -> str:
    for key, value in metadata or ():
        if key == "x-request-id" and value:
            text = value.decode("latin-1") if isinstance(value, bytes) else str(value)
            return text[:128]  # it is echoed into logs: bound what a client can make us write
    return uuid.uuid4().hex[:16]


# Codes that mean the server is at fault; they are logged louder than a client's mistake.
_SERVER_FAULTS = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS}


class RequestObserver(grpc.aio.ServerInterceptor):
    """One log line and the Prometheus series per call; sets the request id for everything inside.

    Must be the outermost interceptor so that auth refusals are logged and counted too.
    """

    def __init__(self, process: str) -> None:
        self._process = process
        self._in_flight = metrics.IN_FLIGHT.labels(service_process=process)

    async def intercept_service(self, continuation, handler_call_details):  # type: ignore[no-untyped-def]
        handler = await continuation(handler_call_details)
        if handler is None:  # unknown method: gRPC answers UNIMPLEMENTED itself
            return None
        method = handler_call_details.method
        request_id = _request_id(handler_call_details.invocation_metadata)
        return wrap_handler(handler, functools.partial(self._observe, method, request_id))

    async def _observe(
        self, method: str, request_id: str, call: Behavior, request: Any, context: grpc.aio.ServicerContext
    ) -> Any:
        token = request_id_var.set(request_id)
        # Echoed so a client holding an INTERNAL error can find the server's traceback.
        context.set_trailing_metadata((("x-request-id", request_id),))
        self._in_flight.inc()
        start = time.perf_counter()
        code = grpc.StatusCode.UNKNOWN
        try:
            result = await call(request, context)
            code = context.code() or grpc.StatusCode.OK
            return result
        except grpc.aio.BaseError:  # context.abort: the status is already on the context
            code = context.code() or grpc.StatusCode.UNKNOWN
            raise
        except asyncio.CancelledError:  # client went away, deadline passed, or server stop
            code = grpc.StatusCode.CANCELLED
            raise
        finally:
            elapsed = time.perf_counter() - start
            self._in_flight.dec()
            metrics.REQUESTS.labels(service_process=self._process, method=method, code=code.name).inc()
            metrics.DURATION.labels(service_process=self._process, method=method).observe(elapsed)
            if method.startswith("/grpc.health.v1.Health/"):
                level = "debug"  # probes every few seconds would drown the useful lines
            elif code in _SERVER_FAULTS:
                level = "warning"
            else:
                level = "info"
            getattr(_log, level)(
                "rpc finished",
                extra={
                    "method": method,
                    "code": code.name,
                    "duration_ms": round(elapsed * 1000, 3),
                    "peer": context.peer(),
                    "request_id": request_id,
                },
            )
            request_id_var.reset(token)


class ErrorMapper(grpc.aio.ServerInterceptor):
    """Turns exceptions from servicers into statuses, so servicers just raise."""

    async def intercept_service(self, continuation, handler_call_details):  # type: ignore[no-untyped-def]
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        return wrap_handler(handler, functools.partial(_map_errors, handler_call_details.method))


async def _map_errors(method: str, call: Behavior, request: Any, context: grpc.aio.ServicerContext) -> Any:
    stream = None
    try:
        if hasattr(request, "DESCRIPTOR"):
            check_identifiers(request)
        elif hasattr(request, "__aiter__"):  # a client stream: each message as it arrives
            stream, request = request, _checked_stream(request)
        return await call(request, context)
    except grpc.aio.AbortError:
        raise  # an abort already sent its status; re-aborting would be a UsageError
    except grpc.aio.AioRpcError as exc:  # a downstream call's failure the servicer let through
        await _abort(context, translate(exc, f"a call made for {method}"), stream)
    except ServiceError as exc:
        await _abort(context, exc, stream)
    except NotImplementedError:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{method} is not implemented")
    except grpc.aio.BaseError:
        raise
    except Exception:
        request_id = request_id_var.get()
        _log.exception("unhandled exception in servicer", extra={"method": method})
        # The traceback stays in our log: it may hold data the caller must not see.
        await context.abort(grpc.StatusCode.INTERNAL, f"internal error (see server log, request id {request_id})")


# A client stream refused before its end is read to its end (within these bounds) before the
# answer goes out: a grpc.aio client still writing when the status arrives reports
# "INTERNAL: Internal error from Core" instead of it (a race in grpcio's aio client).
DRAIN_MESSAGES = 100_000
DRAIN_S = 5.0


async def _drain(stream: Any) -> None:
    async def read() -> None:
        count = 0
        async for _ in stream:
            count += 1
            if count >= DRAIN_MESSAGES:
                return

    with contextlib.suppress(Exception, asyncio.TimeoutError):
        await asyncio.wait_for(read(), DRAIN_S)


async def _abort(context: grpc.aio.ServicerContext, exc: ServiceError, stream: Any = None) -> None:
    """Abort with the error's code and message, its violations in the status details."""
    if stream is not None:
        await _drain(stream)
    message = str(exc)
    if len(message) > MAX_MESSAGE_CHARS:  # trailers over 8 KiB are refused by the client
        message = message[: MAX_MESSAGE_CHARS - 1] + "…"
    trailing = tuple(context.trailing_metadata() or ())
    if any(v.field for v in exc.violations):
        trailing += ((DETAILS_KEY, status_details(exc.code, message, exc.violations)),)
    await context.abort(exc.code, message, trailing_metadata=trailing)


def check_identifiers(message: Any) -> None:
    """Refuse a request whose identifier fields (job ids, dataset and node names, ...) break
    silod/rpc/identifiers.py's rules, naming each field, before any servicer sees it."""
    problems = Problems()
    for field, description in message_problems(message):
        problems.add(field, description)
    problems.raise_if_any()


async def _checked_stream(requests: Any) -> Any:
    async for message in requests:
        check_identifiers(message)
        yield message
