"""JobService: submit validation (fields named), idempotency, get/list/cancel, WatchJob."""

from __future__ import annotations

import threading

import grpc

from silod.v1 import common_pb2, metadata_pb2, scheduler_pb2
from tests.metadata.metadata_harness import assert_rpc_error
from tests.scheduler_live.harness import wait_for


def test_submit_valid_and_idempotent(cluster) -> None:
    cluster.add_node("n1", gpus=4)
    request = scheduler_pb2.SubmitJobRequest(
        spec=common_pb2.JobSpec(name="a", application="cifar10", min_gpus=1, max_gpus=2, batch_size=128, epochs=1),
        client_request_id="req-1")
    first = cluster.jobs.SubmitJob(request)
    again = cluster.jobs.SubmitJob(request)
    assert first.id == again.id and first.state == common_pb2.JOB_STATE_PENDING
    assert [j.id for j in cluster.jobs.ListJobs(metadata_pb2.ListJobsRequest()).jobs] == [first.id]


def test_submit_rejects_bad_specs_naming_the_field(cluster) -> None:
    cluster.add_node("n1", gpus=4)
    bad = grpc.StatusCode.INVALID_ARGUMENT
    assert_rpc_error(lambda: cluster.submit(min_gpus=0, max_gpus=0), bad, "spec.min_gpus")
    assert_rpc_error(lambda: cluster.submit(min_gpus=-1, max_gpus=2), bad, "spec.min_gpus")
    assert_rpc_error(lambda: cluster.submit(min_gpus=3, max_gpus=2), bad, None)
    assert_rpc_error(lambda: cluster.submit(dataset="nope"), grpc.StatusCode.NOT_FOUND, "spec.dataset")
    assert_rpc_error(lambda: cluster.submit(application="no-such-app"), bad, "spec.application")
    cluster.submit(application="my-own", command=["python", "train.py"])  # own program: no profile needed
    assert_rpc_error(lambda: cluster.submit(min_gpus=5, max_gpus=5), grpc.StatusCode.FAILED_PRECONDITION,
                     "spec.min_gpus")


def test_get_list_cancel(cluster) -> None:
    job = cluster.submit("c")
    assert cluster.jobs.GetJob(metadata_pb2.GetJobRequest(job_id=job.id)).spec.name == "c"
    assert_rpc_error(lambda: cluster.jobs.GetJob(metadata_pb2.GetJobRequest(job_id="job-000000000000")),
                     grpc.StatusCode.NOT_FOUND, None)
    cancelled = cluster.jobs.CancelJob(scheduler_pb2.CancelJobRequest(job_id=job.id, reason="changed my mind"))
    assert cancelled.state == common_pb2.JOB_STATE_CANCELLED
    assert_rpc_error(lambda: cluster.jobs.CancelJob(scheduler_pb2.CancelJobRequest(job_id=job.id)),
                     grpc.StatusCode.FAILED_PRECONDITION, "job_id")
    listed = cluster.jobs.ListJobs(metadata_pb2.ListJobsRequest(states=[common_pb2.JOB_STATE_CANCELLED]))
    assert [j.id for j in listed.jobs] == [job.id]


def test_watch_job_streams_state_changes(cluster) -> None:
    cluster.add_node("n1", gpus=2)
    job = cluster.submit("w")
    updates: list[scheduler_pb2.JobUpdate] = []

    def watch() -> None:
        for update in cluster.jobs.WatchJob(scheduler_pb2.WatchJobRequest(job_id=job.id), timeout=20):
            updates.append(update)

    thread = threading.Thread(target=watch)
    thread.start()
    wait_for(lambda: updates, what="initial update")
    assert not updates[0].HasField("event")
    cluster.round()
    wait_for(lambda: cluster.state(job.id) == common_pb2.JOB_STATE_SCHEDULED, what="scheduled")
    cluster.jobs.CancelJob(scheduler_pb2.CancelJobRequest(job_id=job.id))
    thread.join(20)
    assert not thread.is_alive(), "WatchJob did not end on the terminal state"
    states = [u.event.to_state for u in updates if u.HasField("event") and u.event.type == "state"]
    assert states[-2:] == [common_pb2.JOB_STATE_SCHEDULED, common_pb2.JOB_STATE_CANCELLED]
    assert updates[-1].job.state == common_pb2.JOB_STATE_CANCELLED
