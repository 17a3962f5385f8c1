"""The nodes' acks and task reports, passed to the leading scheduler in batches (PlanFeedService.Relay):
those that arrive while a call is in flight make the next one (services.runtime.batching), so a
thousand nodes' reports a second cost the scheduler a few calls, not a thousand.

A report waits for its batch and is answered with the exits the scheduler acknowledged; a batch
the scheduler does not take (none leads, or it is unreachable) fails its reports UNAVAILABLE, and
the nodes send them again. An ack is answered at once and relayed after: a worker agent applies
its next plan only once its ack of the last is answered, so a plan must not wait for a round trip
to the scheduler (busy with a round, or being replaced). An ack the scheduler does not take is
logged; the releases it carried are proven again by the node's next task report.

Acks and reports are relayed in calls of their own: a batch of reports waits for the scheduler's
writes of what they move (the store's turn, seconds under load), and the releases an ack carries
should not wait behind them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any, Union

import grpc

from scheduler.allocation import metrics
from services.runtime import downstream
from services.runtime.batching import Coalescer
from services.runtime.errors import ServiceError, Unavailable
from silod.v1 import allocation_pb2

_log = logging.getLogger("silod.allocation")

MAX_RELAYED = 1000  # acks and reports per Relay call
RELAY_TIMEOUT_S = 10.0  # as long as a node waits for its ReportTasks

Item = Union[allocation_pb2.AckPlanRequest, allocation_pb2.ReportTasksRequest]


class Relay:
    def __init__(self, stub: Callable[[], Any], epoch: Callable[[], int], server: str) -> None:
        self._stub = stub  # the leading scheduler's PlanFeedService stub, read at each call
        self._epoch = epoch
        self._server = server
        self._ack_calls: Coalescer[Item, list[str]] = Coalescer(
            self._send, MAX_RELAYED, stopped=lambda in_flight: Unavailable("the allocation server is stopping"))
        self._report_calls: Coalescer[Item, list[str]] = Coalescer(
            self._send, MAX_RELAYED, stopped=lambda in_flight: Unavailable("the allocation server is stopping"))
        self._acks: set[asyncio.Future[None]] = set()

    def ack(self, request: allocation_pb2.AckPlanRequest) -> None:
        """Relay ``request`` in the next batch; the caller does not wait for it."""
        async def relay() -> None:
            try:
                await self._ack_calls.submit(request)
            except ServiceError as exc:
                _log.warning("ack not relayed", extra={"node": request.node, "version": request.version,
                                                       "released_jobs": list(request.released_jobs),
                                                       "code": exc.code.name, "details": str(exc)})

        task = asyncio.ensure_future(relay())
        self._acks.add(task)
        task.add_done_callback(self._acks.discard)

    async def report(self, request: allocation_pb2.ReportTasksRequest) -> list[str]:
        return await self._report_calls.submit(request)

    async def flush(self) -> None:
        await asyncio.gather(*list(self._acks), return_exceptions=True)
        await self._ack_calls.flush()
        await self._report_calls.flush()

    async def _send(self, items: Sequence[Item]) -> list[list[str] | BaseException]:
        acks = [i for i in items if isinstance(i, allocation_pb2.AckPlanRequest)]
        reports = [i for i in items if isinstance(i, allocation_pb2.ReportTasksRequest)]
        metrics.RELAY_BATCH.observe(len(items))
        try:
            reply = await self._stub().Relay(allocation_pb2.RelayRequest(
                epoch=self._epoch(), acks=acks, reports=reports, server=self._server), timeout=RELAY_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            metrics.RELAY_FAILURES.inc()
            error = downstream.translate(exc, "scheduler Relay", None)
            if exc.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAVAILABLE):
                error = Unavailable(f"no leading scheduler took this in ({exc.code().name}: {exc.details()}); "
                                    "send it again")
            return [error] * len(items)
        metrics.RELAYED.labels("ack").inc(len(acks))
        metrics.RELAYED.labels("report").inc(len(reports))
        outcomes = iter(reply.reports)
        results: list[list[str] | BaseException] = []
        for item in items:
            if isinstance(item, allocation_pb2.AckPlanRequest):
                results.append([])
                continue
            outcome = next(outcomes, None)
            if outcome is None:
                results.append(Unavailable("the scheduler answered fewer reports than it was sent"))
            elif outcome.error_code:
                code = getattr(grpc.StatusCode, outcome.error_code, grpc.StatusCode.UNKNOWN)
                results.append(ServiceError(outcome.error, code=code))
            else:
                results.append(list(outcome.acknowledged_exits))
        return results
