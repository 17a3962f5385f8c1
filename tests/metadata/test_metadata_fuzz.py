"""Random requests, garbage included, never make the server fail with INTERNAL or UNKNOWN.

One server per database takes 500 random calls: random RPC, random field values (negative,
huge, NaN, unknown enum numbers, NUL characters, forged tokens), mixed with ids that exist so
that the deeper code paths run too.
"""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import timestamp_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from silod.v1 import common_pb2, metadata_pb2 as m, plan_pb2
from tests.metadata.metadata_harness import InProcessServer
from tests.metadata.metadata_samples import create_job, dataset_spec, node_spec, objects, plan, registration

CLIENT_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.ABORTED,
}
# Filled in by the fixture and kept current by the test: what exists on the server.
KNOWN: dict = {"job": "", "dataset": "fuzz-ds", "node": "fuzz-node", "latest_plan": 0}

int32 = st.one_of(st.integers(-3, 10), st.integers(-(2**31), 2**31 - 1))
int64 = st.one_of(st.integers(-3, 10), st.integers(-(2**63), 2**63 - 1))
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.floats(-1, 2))
enum = st.one_of(st.integers(-2, 10), st.sampled_from([2**31 - 1, -(2**31)]))
text = st.one_of(
    st.sampled_from(["", "a", "n1", "state", "note", "..", "/abs", "a/../b", "x\x00y", "job-000000000000", "default"]),
    st.text(max_size=12),
    st.text(min_size=60, max_size=140),
)
page_token = st.one_of(st.just(""), text, st.sampled_from(["eyJsIjoiam9icyIsInAiOls1XX0", "eyJsIjoicGxhbnMiLCJwIjpbMV19", "e30"]))
timestamps = st.builds(timestamp_pb2.Timestamp, seconds=int64, nanos=int32)
string_maps = st.dictionaries(text, text, max_size=3)


def job_ids():
    # Drawn at call time: the known job is created per server, after this module is imported.
    return st.one_of(st.builds(lambda: KNOWN["job"]), text)


def names(kind: str):
    return st.one_of(st.builds(lambda: KNOWN[kind]), text)


job_specs = st.builds(
    common_pb2.JobSpec,
    name=text, tenant=text, kind=enum, application=text, dataset=text, min_gpus=int32, max_gpus=int32,
    batch_size=int32, max_batch_size=int32, priority=int32, command=st.lists(text, max_size=3), env=string_maps,
    inference_duration_s=floats, emulated_step_compute_s=floats,
    epochs=st.one_of(st.none(), int32), sample_budget=st.none() | int64,
)  # fmt: skip
objects_lists = st.lists(st.builds(common_pb2.DatasetObject, key=text, size_bytes=int64, etag=text), max_size=4)
allocations = st.builds(
    plan_pb2.JobAllocation,
    job_id=job_ids(),
    placements=st.lists(st.builds(plan_pb2.GpuPlacement, node=text, gpu_indices=st.lists(int32, max_size=3)), max_size=2),
    batch_size=int32, generation=int64, cache_policy=st.sampled_from(["", "lru", "uniform", "mru"]),
    cache_grants=st.lists(st.builds(plan_pb2.CacheGrant, node=text, cache_quota_bytes=int64, remote_io_bytes_per_s=int64), max_size=2),
)  # fmt: skip
plans = st.builds(
    plan_pb2.AllocationPlan,
    version=int64, policy=text, cache_mode=st.sampled_from(["", "silod", "bogus"]), reason=text,
    jobs=st.lists(allocations, max_size=3), storage_bandwidth_budget_bytes_per_s=int64,
    created_at=st.none() | timestamps,
    replicas=st.lists(st.builds(plan_pb2.InferenceReplica, replica_id=text, node=text, gpu_index=int32, state=enum,
                                reuse_count=int32, protect_until=st.none() | timestamps), max_size=2),
    loans=st.lists(st.builds(plan_pb2.GpuLoan, node=text, gpu_index=int32, job_id=job_ids()), max_size=2),
)  # fmt: skip
samples = st.builds(common_pb2.MetricSample, job_id=job_ids(), time=st.none() | timestamps, name=text, value=floats, labels=string_maps)

