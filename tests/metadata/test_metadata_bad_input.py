"""Bad requests get the right status and a message that starts with the offending field.

One server per database serves the whole table: every case here is refused, so none of them
changes what the next case sees.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
import pytest
from google.protobuf import timestamp_pb2

from silod.v1 import common_pb2, metadata_pb2 as m, plan_pb2
from tests.metadata.metadata_harness import InProcessServer, assert_rpc_error
from tests.metadata.metadata_samples import (
    create_job,
    dataset_spec,
    inference_spec,
    move,
    node_spec,
    objects,
    placement,
    plan,
    registration,
    training_spec,
)

INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
EXISTS = grpc.StatusCode.ALREADY_EXISTS
ABORTED = grpc.StatusCode.ABORTED
UNKNOWN_JOB = "job-000000000000"


@dataclass
class World:
    """What the cases refer to: created once per database."""

    stub: object
    pending: str  # a PENDING job
    running: str  # a RUNNING job
    done: str  # a SUCCEEDED job
    objects_token: str  # a page token of ListDatasetObjects for dataset "known"
    plans_token: str  # a page token of ListPlans


@pytest.fixture(scope="module")
def world(module_server: InProcessServer) -> World:
    stub = module_server.stub
    pending = create_job(stub)
    running = move(stub, create_job(stub), 2, 3)
    done = move(stub, create_job(stub), 2, 3, 5)
    stub.RegisterDataset(registration(dataset_spec("known"), objects(3)))
    stub.UpsertNode(m.UpsertNodeRequest(spec=node_spec("n1")))
    stub.Heartbeat(m.HeartbeatRequest(node="n1", applied_plan_version=5))
    stub.CommitPlan(m.CommitPlanRequest(plan=plan(1)))
    stub.CommitPlan(m.CommitPlanRequest(plan=plan(2)))
    return World(
        stub=stub,
        pending=pending.id,
        running=running.id,
        done=done.id,
        objects_token=stub.ListDatasetObjects(m.ListDatasetObjectsRequest(name="known", page_size=1)).next_page_token,
        plans_token=stub.ListPlans(m.ListPlansRequest(page_size=1)).next_page_token,
    )


def bad_stamp(seconds: int = 0, nanos: int = 0) -> timestamp_pb2.Timestamp:
    return timestamp_pb2.Timestamp(seconds=seconds, nanos=nanos)


def obj(key: str = "a", size: int = 1, etag: str = "e") -> common_pb2.DatasetObject:
    return common_pb2.DatasetObject(key=key, size_bytes=size, etag=etag)


def register(w, spec=None, manifest=(), replace=False, extra=()):
    first = m.RegisterDatasetRequest(spec=spec, objects=list(manifest), replace=replace)
    return w.stub.RegisterDataset(iter([first, *extra]))


def create(w, spec, request_id=""):
    return w.stub.CreateJob(m.CreateJobRequest(spec=spec, client_request_id=request_id))


def transition(w, job_id, expected, new, message=""):
    return w.stub.TransitionJob(m.TransitionJobRequest(job_id=job_id, expected_state=expected, new_state=new, message=message))


def commit(w, *jobs, **fields):
    version = fields.pop("version", 3)
    return w.stub.CommitPlan(m.CommitPlanRequest(plan=plan(version, *jobs, **fields)))


def alloc(job_id, *placements, **fields):
    return plan_pb2.JobAllocation(job_id=job_id, placements=list(placements), **fields)


def sample(w, **fields):
    values = {"job_id": w.pending, "name": "step_time_s", "value": 1.0, **fields}
    return common_pb2.MetricSample(**values)


CASES = [
    # -- datasets ------------------------------------------------------------------------
    ("register without spec", lambda w: register(w, None, [obj()]), INVALID, "spec"),
    ("register empty stream", lambda w: w.stub.RegisterDataset(iter([])), INVALID, "spec"),
    ("dataset name empty", lambda w: register(w, dataset_spec("")), INVALID, "spec.name"),
    ("dataset name with slash", lambda w: register(w, dataset_spec("a/b")), INVALID, "spec.name"),
    ("dataset name too long", lambda w: register(w, dataset_spec("x" * 129)), INVALID, "spec.name"),
    ("dataset uri http", lambda w: register(w, dataset_spec("d", uri="http://x/y")), INVALID, "spec.uri"),
    ("dataset uri without scheme", lambda w: register(w, dataset_spec("d", uri="/data/x")), INVALID, "spec.uri"),
    ("object key empty", lambda w: register(w, dataset_spec("d"), [obj("")]), INVALID, "objects[0].key"),
    ("object key dotdot", lambda w: register(w, dataset_spec("d"), [obj("../etc/passwd")]), INVALID, "objects[0].key"),
    ("object key inner dotdot", lambda w: register(w, dataset_spec("d"), [obj("a"), obj("a/../../b")]), INVALID, "objects[1].key"),
    ("object key absolute", lambda w: register(w, dataset_spec("d"), [obj("/abs")]), INVALID, "objects[0].key"),
    ("object key backslash absolute", lambda w: register(w, dataset_spec("d"), [obj("\\\\srv\\x")]), INVALID, "objects[0].key"),
    ("object key drive letter", lambda w: register(w, dataset_spec("d"), [obj("C:\\x")]), INVALID, "objects[0].key"),
    ("object key NUL", lambda w: register(w, dataset_spec("d"), [obj("a\x00b")]), INVALID, "objects[0].key"),
    ("object key too long", lambda w: register(w, dataset_spec("d"), [obj("k" * 1025)]), INVALID, "objects[0].key"),
    ("object key too many bytes", lambda w: register(w, dataset_spec("d"), [obj("é" * 513)]), INVALID, "objects[0].key"),
    ("object key duplicate in a chunk", lambda w: register(w, dataset_spec("d"), [obj("a"), obj("a")]), INVALID, "objects[1].key"),
    (
        "object key duplicate across chunks",
        lambda w: register(w, dataset_spec("d"), [obj("a"), obj("b")], extra=[m.RegisterDatasetRequest(objects=[obj("c"), obj("a")])]),
        INVALID,
        "objects[3].key",
    ),
    ("object size negative", lambda w: register(w, dataset_spec("d"), [obj(size=-1)]), INVALID, "objects[0].size_bytes"),
    ("object size absurd", lambda w: register(w, dataset_spec("d"), [obj(size=2**50 + 1)]), INVALID, "objects[0].size_bytes"),
    ("object etag empty", lambda w: register(w, dataset_spec("d"), [obj(etag="")]), INVALID, "objects[0].etag"),
    ("dataset description NUL", lambda w: register(w, dataset_spec("d", description="a\x00")), INVALID, "spec.description"),
    ("object etag NUL", lambda w: register(w, dataset_spec("d"), [obj(etag="e\x00")]), INVALID, "objects[0].etag"),
    ("dataset exists", lambda w: register(w, dataset_spec("known"), [obj()]), EXISTS, "spec.name"),
    ("get dataset unknown", lambda w: w.stub.GetDataset(m.GetDatasetRequest(name="nope")), NOT_FOUND, "name"),
    ("get dataset empty name", lambda w: w.stub.GetDataset(m.GetDatasetRequest(name="")), INVALID, "name"),
    ("list datasets page_size negative", lambda w: w.stub.ListDatasets(m.ListDatasetsRequest(page_size=-1)), INVALID, "page_size"),
    ("list datasets page_size too big", lambda w: w.stub.ListDatasets(m.ListDatasetsRequest(page_size=1001)), INVALID, "page_size"),
    ("list datasets garbage token", lambda w: w.stub.ListDatasets(m.ListDatasetsRequest(page_token="%%%")), INVALID, "page_token"),
    ("list datasets foreign token", lambda w: w.stub.ListDatasets(m.ListDatasetsRequest(page_token=w.plans_token)), INVALID, "page_token"),
    ("list objects unknown", lambda w: w.stub.ListDatasetObjects(m.ListDatasetObjectsRequest(name="nope")), NOT_FOUND, "name"),
    (
        "list objects page_size too big",
        lambda w: w.stub.ListDatasetObjects(m.ListDatasetObjectsRequest(name="known", page_size=10001)),
        INVALID,
        "page_size",
    ),
    (
        "list objects truncated token",
        lambda w: w.stub.ListDatasetObjects(m.ListDatasetObjectsRequest(name="known", page_token=w.objects_token[:-3])),
        INVALID,
        "page_token",
    ),
    # -- jobs ----------------------------------------------------------------------------
    ("job name empty", lambda w: create(w, training_spec(name="")), INVALID, "spec.name"),
    ("job name blank", lambda w: create(w, training_spec(name="   ")), INVALID, "spec.name"),
    ("job name too long", lambda w: create(w, training_spec(name="n" * 129)), INVALID, "spec.name"),
    ("job without spec", lambda w: w.stub.CreateJob(m.CreateJobRequest()), INVALID, "spec.name"),
    ("min_gpus zero", lambda w: create(w, training_spec(min_gpus=0)), INVALID, "spec.min_gpus"),
    ("min_gpus negative", lambda w: create(w, training_spec(min_gpus=-4)), INVALID, "spec.min_gpus"),
    ("max_gpus below min", lambda w: create(w, training_spec(min_gpus=4, max_gpus=2)), INVALID, "spec.max_gpus"),
    ("max_gpus absurd", lambda w: create(w, training_spec(max_gpus=4097)), INVALID, "spec.max_gpus"),
    ("batch_size zero", lambda w: create(w, training_spec(batch_size=0)), INVALID, "spec.batch_size"),
    ("batch_size negative", lambda w: create(w, training_spec(batch_size=-1)), INVALID, "spec.batch_size"),
    ("max_batch_size below batch", lambda w: create(w, training_spec(batch_size=64, max_batch_size=32)), INVALID, "spec.max_batch_size"),
    ("no budget", lambda w: create(w, training_spec(epochs=None)), INVALID, "spec.budget"),
    ("epochs zero", lambda w: create(w, training_spec(epochs=0)), INVALID, "spec.epochs"),
    ("sample_budget negative", lambda w: create(w, training_spec(sample_budget=-5)), INVALID, "spec.sample_budget"),
    ("job kind unknown", lambda w: create(w, training_spec(kind=99)), INVALID, "spec.kind"),
    ("tenant with spaces", lambda w: create(w, training_spec(tenant="a b")), INVALID, "spec.tenant"),
    ("env name invalid", lambda w: create(w, training_spec(env={"1X": "y"})), INVALID, "spec.env"),
    ("emulated step negative", lambda w: create(w, training_spec(emulated_step_compute_s=-1)), INVALID, "spec.emulated_step_compute_s"),
    ("emulated step infinite", lambda w: create(w, training_spec(emulated_step_compute_s=float("inf"))), INVALID, "spec.emulated_step_compute_s"),
    ("training with duration", lambda w: create(w, training_spec(inference_duration_s=5)), INVALID, "spec.inference_duration_s"),
    ("cpus per rank negative", lambda w: create(w, training_spec(cpus_per_rank=-0.5)), INVALID, "spec.cpus_per_rank"),
    ("cpus per rank absurd", lambda w: create(w, training_spec(cpus_per_rank=4096.5)), INVALID, "spec.cpus_per_rank"),
    ("cpus per rank NaN", lambda w: create(w, training_spec(cpus_per_rank=float("nan"))), INVALID, "spec.cpus_per_rank"),
    ("cpus per rank infinite", lambda w: create(w, training_spec(cpus_per_rank=float("inf"))), INVALID, "spec.cpus_per_rank"),
    ("memory per rank negative", lambda w: create(w, training_spec(memory_bytes_per_rank=-1)), INVALID, "spec.memory_bytes_per_rank"),
    ("memory per rank absurd", lambda w: create(w, training_spec(memory_bytes_per_rank=2**50 + 1)), INVALID, "spec.memory_bytes_per_rank"),
    ("image upper case", lambda w: create(w, training_spec(image="Ubuntu:22.04")), INVALID, "spec.image"),
    ("image empty tag", lambda w: create(w, training_spec(image="ubuntu:")), INVALID, "spec.image"),
    ("image with scheme", lambda w: create(w, training_spec(image="https://registry.example/team/train")), INVALID, "spec.image"),
    ("image short digest", lambda w: create(w, training_spec(image="ubuntu@sha256:abc")), INVALID, "spec.image"),
    ("image tag too long", lambda w: create(w, training_spec(image="ubuntu:" + "t" * 129)), INVALID, "spec.image"),
    ("image too long", lambda w: create(w, training_spec(image="a/" * 127 + "bc")), INVALID, "spec.image"),
    ("inference without duration", lambda w: create(w, inference_spec(inference_duration_s=0)), INVALID, "spec.inference_duration_s"),
    ("inference duration NaN", lambda w: create(w, inference_spec(inference_duration_s=float("nan"))), INVALID, "spec.inference_duration_s"),
    ("inference two GPUs", lambda w: create(w, inference_spec(min_gpus=2, max_gpus=2)), INVALID, "spec.min_gpus"),
    ("inference with epochs", lambda w: create(w, inference_spec(epochs=1)), INVALID, "spec.epochs"),
    ("client_request_id too long", lambda w: create(w, training_spec(), "r" * 129), INVALID, "client_request_id"),
    ("job spec with NUL", lambda w: create(w, training_spec(command=["ok", "b\x00d"])), INVALID, "spec.command[1]"),
    ("get job empty id", lambda w: w.stub.GetJob(m.GetJobRequest(job_id="")), INVALID, "job_id"),
    ("get job unknown", lambda w: w.stub.GetJob(m.GetJobRequest(job_id=UNKNOWN_JOB)), NOT_FOUND, "job_id"),
    ("list jobs state unknown", lambda w: w.stub.ListJobs(m.ListJobsRequest(states=[1, 42])), INVALID, "states[1]"),
    ("list jobs kind unknown", lambda w: w.stub.ListJobs(m.ListJobsRequest(kind=9)), INVALID, "kind"),
    ("list jobs page_size too big", lambda w: w.stub.ListJobs(m.ListJobsRequest(page_size=1001)), INVALID, "page_size"),
    ("list jobs garbage token", lambda w: w.stub.ListJobs(m.ListJobsRequest(page_token="not a token")), INVALID, "page_token"),
    ("list jobs foreign token", lambda w: w.stub.ListJobs(m.ListJobsRequest(page_token=w.objects_token)), INVALID, "page_token"),
    ("transition unknown job", lambda w: transition(w, UNKNOWN_JOB, 1, 2), NOT_FOUND, "job_id"),
    ("transition illegal", lambda w: transition(w, w.pending, 1, 3), PRECONDITION, "new_state"),
    ("transition stale expected", lambda w: transition(w, w.pending, 2, 3), PRECONDITION, "expected_state"),
    ("transition from terminal", lambda w: transition(w, w.done, 5, 1), PRECONDITION, "new_state"),
    ("transition to same state", lambda w: transition(w, w.running, 3, 3), PRECONDITION, "new_state"),
    ("transition expected unspecified", lambda w: transition(w, w.pending, 0, 2), INVALID, "expected_state"),
    ("transition new_state unknown", lambda w: transition(w, w.pending, 1, 99), INVALID, "new_state"),
    ("transition expected negative", lambda w: transition(w, w.pending, -1, 2), INVALID, "expected_state"),
    ("transition message too long", lambda w: transition(w, w.pending, 1, 2, "x" * 4097), INVALID, "message"),
    (
        "progress fraction above one",
        lambda w: w.stub.UpdateJobProgress(m.UpdateJobProgressRequest(job_id=w.pending, progress=common_pb2.JobProgress(fraction_done=1.5))),
        INVALID,
        "progress.fraction_done",
    ),
    (
        "progress hit ratio NaN",
        lambda w: w.stub.UpdateJobProgress(
            m.UpdateJobProgressRequest(job_id=w.pending, progress=common_pb2.JobProgress(cache_hit_ratio=float("nan")))
        ),
        INVALID,
        "progress.cache_hit_ratio",
    ),
    (
        "progress samples negative",
        lambda w: w.stub.UpdateJobProgress(m.UpdateJobProgressRequest(job_id=w.pending, progress=common_pb2.JobProgress(samples_done=-1))),
        INVALID,
        "progress.samples_done",
    ),
    (
        "allocated gpus negative",
        lambda w: w.stub.UpdateJobProgress(m.UpdateJobProgressRequest(job_id=w.pending, allocated=common_pb2.ResourceVector(gpus=-1))),
        INVALID,
        "allocated.gpus",
    ),
    (
        "progress unknown job",
        lambda w: w.stub.UpdateJobProgress(m.UpdateJobProgressRequest(job_id=UNKNOWN_JOB, progress=common_pb2.JobProgress())),
        NOT_FOUND,
        "job_id",
    ),
    ("event type state", lambda w: w.stub.AppendJobEvent(m.AppendJobEventRequest(job_id=w.pending, type="state")), INVALID, "type"),
    ("event type empty", lambda w: w.stub.AppendJobEvent(m.AppendJobEventRequest(job_id=w.pending, type="")), INVALID, "type"),
    ("event type too long", lambda w: w.stub.AppendJobEvent(m.AppendJobEventRequest(job_id=w.pending, type="t" * 65)), INVALID, "type"),
    (
        "event message too long",
        lambda w: w.stub.AppendJobEvent(m.AppendJobEventRequest(job_id=w.pending, type="note", message="x" * 4097)),
        INVALID,
        "message",
    ),
    ("event unknown job", lambda w: w.stub.AppendJobEvent(m.AppendJobEventRequest(job_id=UNKNOWN_JOB, type="note")), NOT_FOUND, "job_id"),
    ("list events limit too big", lambda w: w.stub.ListJobEvents(m.ListJobEventsRequest(job_id=w.pending, limit=1001)), INVALID, "limit"),
    ("list events limit negative", lambda w: w.stub.ListJobEvents(m.ListJobEventsRequest(job_id=w.pending, limit=-1)), INVALID, "limit"),
    (
        "list events after negative",
        lambda w: w.stub.ListJobEvents(m.ListJobEventsRequest(job_id=w.pending, after_sequence=-1)),
        INVALID,
        "after_sequence",
    ),
    ("list events unknown job", lambda w: w.stub.ListJobEvents(m.ListJobEventsRequest(job_id=UNKNOWN_JOB)), NOT_FOUND, "job_id"),
    # -- nodes ---------------------------------------------------------------------------
    ("node name empty", lambda w: w.stub.UpsertNode(m.UpsertNodeRequest(spec=node_spec(""))), INVALID, "spec.name"),
    ("node name invalid", lambda w: w.stub.UpsertNode(m.UpsertNodeRequest(spec=node_spec("node 1!"))), INVALID, "spec.name"),
    ("node gpus negative", lambda w: w.stub.UpsertNode(m.UpsertNodeRequest(spec=node_spec(gpus=-1))), INVALID, "spec.gpus"),
    ("node gpus absurd", lambda w: w.stub.UpsertNode(m.UpsertNodeRequest(spec=node_spec(gpus=1025))), INVALID, "spec.gpus"),
    (
        "node cache negative",
        lambda w: w.stub.UpsertNode(m.UpsertNodeRequest(spec=node_spec(cache_capacity_bytes=-1))),
        INVALID,
        "spec.cache_capacity_bytes",
    ),
    (
        "node bandwidth negative",
        lambda w: w.stub.UpsertNode(m.UpsertNodeRequest(spec=node_spec(network_bandwidth_bytes_per_s=-1))),
        INVALID,
        "spec.network_bandwidth_bytes_per_s",
    ),
    ("node pool unknown", lambda w: w.stub.UpsertNode(m.UpsertNodeRequest(spec=node_spec(pool=7))), INVALID, "spec.pool"),
    ("node cpus negative", lambda w: w.stub.UpsertNode(m.UpsertNodeRequest(spec=node_spec(cpus=-1.0))), INVALID, "spec.cpus"),
    ("node cpus absurd", lambda w: w.stub.UpsertNode(m.UpsertNodeRequest(spec=node_spec(cpus=1e6 + 1))), INVALID, "spec.cpus"),
    ("node cpus infinite", lambda w: w.stub.UpsertNode(m.UpsertNodeRequest(spec=node_spec(cpus=float("inf")))), INVALID, "spec.cpus"),
    ("node memory negative", lambda w: w.stub.UpsertNode(m.UpsertNodeRequest(spec=node_spec(memory_bytes=-1))), INVALID, "spec.memory_bytes"),
    ("node memory absurd", lambda w: w.stub.UpsertNode(m.UpsertNodeRequest(spec=node_spec(memory_bytes=2**60 + 1))), INVALID, "spec.memory_bytes"),
    ("node runtime unknown", lambda w: w.stub.UpsertNode(m.UpsertNodeRequest(spec=node_spec(runtime="docker"))), INVALID, "spec.runtime"),
    ("heartbeat unknown node", lambda w: w.stub.Heartbeat(m.HeartbeatRequest(node="ghost")), NOT_FOUND, "node"),
    (
        "heartbeat version decreases",
        lambda w: w.stub.Heartbeat(m.HeartbeatRequest(node="n1", applied_plan_version=4)),
        PRECONDITION,
        "applied_plan_version",
    ),
    (
        "heartbeat version negative",
        lambda w: w.stub.Heartbeat(m.HeartbeatRequest(node="n1", applied_plan_version=-1)),
        INVALID,
        "applied_plan_version",
    ),
    ("get node unknown", lambda w: w.stub.GetNode(m.GetNodeRequest(node="ghost")), NOT_FOUND, "node"),
    ("list nodes pool unknown", lambda w: w.stub.ListNodes(m.ListNodesRequest(pool=5)), INVALID, "pool"),
    ("list nodes window negative", lambda w: w.stub.ListNodes(m.ListNodesRequest(liveness_window_s=-1)), INVALID, "liveness_window_s"),
    (
        "list nodes window NaN",
        lambda w: w.stub.ListNodes(m.ListNodesRequest(liveness_window_s=float("nan"))),
        INVALID,
        "liveness_window_s",
    ),
    ("list node changes alive only", lambda w: w.stub.ListNodes(m.ListNodesRequest(changed_after=1, alive_only=True)),
     INVALID, "alive_only"),
    ("list node changes of a pool", lambda w: w.stub.ListNodes(m.ListNodesRequest(changed_after=1, pool=1)), INVALID, "pool"),
    ("list node changes of a type", lambda w: w.stub.ListNodes(m.ListNodesRequest(changed_after=1, gpu_type="a100")),
     INVALID, "gpu_type"),
    ("list node changes after 2^63", lambda w: w.stub.ListNodes(m.ListNodesRequest(changed_after=2**63)),
     INVALID, "changed_after"),
    # -- plans ---------------------------------------------------------------------------
    ("plan version zero", lambda w: commit(w, version=0), INVALID, "plan.version"),
    ("plan version negative", lambda w: commit(w, version=-3), INVALID, "plan.version"),
    ("plan version taken", lambda w: commit(w, version=2), ABORTED, "plan.version"),
    ("plan version skips ahead", lambda w: commit(w, version=9), ABORTED, "plan.version"),
    (
        "GPU held by two jobs",
        lambda w: commit(w, alloc("job-a", placement("n1", 0, 1)), alloc("job-b", placement("n1", 1))),
        INVALID,
        "plan.jobs[1].placements[0].gpu_indices",
    ),
    ("GPU listed twice in a placement", lambda w: commit(w, alloc("job-a", placement("n1", 2, 2))), INVALID, "plan.jobs[0].placements[0].gpu_indices"),
    ("job allocated twice", lambda w: commit(w, alloc("job-a"), alloc("job-a")), INVALID, "plan.jobs[1].job_id"),
    ("GPU index negative", lambda w: commit(w, alloc("job-a", placement("n1", -1))), INVALID, "plan.jobs[0].placements[0].gpu_indices"),
    ("placement node empty", lambda w: commit(w, alloc("job-a", placement("", 0))), INVALID, "plan.jobs[0].placements[0].node"),
    ("allocation job id empty", lambda w: commit(w, alloc("")), INVALID, "plan.jobs[0].job_id"),
    (
        "replica on a job's GPU",
        lambda w: commit(
            w,
            alloc("job-a", placement("i1", 0)),
            replicas=[plan_pb2.InferenceReplica(replica_id="r1", node="i1", gpu_index=0, state=plan_pb2.REPLICA_STATE_RUNNING)],
        ),
        INVALID,
        "plan.replicas[0]",
    ),
    (
        "loan to another job",
        lambda w: commit(w, alloc("job-a", placement("i1", 0)), loans=[plan_pb2.GpuLoan(node="i1", gpu_index=0, job_id="job-b")]),
        INVALID,
        "plan.loans[0]",
    ),
    (
        "replica state unknown",
        lambda w: commit(w, replicas=[plan_pb2.InferenceReplica(replica_id="r1", node="i1", gpu_index=0, state=42)]),
        INVALID,
        "plan.replicas[0].state",
    ),
    (
        "cache quota negative",
        lambda w: commit(w, alloc("job-a", cache_grants=[plan_pb2.CacheGrant(node="n1", cache_quota_bytes=-1)])),
        INVALID,
        "plan.jobs[0].cache_grants[0].cache_quota_bytes",
    ),
    (
        "remote io negative",
        lambda w: commit(w, alloc("job-a", cache_grants=[plan_pb2.CacheGrant(node="n1", remote_io_bytes_per_s=-5)])),
        INVALID,
        "plan.jobs[0].cache_grants[0].remote_io_bytes_per_s",
    ),
    (
        "remote io above budget",
        lambda w: commit(
            w,
            alloc("job-a", cache_grants=[plan_pb2.CacheGrant(node="n1", remote_io_bytes_per_s=600)]),
            alloc("job-b", cache_grants=[plan_pb2.CacheGrant(node="n2", remote_io_bytes_per_s=600)]),
            storage_bandwidth_budget_bytes_per_s=1000,
        ),
        INVALID,
        "plan.storage_bandwidth_budget_bytes_per_s",
    ),
    ("budget negative", lambda w: commit(w, storage_bandwidth_budget_bytes_per_s=-1), INVALID, "plan.storage_bandwidth_budget_bytes_per_s"),
    ("cache policy unknown", lambda w: commit(w, alloc("job-a", cache_policy="mru")), INVALID, "plan.jobs[0].cache_policy"),
    ("batch size negative", lambda w: commit(w, alloc("job-a", batch_size=-1)), INVALID, "plan.jobs[0].batch_size"),
    ("created_at nanos invalid", lambda w: commit(w, created_at=bad_stamp(nanos=-1)), INVALID, "plan.created_at"),
    ("created_at beyond year 9999", lambda w: commit(w, created_at=bad_stamp(seconds=2**40)), INVALID, "plan.created_at"),
    ("get plan unknown", lambda w: w.stub.GetPlan(m.GetPlanRequest(version=99)), NOT_FOUND, "version"),
    ("get plan zero", lambda w: w.stub.GetPlan(m.GetPlanRequest(version=0)), INVALID, "version"),
    ("list plans page_size too big", lambda w: w.stub.ListPlans(m.ListPlansRequest(page_size=101)), INVALID, "page_size"),
    ("list plans garbage token", lambda w: w.stub.ListPlans(m.ListPlansRequest(page_token="eyJ4Ijox")), INVALID, "page_token"),
    # -- metrics and models --------------------------------------------------------------
    ("append no samples", lambda w: w.stub.AppendMetrics(m.AppendMetricsRequest()), INVALID, "samples"),
    ("append too many samples", lambda w: w.stub.AppendMetrics(m.AppendMetricsRequest(samples=[sample(w)] * 10001)), INVALID, "samples"),
    (
        "append unknown job",
        lambda w: w.stub.AppendMetrics(m.AppendMetricsRequest(samples=[sample(w), sample(w, job_id=UNKNOWN_JOB)])),
        NOT_FOUND,
        "samples[1].job_id",
    ),
    ("append NaN", lambda w: w.stub.AppendMetrics(m.AppendMetricsRequest(samples=[sample(w, value=float("nan"))])), INVALID, "samples[0].value"),
    ("append infinity", lambda w: w.stub.AppendMetrics(m.AppendMetricsRequest(samples=[sample(w, value=float("-inf"))])), INVALID, "samples[0].value"),
    ("append name empty", lambda w: w.stub.AppendMetrics(m.AppendMetricsRequest(samples=[sample(w, name="")])), INVALID, "samples[0].name"),
    ("append name too long", lambda w: w.stub.AppendMetrics(m.AppendMetricsRequest(samples=[sample(w, name="n" * 65)])), INVALID, "samples[0].name"),
    (
        "append time out of range",
        lambda w: w.stub.AppendMetrics(m.AppendMetricsRequest(samples=[sample(w, time=bad_stamp(seconds=-(2**40)))])),
        INVALID,
        "samples[0].time",
    ),
    ("query empty job", lambda w: w.stub.QueryMetrics(m.QueryMetricsRequest()), INVALID, "job_id"),
    ("query unknown job", lambda w: w.stub.QueryMetrics(m.QueryMetricsRequest(job_id=UNKNOWN_JOB)), NOT_FOUND, "job_id"),
    ("query limit too big", lambda w: w.stub.QueryMetrics(m.QueryMetricsRequest(job_id=w.pending, limit=10001)), INVALID, "limit"),
    (
        "query until before since",
        lambda w: w.stub.QueryMetrics(m.QueryMetricsRequest(job_id=w.pending, since=bad_stamp(100), until=bad_stamp(50))),
        INVALID,
        "until",
    ),
    (
        "model unknown job",
        lambda w: w.stub.PutJobModel(m.PutJobModelRequest(model=common_pb2.JobModelParams(job_id=UNKNOWN_JOB))),
        NOT_FOUND,
        "model.job_id",
    ),
    (
        "model param NaN",
        lambda w: w.stub.PutJobModel(
            m.PutJobModelRequest(model=common_pb2.JobModelParams(job_id=w.pending, params={"a": float("nan")}))
        ),
        INVALID,
        "model.params['a']",
    ),
    (
        "model observations negative",
        lambda w: w.stub.PutJobModel(m.PutJobModelRequest(model=common_pb2.JobModelParams(job_id=w.pending, observations=-1))),
        INVALID,
        "model.observations",
    ),
    ("get model unknown job", lambda w: w.stub.GetJobModel(common_pb2.GetJobModelRequest(job_id=UNKNOWN_JOB)), NOT_FOUND, "job_id"),
]


@pytest.mark.parametrize(("call", "code", "field"), [pytest.param(*case[1:], id=case[0]) for case in CASES])
def test_bad_request_is_refused_naming_the_field(world, call, code, field):
    assert_rpc_error(lambda: call(world), code, field)


def test_messages_explain_what_is_wrong(world):
    illegal = assert_rpc_error(lambda: transition(world, world.pending, 1, 3), grpc.StatusCode.FAILED_PRECONDITION, "new_state")
    assert "JOB_STATE_PENDING" in illegal.details() and "JOB_STATE_RUNNING" in illegal.details()
    stale = assert_rpc_error(lambda: transition(world, world.running, 1, 2), grpc.StatusCode.FAILED_PRECONDITION, "expected_state")
    assert "is JOB_STATE_RUNNING" in stale.details()
    taken = assert_rpc_error(lambda: commit(world, version=2), grpc.StatusCode.ABORTED, "plan.version")
    assert "expected 3" in taken.details()
    double = assert_rpc_error(
        lambda: commit(world, alloc("job-a", placement("n1", 0)), alloc("job-b", placement("n1", 0))), INVALID, "plan.jobs[1].placements[0].gpu_indices"
    )
    assert "GPU n1:0 already held by job-a" in double.details()
    decreased = assert_rpc_error(lambda: world.stub.Heartbeat(m.HeartbeatRequest(node="n1", applied_plan_version=1)), PRECONDITION, None)
    assert "5" in decreased.details()


def test_refused_requests_changed_nothing(world):
    stub = world.stub
    assert stub.GetJob(m.GetJobRequest(job_id=world.pending)).state == 1
    assert stub.GetLatestPlan(m.GetLatestPlanRequest()).version == 2
    assert [d.spec.name for d in stub.ListDatasets(m.ListDatasetsRequest()).datasets] == ["known"]
    assert stub.GetDataset(m.GetDatasetRequest(name="known")).manifest_version == 1
    assert [n.spec.name for n in stub.ListNodes(m.ListNodesRequest()).nodes] == ["n1"]
