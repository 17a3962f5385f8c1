"""Validation rules that are about what is *accepted*, checked without a database."""

from __future__ import annotations

import pytest

from services.metadata import paging
from services.metadata.job_states import LEGAL_MOVES, is_legal_move
from services.metadata.validation.common import reject_nul_characters
from services.metadata.validation.datasets import Manifest, check_object_key
from services.metadata.validation.jobs import normalized_job_spec
from services.metadata.validation.plans import check_plan
from services.runtime.errors import InvalidArgument
from silod.v1 import common_pb2, metadata_pb2, plan_pb2
from tests.metadata.metadata_samples import placement, plan, training_spec

PENDING, SCHEDULED, RUNNING, RESIZING, SUCCEEDED, FAILED, CANCELLED = range(1, 8)


@pytest.mark.parametrize("key", ["a", "a..b", "dir/file..txt", "..hidden", "x/.../y", "ünïcödé/ключ", "a b/c", "k" * 1024])
def test_unusual_but_safe_keys_are_accepted(key):
    check_object_key(key, "key")


def test_manifest_totals_and_order():
    manifest = Manifest()
    manifest.add([common_pb2.DatasetObject(key="b", size_bytes=5, etag="1"), common_pb2.DatasetObject(key="a", size_bytes=0, etag="2")])
    manifest.add([common_pb2.DatasetObject(key="c", size_bytes=2**50, etag="3")])
    assert (len(manifest), manifest.total_bytes, manifest.keys) == (3, 5 + 2**50, ["b", "a", "c"])


def test_legal_moves_are_exactly_the_documented_lifecycle():
    documented = {
        (PENDING, SCHEDULED), (SCHEDULED, RUNNING), (RUNNING, RESIZING), (RESIZING, RUNNING),
        (SCHEDULED, PENDING), (RUNNING, PENDING), (RESIZING, PENDING),
        (RUNNING, SUCCEEDED), (RESIZING, SUCCEEDED),
    } | {(state, end) for state in (PENDING, SCHEDULED, RUNNING, RESIZING) for end in (FAILED, CANCELLED)}  # fmt: skip
    allowed = {(a, b) for a in range(8) for b in range(8) if is_legal_move(a, b)}
    assert allowed == documented
    assert all(not LEGAL_MOVES[terminal] for terminal in (SUCCEEDED, FAILED, CANCELLED))


def test_normalized_spec_makes_equivalent_requests_equal():
    implicit = normalized_job_spec(training_spec(tenant="", kind=0))
    explicit = normalized_job_spec(training_spec(tenant="default", kind=common_pb2.JOB_KIND_TRAINING))
    assert implicit == explicit


def test_lending_a_sleeping_replicas_gpu_to_the_job_placed_on_it_is_allowed():
    check_plan(
        plan(
            1,
            plan_pb2.JobAllocation(job_id="job-t", placements=[placement("i1", 0), placement("n1", 0, 1)]),
            replicas=[
                plan_pb2.InferenceReplica(replica_id="sleepy", node="i1", gpu_index=0, state=plan_pb2.REPLICA_STATE_SLEEP),
                plan_pb2.InferenceReplica(replica_id="gone", node="n1", gpu_index=1, state=plan_pb2.REPLICA_STATE_END),
                plan_pb2.InferenceReplica(replica_id="busy", node="i1", gpu_index=1, state=plan_pb2.REPLICA_STATE_RUNNING),
            ],
            loans=[plan_pb2.GpuLoan(node="i1", gpu_index=0, job_id="job-t")],
        )
    )


def test_a_running_replica_on_the_gpu_of_the_task_it_serves_is_allowed_but_not_on_anothers():
    task = plan_pb2.JobAllocation(job_id="job-i", placements=[placement("i1", 0)])
    serving = plan_pb2.InferenceReplica(replica_id="r", node="i1", gpu_index=0, state=plan_pb2.REPLICA_STATE_RUNNING,
                                        task_id="job-i")
    check_plan(plan(1, task, replicas=[serving]))
    other = plan_pb2.InferenceReplica(replica_id="r", node="i1", gpu_index=0, state=plan_pb2.REPLICA_STATE_RUNNING,
                                      task_id="job-x")
    with pytest.raises(InvalidArgument) as refused:
        check_plan(plan(1, task, replicas=[other]))
    assert refused.value.field == "plan.replicas[0]"


@pytest.mark.parametrize(
    ("replicas", "loans", "field"),
    [
        # A running replica cannot stay on a GPU that is lent out.
        ([plan_pb2.InferenceReplica(replica_id="r", node="i1", gpu_index=0, state=plan_pb2.REPLICA_STATE_RUNNING)],
         [plan_pb2.GpuLoan(node="i1", gpu_index=0, job_id="job-t")], "plan.replicas[0]"),
        # Two live replicas on one GPU.
        ([plan_pb2.InferenceReplica(replica_id="r1", node="i1", gpu_index=3, state=plan_pb2.REPLICA_STATE_PROTECT),
          plan_pb2.InferenceReplica(replica_id="r2", node="i1", gpu_index=3, state=plan_pb2.REPLICA_STATE_SLEEP)], [], "plan.replicas[1]"),
        # One GPU lent twice.
        ([], [plan_pb2.GpuLoan(node="i1", gpu_index=0, job_id="job-t"), plan_pb2.GpuLoan(node="i1", gpu_index=0, job_id="job-u")],
         "plan.loans[1]"),
    ],
)  # fmt: skip
def test_gpu_holder_conflicts(replicas, loans, field):
    with pytest.raises(InvalidArgument) as raised:
        check_plan(plan(1, plan_pb2.JobAllocation(job_id="job-t", placements=[placement("i1", 0)]), replicas=replicas, loans=loans))
    assert raised.value.field == field


def test_page_tokens_round_trip_and_reject_forgeries():
    token = paging.encode_token("dataset-objects", "imagenet", 3, "train/ü/0001")
    assert paging.decode_token(token, "dataset-objects", str, int, str) == ("imagenet", 3, "train/ü/0001")
    assert paging.decode_token("", "jobs", int) == ()
    for forged in (paging.encode_token("jobs", 2**64), paging.encode_token("jobs", True), paging.encode_token("jobs", 1, 2)):
        with pytest.raises(InvalidArgument, match="page_token"):
            paging.decode_token(forged, "jobs", int)


def test_page_size_bounds():
    assert paging.JOBS.size(0) == 100 and paging.JOBS.size(1000) == 1000
    with pytest.raises(InvalidArgument, match="^limit: "):
        paging.JOB_EVENTS.size(1001, field="limit")


def test_nul_is_found_in_map_keys_and_nested_messages():
    with pytest.raises(InvalidArgument, match=r"^spec\.env: "):
        reject_nul_characters(metadata_pb2.CreateJobRequest(spec=common_pb2.JobSpec(env={"A\x00": "x"})))
    with pytest.raises(InvalidArgument, match=r"^plan\.loans\[0\]\.job_id: "):
        reject_nul_characters(metadata_pb2.CommitPlanRequest(plan=plan_pb2.AllocationPlan(loans=[plan_pb2.GpuLoan(job_id="\x00")])))
    reject_nul_characters(metadata_pb2.CreateJobRequest(spec=training_spec(env={"A": "ok"})))