GARBAGE = st.one_of(
    st.tuples(
        st.just("RegisterDataset"),
        st.lists(
            st.builds(
                m.RegisterDatasetRequest,
                spec=st.none() | st.builds(common_pb2.DatasetSpec, name=names("dataset"), uri=st.sampled_from(["s3://b/p", "file:///d", "", "ftp://x"]) | text,
                                           storage_options=string_maps, description=text),
                objects=objects_lists,
                replace=st.booleans(),
            ),
            max_size=3,
        ),
    ),
    st.tuples(st.just("GetDataset"), st.builds(m.GetDatasetRequest, name=names("dataset"))),
    st.tuples(st.just("ListDatasets"), st.builds(m.ListDatasetsRequest, page_size=int32, page_token=page_token)),
    st.tuples(st.just("ListDatasetObjects"), st.builds(m.ListDatasetObjectsRequest, name=names("dataset"), page_size=int32, page_token=page_token)),
    st.tuples(st.just("CreateJob"), st.builds(m.CreateJobRequest, spec=job_specs, client_request_id=text)),
    st.tuples(st.just("GetJob"), st.builds(m.GetJobRequest, job_id=job_ids())),
    st.tuples(
        st.just("ListJobs"),
        st.builds(m.ListJobsRequest, states=st.lists(enum, max_size=3), tenant=text, application=text, kind=enum, page_size=int32, page_token=page_token),
    ),
    st.tuples(st.just("TransitionJob"), st.builds(m.TransitionJobRequest, job_id=job_ids(), expected_state=enum, new_state=enum, message=text)),
    st.tuples(
        st.just("UpdateJobProgress"),
        st.builds(
            m.UpdateJobProgressRequest,
            job_id=job_ids(),
            progress=st.none() | st.builds(common_pb2.JobProgress, samples_done=int64, steps_done=int64, epochs_done=int32,
                                           fraction_done=floats, throughput_samples_per_s=floats, cache_hit_ratio=floats),
            allocated=st.none() | st.builds(common_pb2.ResourceVector, gpus=int32, cache_bytes=int64, remote_io_bytes_per_s=int64),
        ),
    ),
    st.tuples(st.just("AppendJobEvent"), st.builds(m.AppendJobEventRequest, job_id=job_ids(), type=text, message=text)),
    st.tuples(st.just("ListJobEvents"), st.builds(m.ListJobEventsRequest, job_id=job_ids(), after_sequence=int64, limit=int32)),
    st.tuples(
        st.just("UpsertNode"),
        st.builds(m.UpsertNodeRequest, spec=st.builds(
            common_pb2.NodeSpec, name=names("node"), pool=enum, gpus=int32, gpu_model=text, cache_capacity_bytes=int64,
            memory_cache_bytes=int64, network_bandwidth_bytes_per_s=int64, agent_address=text, cache_address=text, labels=string_maps)),
    ),
    st.tuples(st.just("Heartbeat"), st.builds(m.HeartbeatRequest, node=names("node"), applied_plan_version=int64)),
    st.tuples(st.just("GetNode"), st.builds(m.GetNodeRequest, node=names("node"))),
    st.tuples(st.just("ListNodes"), st.builds(m.ListNodesRequest, pool=enum, alive_only=st.booleans(), liveness_window_s=floats)),
    st.tuples(st.just("CommitPlan"), st.builds(m.CommitPlanRequest, plan=plans)),
    st.tuples(st.just("GetLatestPlan"), st.just(m.GetLatestPlanRequest())),
    st.tuples(st.just("GetPlan"), st.builds(m.GetPlanRequest, version=int64)),
    st.tuples(st.just("ListPlans"), st.builds(m.ListPlansRequest, page_size=int32, page_token=page_token)),
    st.tuples(st.just("AppendMetrics"), st.builds(m.AppendMetricsRequest, samples=st.lists(samples, max_size=4))),
    st.tuples(
        st.just("QueryMetrics"),
        st.builds(m.QueryMetricsRequest, job_id=job_ids(), name=text, since=st.none() | timestamps, until=st.none() | timestamps, limit=int32),
    ),
    st.tuples(
        st.just("PutJobModel"),
        st.builds(m.PutJobModelRequest, model=st.builds(
            common_pb2.JobModelParams, job_id=job_ids(), application=text, params=st.dictionaries(text, floats, max_size=3), observations=int64)),
    ),
    st.tuples(st.just("GetJobModel"), st.builds(common_pb2.GetJobModelRequest, job_id=job_ids())),
)  # fmt: skip


