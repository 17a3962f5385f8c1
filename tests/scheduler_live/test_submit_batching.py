"""Submissions reach the metadata service together (CreateJobs) when they arrive together, each
with its own outcome; a metadata service without CreateJobs gets one CreateJob each."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from scheduler.live.servicers import ForwardedError, _Creations
from services.runtime.errors import ServiceError
from silod.v1 import common_pb2, metadata_pb2


def _rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


class _FakeMetadata:
    def __init__(self, batched: bool = True) -> None:
        self.batched = batched
        self.calls: list[list[str]] = []

    @staticmethod
    def _outcome(request: metadata_pb2.CreateJobRequest) -> common_pb2.Job | ForwardedError:
        if not request.spec.name:
            return ForwardedError(code=grpc.StatusCode.INVALID_ARGUMENT, details="spec.name: must not be empty")
        return common_pb2.Job(id=f"job-{request.spec.name}", spec=request.spec)

    async def CreateJobs(self, request):  # noqa: N802
        if not self.batched:
            raise _rpc_error(grpc.StatusCode.UNIMPLEMENTED, "no CreateJobs here")
        self.calls.append([r.spec.name for r in request.jobs])
        await asyncio.sleep(0.01)  # in flight: later submissions queue for the next call
        reply = metadata_pb2.CreateJobsResponse()
        for item in request.jobs:
            outcome, result = self._outcome(item), reply.results.add()
            if isinstance(outcome, ForwardedError):
                result.error_code, result.error = outcome.code.name, str(outcome)
            else:
                result.job.CopyFrom(outcome)
        return reply

    async def CreateJob(self, request):  # noqa: N802
        self.calls.append([request.spec.name])
        outcome = self._outcome(request)
        if isinstance(outcome, ForwardedError):
            raise _rpc_error(outcome.code, str(outcome))
        return outcome


class _FakeCore:
    def __init__(self, md: _FakeMetadata) -> None:
        self.md = md

    def spawn(self, call):  # type: ignore[no-untyped-def]
        return asyncio.ensure_future(call)


def _submit_all(md: _FakeMetadata, names: list[str]) -> list[common_pb2.Job | BaseException]:
    creations = _Creations(_FakeCore(md))  # type: ignore[arg-type]

    async def run():
        calls = [creations.create(metadata_pb2.CreateJobRequest(spec=common_pb2.JobSpec(name=n))) for n in names]
        return await asyncio.gather(*calls, return_exceptions=True)

    return asyncio.run(run())


def test_concurrent_submissions_share_calls_and_keep_their_own_outcome() -> None:
    md = _FakeMetadata()
    results = _submit_all(md, ["a", "b", "", "c"])
    assert md.calls == [["a", "b", "", "c"]]  # arrived together: one call
    assert [r.id for r in results if isinstance(r, common_pb2.Job)] == ["job-a", "job-b", "job-c"]
    refused = results[2]
    assert isinstance(refused, ForwardedError) and refused.code == grpc.StatusCode.INVALID_ARGUMENT
    assert str(refused) == "spec.name: must not be empty"


def test_submissions_arriving_during_a_call_go_in_the_next() -> None:
    md = _FakeMetadata()
    creations = _Creations(_FakeCore(md))  # type: ignore[arg-type]

    async def run():
        first = asyncio.ensure_future(creations.create(metadata_pb2.CreateJobRequest(spec=common_pb2.JobSpec(name="a"))))
        await asyncio.sleep(0.002)  # "a" is in flight now
        later = [creations.create(metadata_pb2.CreateJobRequest(spec=common_pb2.JobSpec(name=n))) for n in "bc"]
        return await asyncio.gather(first, *later)

    assert [j.id for j in asyncio.run(run())] == ["job-a", "job-b", "job-c"]
    assert md.calls == [["a"], ["b", "c"]]


def test_an_older_metadata_service_gets_one_create_job_each() -> None:
    md = _FakeMetadata(batched=False)
    results = _submit_all(md, ["a", "", "b"])
    assert sorted(md.calls) == [[""], ["a"], ["b"]]
    assert results[0].id == "job-a" and results[2].id == "job-b"
    assert isinstance(results[1], ServiceError) and results[1].code == grpc.StatusCode.INVALID_ARGUMENT


def test_a_failed_call_fails_its_submissions_with_its_status() -> None:
    md = _FakeMetadata()

    async def down(request):
        raise _rpc_error(grpc.StatusCode.UNAVAILABLE, "metadata down")

    md.CreateJobs = down  # type: ignore[method-assign]
    results = _submit_all(md, ["a", "b"])
    assert all(isinstance(r, ForwardedError) and r.code == grpc.StatusCode.UNAVAILABLE for r in results)
    with pytest.raises(ForwardedError):
        raise results[0]


def test_a_short_answer_fails_the_unanswered_submissions_instead_of_leaving_them_waiting() -> None:
    md = _FakeMetadata()

    async def short(request):
        reply = metadata_pb2.CreateJobsResponse()
        reply.results.add().job.id = "job-first"  # one result for two requests: a bug
        return reply

    md.CreateJobs = short  # type: ignore[method-assign]
    first, second = _submit_all(md, ["a", "b"])
    assert first.id == "job-first"
    assert isinstance(second, ForwardedError) and second.code == grpc.StatusCode.INTERNAL


def test_a_stopping_scheduler_fails_the_submission_in_flight_cancelled_and_the_queued_unavailable() -> None:
    md = _FakeMetadata()
    spawned: list[asyncio.Future] = []

    class _StoppingCore(_FakeCore):
        def spawn(self, call):  # type: ignore[no-untyped-def]
            spawned.append(asyncio.ensure_future(call))
            return spawned[-1]

    async def run():
        creations = _Creations(_StoppingCore(md))  # type: ignore[arg-type]
        first = asyncio.ensure_future(creations.create(metadata_pb2.CreateJobRequest(spec=common_pb2.JobSpec(name="a"))))
        await asyncio.sleep(0.002)  # "a" is in flight, "b" queues behind it
        second = asyncio.ensure_future(creations.create(metadata_pb2.CreateJobRequest(spec=common_pb2.JobSpec(name="b"))))
        await asyncio.sleep(0)
        spawned[0].cancel()  # the scheduler stops
        return await asyncio.gather(first, second, return_exceptions=True)

    in_flight, queued = asyncio.run(run())
    assert isinstance(in_flight, ForwardedError) and in_flight.code == grpc.StatusCode.CANCELLED
    assert isinstance(queued, ForwardedError) and queued.code == grpc.StatusCode.UNAVAILABLE
