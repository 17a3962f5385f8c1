"""The scheduler's batched progress writes (scheduler.live.progress): reports that arrive while a
write is in flight share the next call, each caller returns once its progress is stored, an older
metadata service gets one call per job."""

from __future__ import annotations

import asyncio

import grpc

from scheduler.live.progress import ProgressWriter
from silod.v1 import common_pb2, metadata_pb2


class _Unimplemented(grpc.aio.AioRpcError):
    def __init__(self) -> None:
        super().__init__(grpc.StatusCode.UNIMPLEMENTED, grpc.aio.Metadata(), grpc.aio.Metadata(), "no such method")


class FakeMetadata:
    def __init__(self, batched: bool = True) -> None:
        self.batched = batched
        self.batches: list[list[str]] = []
        self.singles: list[str] = []
        self.samples: list[int] = []
        self.stored: dict[str, int] = {}
        self.gate = asyncio.Event()

    async def UpdateJobsProgress(self, request):  # noqa: N802
        if not self.batched:
            raise _Unimplemented()
        await self.gate.wait()  # the first call stays in flight until the test lets it go
        self.batches.append([u.job_id for u in request.updates])
        self.stored.update({u.job_id: u.progress.samples_done for u in request.updates})
        return metadata_pb2.UpdateJobsProgressResponse(
            results=[metadata_pb2.UpdateJobsProgressResult() for _ in request.updates])

    async def UpdateJobProgress(self, request):  # noqa: N802
        self.singles.append(request.job_id)
        self.stored[request.job_id] = request.progress.samples_done
        return common_pb2.Job(id=request.job_id)

    async def AppendMetrics(self, request):  # noqa: N802
        self.samples.append(len(request.samples))
        return metadata_pb2.AppendMetricsResponse(appended=len(request.samples))


def _update(job: str, samples: int) -> metadata_pb2.UpdateJobProgressRequest:
    return metadata_pb2.UpdateJobProgressRequest(job_id=job, progress=common_pb2.JobProgress(samples_done=samples))


def _sample(job: str) -> common_pb2.MetricSample:
    return common_pb2.MetricSample(job_id=job, name="step_time_s", value=0.1)


def test_reports_arriving_during_a_write_share_the_next_call_and_the_newest_progress_wins() -> None:
    async def scenario() -> None:
        md = FakeMetadata()
        writer = ProgressWriter(lambda: md)
        first = asyncio.ensure_future(writer.write(_update("job-a", 1), [_sample("job-a")]))
        await asyncio.sleep(0.01)  # the first write is in flight (held by the gate)
        later = [asyncio.ensure_future(writer.write(_update(job, n), [_sample(job)]))
                 for job, n in (("job-b", 2), ("job-a", 3), ("job-c", 4))]
        await asyncio.sleep(0.01)
        assert not first.done() and not any(t.done() for t in later)  # nobody returns before it is stored
        md.gate.set()
        await asyncio.gather(first, *later)
        assert md.batches == [["job-a"], ["job-b", "job-a", "job-c"]]
        assert md.stored == {"job-a": 3, "job-b": 2, "job-c": 4}
        assert md.samples == [1, 3]

    asyncio.run(scenario())


def test_an_older_metadata_service_gets_one_call_per_job() -> None:
    async def scenario() -> None:
        md = FakeMetadata(batched=False)
        writer = ProgressWriter(lambda: md)
        await asyncio.gather(writer.write(_update("job-a", 1), []), writer.write(_update("job-b", 2), []))
        await writer.write(_update("job-c", 3), [])
        assert sorted(md.singles) == ["job-a", "job-b", "job-c"] and md.stored["job-c"] == 3
        await writer.write(None, [])  # nothing to write: returns at once

    asyncio.run(scenario())