# Requests close to valid, so that many succeed and the write paths run, not only validation.
small = st.integers(-1, 6)
node_names = st.sampled_from(["n1", "n2", "i1", KNOWN["node"], "bad name"])
near_keys = st.sampled_from(["a", "b", "dir/c", "a", "../x", "/y", ""])
NEAR_VALID = st.one_of(
    st.tuples(
        st.just("RegisterDataset"),
        st.lists(
            st.builds(
                m.RegisterDatasetRequest,
                spec=st.builds(common_pb2.DatasetSpec, name=st.sampled_from(["d1", "d2", KNOWN["dataset"]]), uri=st.just("s3://b/p")),
                objects=st.lists(st.builds(common_pb2.DatasetObject, key=near_keys, size_bytes=st.integers(-1, 100), etag=st.sampled_from(["e", ""])), max_size=3),
                replace=st.booleans(),
            ),
            min_size=1, max_size=2,
        ),
    ),
    st.tuples(
        st.just("CreateJob"),
        st.builds(
            m.CreateJobRequest,
            spec=st.builds(common_pb2.JobSpec, name=st.sampled_from(["j", "j", "j", ""]), kind=st.sampled_from([0, 1, 1, 1, 2, 9]),
                           min_gpus=st.sampled_from([1, 1, 1, 0]), max_gpus=st.sampled_from([1, 2, 4]), batch_size=st.integers(-1, 64),
                           epochs=st.sampled_from([1, 2, 3, 0]), inference_duration_s=st.sampled_from([0.0, 0.0, 0.0, 5.0, -1.0])),
            client_request_id=st.sampled_from(["", "r1", "r2"]),
        ),
    ),
    st.tuples(st.just("TransitionJob"), st.builds(m.TransitionJobRequest, job_id=job_ids(), expected_state=st.integers(0, 8), new_state=st.integers(0, 8))),
    st.tuples(
        st.just("UpdateJobProgress"),
        st.builds(m.UpdateJobProgressRequest, job_id=job_ids(), progress=st.builds(
            common_pb2.JobProgress, samples_done=st.integers(-1, 10**6), fraction_done=st.floats(-0.1, 1.1), cache_hit_ratio=st.floats(0, 1))),
    ),
    st.tuples(st.just("AppendJobEvent"), st.builds(m.AppendJobEventRequest, job_id=job_ids(), type=st.sampled_from(["note", "resize", "state", ""]), message=text)),
    st.tuples(st.just("ListJobEvents"), st.builds(m.ListJobEventsRequest, job_id=job_ids(), after_sequence=small, limit=small)),
    st.tuples(st.just("UpsertNode"), st.builds(m.UpsertNodeRequest, spec=st.builds(common_pb2.NodeSpec, name=node_names, pool=st.integers(0, 3), gpus=st.integers(-1, 9)))),
    st.tuples(st.just("Heartbeat"), st.builds(m.HeartbeatRequest, node=node_names, applied_plan_version=small)),
    st.tuples(st.just("ListNodes"), st.builds(m.ListNodesRequest, pool=st.integers(0, 3), alive_only=st.booleans(), liveness_window_s=st.floats(-1, 30))),
    st.tuples(
        st.just("CommitPlan"),
        st.builds(m.CommitPlanRequest, plan=st.builds(
            plan_pb2.AllocationPlan,
            # Mostly the next version, read at draw time, so that commits succeed too.
            version=st.builds(lambda offset: KNOWN["latest_plan"] + offset, st.sampled_from([1, 1, 1, 0, 2, -5])),
            jobs=st.lists(st.builds(plan_pb2.JobAllocation, job_id=st.sampled_from(["job-a", "job-b", "job-c"]),
                                    placements=st.lists(st.builds(plan_pb2.GpuPlacement, node=st.sampled_from(["n1", "n2"]),
                                                                  gpu_indices=st.lists(st.integers(0, 3), max_size=2)), max_size=2)), max_size=3),
        )),
    ),
    st.tuples(st.just("GetPlan"), st.builds(m.GetPlanRequest, version=st.integers(0, 40))),
    st.tuples(st.just("ListPlans"), st.builds(m.ListPlansRequest, page_size=st.integers(-1, 5))),
    st.tuples(st.just("ListJobs"), st.builds(m.ListJobsRequest, states=st.lists(st.integers(0, 8), max_size=2), page_size=st.integers(-1, 5))),
    st.tuples(
        st.just("AppendMetrics"),
        st.builds(m.AppendMetricsRequest, samples=st.lists(st.builds(common_pb2.MetricSample, job_id=job_ids(), name=st.sampled_from(["step_time_s", ""]),
                                                                     value=st.floats(-10, 10), labels=st.dictionaries(st.sampled_from(["rank", ""]), st.just("0"))), max_size=3)),
    ),
    st.tuples(st.just("QueryMetrics"), st.builds(m.QueryMetricsRequest, job_id=job_ids(), name=st.sampled_from(["", "step_time_s"]), limit=small)),
    st.tuples(
        st.just("PutJobModel"),
        st.builds(m.PutJobModelRequest, model=st.builds(common_pb2.JobModelParams, job_id=job_ids(), params=st.dictionaries(st.sampled_from(["a_s", "b", ""]), st.floats(-1, 1)), observations=small)),
    ),
    st.tuples(st.just("GetJobModel"), st.builds(common_pb2.GetJobModelRequest, job_id=job_ids())),
)  # fmt: skip
CALLS = st.one_of(GARBAGE, NEAR_VALID)


