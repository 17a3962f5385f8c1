"""What the ranks report, written to the metadata store in batches.

A thousand nodes report their tasks every few seconds; written one job at a time (a GetJob to
read the state, an UpdateJobProgress, an AppendMetrics per report) those reports were most of
the metadata service's work and held every round's reads back. Here:

* the job's state comes from scheduler.live.jobs.KnownJobs, so a report reads no job;
* :class:`ProgressWriter` writes the progress and metric samples of the reports that arrive
  while a write is in flight together (services.runtime.batching), in one UpdateJobsProgress and
  one AppendMetrics call (the newest progress per job only).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import grpc

from services.runtime.batching import Coalescer
from silod.v1 import common_pb2, metadata_pb2

_log = logging.getLogger("silod.scheduler")

MAX_PER_CALL = 1000  # the metadata service's limit per UpdateJobsProgress call
MAX_SAMPLES_PER_CALL = 10_000  # and per AppendMetrics call


class ProgressWriter:
    """Reports that arrive while a write is in flight are written together in the next
    (services.runtime.batching); a caller returns once its progress is stored, as it did with a
    call of its own."""

    def __init__(self, metadata: Callable[[], Any]) -> None:
        self._metadata = metadata  # the stub, read at each write (set once the server's loop runs)
        self._calls: Coalescer[tuple[metadata_pb2.UpdateJobProgressRequest | None, list[common_pb2.MetricSample]],
                               None] = Coalescer(self._send, max_items=MAX_PER_CALL)
        self._batched = True  # False after an older metadata service answered UNIMPLEMENTED

    async def write(self, update: metadata_pb2.UpdateJobProgressRequest | None,
                    samples: Iterable[common_pb2.MetricSample]) -> None:
        samples = list(samples)
        if update is not None or samples:
            await self._calls.submit((update, samples))

    async def flush(self) -> None:
        """Until everything taken in so far is written (or its write failed and was logged)."""
        await self._calls.flush()

    async def _send(self, items: Sequence[tuple[metadata_pb2.UpdateJobProgressRequest | None,
                                                list[common_pb2.MetricSample]]]) -> list[None]:
        # The newest report of a job replaces an older one of the same batch.
        updates = {update.job_id: update for update, _ in items if update is not None}
        samples = [sample for _, batch in items for sample in batch]
        try:
            await self._write(list(updates.values()), samples)
        except grpc.aio.AioRpcError as exc:  # the ranks' next reports carry newer progress
            _log.warning("progress write failed", extra={
                "jobs": len(updates), "samples": len(samples), "code": exc.code().name, "details": exc.details()})
        return [None] * len(items)

    async def _write(self, updates: list[metadata_pb2.UpdateJobProgressRequest],
                     samples: list[common_pb2.MetricSample]) -> None:
        md = self._metadata()
        for start in range(0, len(updates), MAX_PER_CALL):
            batch = updates[start:start + MAX_PER_CALL]
            if self._batched:
                try:
                    reply = await md.UpdateJobsProgress(metadata_pb2.UpdateJobsProgressRequest(updates=batch))
                except grpc.aio.AioRpcError as exc:
                    if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                        raise
                    self._batched = False  # an older metadata service: one call per job from now on
                else:
                    for update, result in zip(batch, reply.results):
                        if result.error_code:  # e.g. a job deleted meanwhile; the others were stored
                            _log.info("progress not stored", extra={"job_id": update.job_id, "reason": result.error})
                    continue
            outcomes = await asyncio.gather(*(md.UpdateJobProgress(u) for u in batch), return_exceptions=True)
            for update, outcome in zip(batch, outcomes):
                if isinstance(outcome, grpc.aio.AioRpcError):
                    _log.info("progress not stored", extra={"job_id": update.job_id, "reason": outcome.details()})
        for start in range(0, len(samples), MAX_SAMPLES_PER_CALL):
            await md.AppendMetrics(metadata_pb2.AppendMetricsRequest(samples=samples[start:start + MAX_SAMPLES_PER_CALL]))