@pytest.fixture(scope="module")
def fuzzed_server(module_server: InProcessServer) -> InProcessServer:
    stub = module_server.stub
    KNOWN["job"] = create_job(stub).id
    stub.RegisterDataset(registration(dataset_spec(KNOWN["dataset"]), objects(3)))
    stub.UpsertNode(m.UpsertNodeRequest(spec=node_spec(KNOWN["node"])))
    KNOWN["latest_plan"] = stub.CommitPlan(m.CommitPlanRequest(plan=plan(1))).version
    return module_server


def test_random_requests_get_ok_or_a_client_error(fuzzed_server: InProcessServer):
    stub = fuzzed_server.stub
    seen: dict[str, int] = {}

    @settings(max_examples=500, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(CALLS)
    def one_call(call):
        method, request = call
        seen[method] = seen.get(method, 0) + 1
        rpc = getattr(stub, method)
        try:
            reply = rpc(iter(request) if method == "RegisterDataset" else request, timeout=30)
            if method == "CommitPlan":
                KNOWN["latest_plan"] = reply.version
        except grpc.RpcError as error:
            assert error.code() in CLIENT_ERRORS, f"{method} answered {error.code().name}: {error.details()}\nrequest: {request}"
            assert error.details(), f"{method} gave {error.code().name} without a message"

    one_call()
    assert sum(seen.values()) >= 500 and len(seen) >= 20, seen
    # Still serving, and the data it started with is intact.
    assert stub.GetJob(m.GetJobRequest(job_id=KNOWN["job"])).id == KNOWN["job"]
    assert stub.GetDataset(m.GetDatasetRequest(name=KNOWN["dataset"])).num_objects >= 0
    assert stub.ListPlans(m.ListPlansRequest()).plans
