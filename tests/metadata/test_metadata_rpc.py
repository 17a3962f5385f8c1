"""Every MetadataService RPC over real gRPC, on SQLite and PostgreSQL: happy paths, paging, filters."""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone

import grpc
from google.protobuf import timestamp_pb2

from silod.v1 import common_pb2, metadata_pb2 as m, plan_pb2
from tests.metadata.metadata_harness import assert_rpc_error
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

PENDING, SCHEDULED, RUNNING, RESIZING, SUCCEEDED, FAILED, CANCELLED = range(1, 8)


def stamp(value: datetime) -> timestamp_pb2.Timestamp:
    result = timestamp_pb2.Timestamp()
    result.FromDatetime(value)
    return result


# -- datasets ------------------------------------------------------------------------------


def test_register_dataset_streams_manifest_and_pages_it_by_key(stub):
    manifest = objects(2500)
    dataset = stub.RegisterDataset(registration(dataset_spec("cifar10", description="tiny"), manifest[::-1], chunk=1000))
    assert (dataset.num_objects, dataset.manifest_version) == (2500, 1)
    assert dataset.total_bytes == sum(o.size_bytes for o in manifest)
    assert dataset.spec.storage_options == {"anon": "true"} and dataset.spec.description == "tiny"
    assert dataset.registered_at.seconds > 0 and dataset.updated_at == dataset.registered_at
    assert stub.GetDataset(m.GetDatasetRequest(name="cifar10")) == dataset

    keys, token, pages = [], "", 0
    while True:
        page = stub.ListDatasetObjects(m.ListDatasetObjectsRequest(name="cifar10", page_size=1000, page_token=token))
        assert page.manifest_version == 1
        keys += [o.key for o in page.objects]
        pages, token = pages + 1, page.next_page_token
        if not token:
            break
    assert pages == 3 and keys == sorted(o.key for o in manifest)
    default_page = stub.ListDatasetObjects(m.ListDatasetObjectsRequest(name="cifar10"))
    assert len(default_page.objects) == 1000 and default_page.next_page_token
    assert default_page.objects[0] == manifest[0]


def test_replacing_a_manifest_is_atomic_and_bumps_its_version(stub):
    stub.RegisterDataset(registration(dataset_spec("imagenet"), objects(30, prefix="old/")))
    first_page = stub.ListDatasetObjects(m.ListDatasetObjectsRequest(name="imagenet", page_size=10))
    replaced = stub.RegisterDataset(
        registration(dataset_spec("imagenet", uri="file:///data/imagenet"), objects(5, prefix="new/"), replace=True)
    )
    assert (replaced.manifest_version, replaced.num_objects, replaced.spec.uri) == (2, 5, "file:///data/imagenet")
    listed = stub.ListDatasetObjects(m.ListDatasetObjectsRequest(name="imagenet"))
    assert [o.key for o in listed.objects] == [f"new/{i:06d}.bin" for i in range(5)] and listed.manifest_version == 2
    # A token into the replaced manifest must not silently continue in the new one.
    assert_rpc_error(
        lambda: stub.ListDatasetObjects(m.ListDatasetObjectsRequest(name="imagenet", page_token=first_page.next_page_token)),
        grpc.StatusCode.FAILED_PRECONDITION,
        "page_token",
    )


def test_empty_manifest_and_list_datasets_paging(stub):
    for name in ("d3", "d1", "d2", "d5", "d4"):
        assert stub.RegisterDataset(registration(dataset_spec(name), [])).num_objects == 0
    names, token = [], ""
    while True:
        page = stub.ListDatasets(m.ListDatasetsRequest(page_size=2, page_token=token))
        assert len(page.datasets) <= 2
        names += [d.spec.name for d in page.datasets]
        token = page.next_page_token
        if not token:
            break
    assert names == ["d1", "d2", "d3", "d4", "d5"]
    assert [d.spec.name for d in stub.ListDatasets(m.ListDatasetsRequest()).datasets] == names


# -- jobs ----------------------------------------------------------------------------------


def test_create_job_fills_defaults_and_records_a_state_event(stub):
    job = create_job(stub, training_spec(tenant="", kind=common_pb2.JOB_KIND_UNSPECIFIED, env={"A": "1"}, command=["python", "t.py"]))
    assert job.id.startswith("job-") and len(job.id) == 16
    assert job.state == PENDING and job.state_version == 1 and not job.client_request_id
    assert job.spec.tenant == "default" and job.spec.kind == common_pb2.JOB_KIND_TRAINING
    assert job.spec.env == {"A": "1"} and list(job.spec.command) == ["python", "t.py"]
    assert not job.HasField("started_at") and not job.HasField("finished_at")
    assert abs(job.created_at.ToDatetime(timezone.utc) - datetime.now(timezone.utc)) < timedelta(seconds=30)
    assert stub.GetJob(m.GetJobRequest(job_id=job.id)) == job
    (event,) = stub.ListJobEvents(m.ListJobEventsRequest(job_id=job.id)).events
    assert (event.sequence, event.type, event.from_state, event.to_state) == (1, "state", 0, PENDING)


def test_create_job_is_idempotent_on_client_request_id(stub):
    first = create_job(stub, training_spec(), request_id="submit-1")
    again = create_job(stub, training_spec(), request_id="submit-1")
    assert again == first and first.client_request_id == "submit-1"
    other = create_job(stub, training_spec(), request_id="submit-2")
    assert other.id != first.id
    # Without a request id every call is a new job.
    assert create_job(stub).id != create_job(stub).id
    assert_rpc_error(
        lambda: create_job(stub, training_spec(max_gpus=8), request_id="submit-1"),
        grpc.StatusCode.ALREADY_EXISTS,
        "client_request_id",
    )


def test_inference_and_sample_budget_jobs_are_accepted(stub):
    inference = create_job(stub, inference_spec())
    assert inference.spec.kind == common_pb2.JOB_KIND_INFERENCE and inference.spec.inference_duration_s == 30.0
    budget = create_job(stub, training_spec(sample_budget=10**12, priority=-(2**31)))
    assert budget.spec.WhichOneof("budget") == "sample_budget" and budget.spec.sample_budget == 10**12


def test_transition_lifecycle_sets_times_versions_and_events(stub):
    job = create_job(stub)
    job = move(stub, job, SCHEDULED, RUNNING)
    assert job.state == RUNNING and job.state_version == 3 and job.HasField("started_at") and job.message == f"to {RUNNING}"
    started = job.started_at
    job = move(stub, job, RESIZING, RUNNING)
    assert job.started_at == started, "started_at is the first RUNNING only"
    job = move(stub, job, PENDING, SCHEDULED, RUNNING, SUCCEEDED)
    assert job.state == SUCCEEDED and job.state_version == 9 and job.HasField("finished_at")
    events = stub.ListJobEvents(m.ListJobEventsRequest(job_id=job.id)).events
    assert [e.sequence for e in events] == list(range(1, 10))
    assert [(e.from_state, e.to_state) for e in events] == [
        (0, PENDING), (PENDING, SCHEDULED), (SCHEDULED, RUNNING), (RUNNING, RESIZING), (RESIZING, RUNNING),
        (RUNNING, PENDING), (PENDING, SCHEDULED), (SCHEDULED, RUNNING), (RUNNING, SUCCEEDED),
    ]  # fmt: skip
    for terminal in (FAILED, CANCELLED):
        other = move(stub, create_job(stub), terminal)
        assert other.state == terminal and other.HasField("finished_at") and not other.HasField("started_at")


def test_list_jobs_filters_and_pages_in_submission_order(stub):
    created = [
        create_job(stub, training_spec(tenant="alice", application="cifar10")),
        create_job(stub, training_spec(tenant="bob", application="imagenet")),
        create_job(stub, inference_spec(tenant="alice")),
        create_job(stub, training_spec(tenant="alice", application="imagenet")),
        create_job(stub, training_spec(tenant="", application="cifar10")),
    ]
    move(stub, created[1], SCHEDULED)
    move(stub, created[3], CANCELLED)
    ids = [job.id for job in created]

    def listed(**filters):
        return [job.id for job in stub.ListJobs(m.ListJobsRequest(**filters)).jobs]

    assert listed() == ids
    assert listed(tenant="alice") == [ids[0], ids[2], ids[3]]
    assert listed(tenant="default") == [ids[4]]
    assert listed(application="imagenet") == [ids[1], ids[3]]
    assert listed(kind=common_pb2.JOB_KIND_INFERENCE) == [ids[2]]
    assert listed(kind=common_pb2.JOB_KIND_TRAINING, tenant="alice") == [ids[0], ids[3]]
    assert listed(states=[PENDING]) == [ids[0], ids[2], ids[4]]
    assert listed(states=[SCHEDULED, CANCELLED]) == [ids[1], ids[3]]
    assert listed(states=[RUNNING]) == []

    seen, token = [], ""
    while True:
        page = stub.ListJobs(m.ListJobsRequest(page_size=2, page_token=token))
        seen += [job.id for job in page.jobs]
        token = page.next_page_token
        if not token:
            break
    assert seen == ids
    first = stub.ListJobs(m.ListJobsRequest(tenant="alice", page_size=1))
    rest = stub.ListJobs(m.ListJobsRequest(tenant="alice", page_size=5, page_token=first.next_page_token))
    assert [j.id for j in first.jobs] + [j.id for j in rest.jobs] == [ids[0], ids[2], ids[3]] and not rest.next_page_token


def test_update_job_progress_and_allocation(stub):
    job = create_job(stub)
    progress = common_pb2.JobProgress(samples_done=5000, steps_done=40, epochs_done=1, fraction_done=0.33,
                                      throughput_samples_per_s=812.5, cache_hit_ratio=0.9)  # fmt: skip
    allocated = common_pb2.ResourceVector(gpus=2, cache_bytes=2**30, remote_io_bytes_per_s=10**8)
    updated = stub.UpdateJobProgress(m.UpdateJobProgressRequest(job_id=job.id, progress=progress, allocated=allocated))
    assert updated.progress == progress and updated.allocated == allocated and updated.state_version == 1
    # allocated is optional: omitting it keeps what the job holds.
    newer = common_pb2.JobProgress(samples_done=9000, fraction_done=0.6)
    updated = stub.UpdateJobProgress(m.UpdateJobProgressRequest(job_id=job.id, progress=newer))
    assert updated.progress == newer and updated.allocated == allocated
    assert stub.GetJob(m.GetJobRequest(job_id=job.id)) == updated


def test_append_and_list_job_events(stub):
    job = create_job(stub)
    notes = [stub.AppendJobEvent(m.AppendJobEventRequest(job_id=job.id, type="note", message=f"n{i}")) for i in range(5)]
    assert [e.sequence for e in notes] == [2, 3, 4, 5, 6] and notes[0].time.seconds > 0
    events = stub.ListJobEvents(m.ListJobEventsRequest(job_id=job.id, after_sequence=2, limit=2)).events
    assert [(e.sequence, e.message) for e in events] == [(3, "n1"), (4, "n2")]
    moved = move(stub, job, CANCELLED)
    last = stub.ListJobEvents(m.ListJobEventsRequest(job_id=moved.id, after_sequence=6)).events
    assert [(e.sequence, e.type, e.to_state) for e in last] == [(7, "state", CANCELLED)]


# -- nodes ---------------------------------------------------------------------------------


def test_upsert_heartbeat_get_and_list_nodes(stub):
    registered = stub.UpsertNode(m.UpsertNodeRequest(spec=node_spec("n1", pool=common_pb2.NODE_POOL_UNSPECIFIED)))
    assert registered.spec.pool == common_pb2.NODE_POOL_TRAINING and registered.alive
    assert registered.applied_plan_version == 0 and registered.registered_at == registered.last_heartbeat
    updated = stub.UpsertNode(m.UpsertNodeRequest(spec=node_spec("n1", gpus=8)))
    assert updated.spec.gpus == 8 and updated.registered_at == registered.registered_at
    beat = stub.Heartbeat(m.HeartbeatRequest(node="n1", applied_plan_version=3))
    assert beat.applied_plan_version == 3 and beat.last_heartbeat.ToNanoseconds() >= updated.last_heartbeat.ToNanoseconds()
    assert stub.Heartbeat(m.HeartbeatRequest(node="n1", applied_plan_version=3)).applied_plan_version == 3
    assert stub.GetNode(m.GetNodeRequest(node="n1")).spec == node_spec("n1", gpus=8)

    stub.UpsertNode(m.UpsertNodeRequest(spec=node_spec("i1", pool=common_pb2.NODE_POOL_INFERENCE)))
    stub.UpsertNode(m.UpsertNodeRequest(spec=node_spec("a0")))
    assert [n.spec.name for n in stub.ListNodes(m.ListNodesRequest()).nodes] == ["a0", "i1", "n1"]
    assert [n.spec.name for n in stub.ListNodes(m.ListNodesRequest(pool=common_pb2.NODE_POOL_INFERENCE)).nodes] == ["i1"]
    assert [n.spec.name for n in stub.ListNodes(m.ListNodesRequest(pool=common_pb2.NODE_POOL_TRAINING)).nodes] == ["a0", "n1"]


def test_registrations_that_arrive_together_each_get_their_own_answer_or_error(stub):
    from concurrent.futures import ThreadPoolExecutor

    def register(i: int):
        name = f"c{i:02}" if i % 10 else f"bad {i}"  # every tenth refused, on its own
        try:
            return stub.UpsertNode(m.UpsertNodeRequest(spec=node_spec(name, gpus=1 + i % 8)))
        except grpc.RpcError as exc:
            return exc

    with ThreadPoolExecutor(16) as pool:  # many in flight: they are written in batches
        answers = list(pool.map(register, range(60)))
    for i, answer in enumerate(answers):
        if i % 10:
            assert answer.spec.name == f"c{i:02}" and answer.spec.gpus == 1 + i % 8 and answer.alive
        else:
            assert answer.code() == grpc.StatusCode.INVALID_ARGUMENT and "spec.name" in answer.details()
    assert sorted(n.spec.name for n in stub.ListNodes(m.ListNodesRequest()).nodes) == \
        sorted(f"c{i:02}" for i in range(60) if i % 10)


def test_transition_jobs_moves_each_independently_and_reports_refusals(stub):
    a, b, c = (create_job(stub) for _ in range(3))
    reply = stub.TransitionJobs(m.TransitionJobsRequest(transitions=[
        m.TransitionJobRequest(job_id=a.id, expected_state=PENDING, new_state=SCHEDULED, message="placed"),
        m.TransitionJobRequest(job_id=b.id, expected_state=RUNNING, new_state=SUCCEEDED),  # b is PENDING
        m.TransitionJobRequest(job_id="job-000000000000", expected_state=PENDING, new_state=SCHEDULED),
        m.TransitionJobRequest(job_id=c.id, expected_state=PENDING, new_state=CANCELLED, message="bye"),
    ]))
    moved, stale, missing, cancelled = reply.results
    assert moved.job.state == SCHEDULED and moved.job.message == "placed" and not moved.error_code
    assert stale.error_code == "FAILED_PRECONDITION" and stale.error.startswith("transitions[1].expected_state")
    assert not stale.HasField("job")
    assert missing.error_code == "NOT_FOUND" and missing.error.startswith("transitions[2]")
    assert cancelled.job.state == CANCELLED
    assert stub.GetJob(m.GetJobRequest(job_id=b.id)).state == PENDING  # the refusal changed nothing
    events = stub.ListJobEvents(m.ListJobEventsRequest(job_id=a.id)).events
    assert [e.type for e in events][-1] == "state"  # recorded like a single TransitionJob
    brief = stub.TransitionJobs(m.TransitionJobsRequest(state_only=True, transitions=[
        m.TransitionJobRequest(job_id=a.id, expected_state=SCHEDULED, new_state=RUNNING, message="started")])).results[0]
    assert (brief.job.id, brief.job.state, brief.job.message) == (a.id, RUNNING, "started")
    assert brief.job.started_at.seconds > 0 and not brief.job.HasField("spec")
    for count in (0, 1001):
        moves = [m.TransitionJobRequest(job_id=a.id, expected_state=RUNNING, new_state=SUCCEEDED)] * count
        assert_rpc_error(lambda: stub.TransitionJobs(m.TransitionJobsRequest(transitions=moves)),
                         grpc.StatusCode.INVALID_ARGUMENT, "transitions")


def test_list_jobs_since_a_time_gives_only_jobs_created_or_moved_after_it(stub):
    a, b, c = (create_job(stub) for _ in range(3))
    first = stub.ListJobs(m.ListJobsRequest())
    since = first.read_at
    assert {j.id for j in first.jobs} >= {a.id, b.id, c.id} and since.seconds > 0
    time.sleep(0.01)
    stub.TransitionJob(m.TransitionJobRequest(job_id=a.id, expected_state=PENDING, new_state=SCHEDULED))
    stub.UpdateJobProgress(m.UpdateJobProgressRequest(job_id=b.id, progress=common_pb2.JobProgress(samples_done=5)))
    stub.TransitionJob(m.TransitionJobRequest(job_id=c.id, expected_state=PENDING, new_state=CANCELLED))
    d = create_job(stub)
    changed = stub.ListJobs(m.ListJobsRequest(state_changed_since=since))
    assert [j.id for j in changed.jobs] == [a.id, c.id, d.id]  # progress is not a state change
    assert [j.state for j in changed.jobs] == [SCHEDULED, CANCELLED, PENDING]
    assert changed.read_at.ToNanoseconds() >= since.ToNanoseconds()
    active = stub.ListJobs(m.ListJobsRequest(state_changed_since=since, states=[PENDING, SCHEDULED]))
    assert [j.id for j in active.jobs] == [a.id, d.id]
    assert_rpc_error(lambda: stub.ListJobs(m.ListJobsRequest(state_changed_since=timestamp_pb2.Timestamp(seconds=-10**12))),
                     grpc.StatusCode.INVALID_ARGUMENT, "state_changed_since")

    # The state view: what moved, cheaply; then only the jobs wanted, whole, by id.
    states = stub.ListJobs(m.ListJobsRequest(state_changed_since=since, view=m.JOB_VIEW_STATE))
    assert [(j.id, j.state, j.state_version) for j in states.jobs] == [(j.id, j.state, j.state_version)
                                                                       for j in changed.jobs]
    assert not any(j.HasField("spec") or j.HasField("created_at") for j in states.jobs)
    assert states.HasField("read_at")
    wanted = stub.ListJobs(m.ListJobsRequest(job_ids=[d.id, a.id, "job-000000000000"]))
    assert [j.id for j in wanted.jobs] == [a.id, d.id]  # in submission order; an unknown id is left out
    assert wanted.jobs[0] == stub.GetJob(m.GetJobRequest(job_id=a.id))
    assert [j.id for j in stub.ListJobs(m.ListJobsRequest(job_ids=[a.id, b.id], states=[PENDING])).jobs] == [b.id]
    assert_rpc_error(lambda: stub.ListJobs(m.ListJobsRequest(view=7)), grpc.StatusCode.INVALID_ARGUMENT, "view")
    assert_rpc_error(lambda: stub.ListJobs(m.ListJobsRequest(job_ids=[a.id, "not a job"])),
                     grpc.StatusCode.INVALID_ARGUMENT, "job_ids[1]")
    assert_rpc_error(lambda: stub.ListJobs(m.ListJobsRequest(job_ids=[a.id] * 1001)),
                     grpc.StatusCode.INVALID_ARGUMENT, "job_ids")


def test_update_jobs_progress_stores_each_independently_and_reports_refusals(stub):
    a, b = create_job(stub), create_job(stub)
    reply = stub.UpdateJobsProgress(m.UpdateJobsProgressRequest(updates=[
        m.UpdateJobProgressRequest(job_id=a.id, progress=common_pb2.JobProgress(samples_done=640, epochs_done=1),
                                   allocated=common_pb2.ResourceVector(gpus=2)),
        m.UpdateJobProgressRequest(job_id="job-000000000000", progress=common_pb2.JobProgress(samples_done=1)),
        m.UpdateJobProgressRequest(job_id=b.id, progress=common_pb2.JobProgress(samples_done=-5)),
        m.UpdateJobProgressRequest(job_id=b.id, allocated=common_pb2.ResourceVector(gpus=1)),
    ]))
    stored, missing, bad, allocated_only = reply.results
    assert not stored.error_code and not allocated_only.error_code
    assert missing.error_code == "NOT_FOUND" and missing.error.startswith("updates[1].job_id")
    assert bad.error_code == "INVALID_ARGUMENT" and bad.error.startswith("updates[2].progress")
    job_a, job_b = (stub.GetJob(m.GetJobRequest(job_id=j.id)) for j in (a, b))
    assert job_a.progress.samples_done == 640 and job_a.progress.epochs_done == 1 and job_a.allocated.gpus == 2
    assert job_b.progress.samples_done == 0 and job_b.allocated.gpus == 1  # the refused update changed nothing
    assert job_a.state == PENDING and job_a.state_version == a.state_version  # progress is not a state move
    for count in (0, 1001):
        updates = [m.UpdateJobProgressRequest(job_id=a.id)] * count
        assert_rpc_error(lambda: stub.UpdateJobsProgress(m.UpdateJobsProgressRequest(updates=updates)),
                         grpc.StatusCode.INVALID_ARGUMENT, "updates")


def test_create_jobs_creates_each_independently_and_reports_refusals(stub):
    def request(**fields):
        request_id = fields.pop("request_id", "")
        return m.CreateJobRequest(spec=training_spec(**fields), client_request_id=request_id)

    batch = m.CreateJobsRequest(jobs=[
        request(name="first", request_id="batch-1"),
        request(name=""),  # refused: CreateJob's check, CreateJob's message
        request(name="nul", env={"A": "x\x00y"}),
        request(name="first", request_id="batch-1"),  # the same request twice: one job
        request(name="other", request_id="batch-1"),  # the same key for another spec
        request(name="anonymous"),
    ])
    first, unnamed, nul, again, clash, anonymous = stub.CreateJobs(batch).results
    assert not first.error_code and first.job.state == PENDING and first.job.spec.name == "first"
    assert first.job == stub.GetJob(m.GetJobRequest(job_id=first.job.id))  # answered as it reads back
    assert unnamed.error_code == "INVALID_ARGUMENT" and unnamed.error.startswith("spec.name:")
    assert not unnamed.HasField("job")
    assert nul.error_code == "INVALID_ARGUMENT" and nul.error.startswith("spec.env")
    assert again.job.id == first.job.id
    assert clash.error_code == "ALREADY_EXISTS" and clash.error.startswith("client_request_id:")
    assert anonymous.job.spec.name == "anonymous" and anonymous.job.id != first.job.id
    # Retried as a whole: the keyed job is found, not made again.
    assert stub.CreateJobs(batch).results[0].job == first.job
    names = sorted(j.spec.name for j in stub.ListJobs(m.ListJobsRequest()).jobs)
    assert names == ["anonymous", "anonymous", "first"]
    for count in (0, 1001):
        jobs = [request(name="x")] * count
        assert_rpc_error(lambda: stub.CreateJobs(m.CreateJobsRequest(jobs=jobs)), grpc.StatusCode.INVALID_ARGUMENT,
                         "jobs")


def test_list_jobs_shows_every_change_to_a_listed_job(stub):
    # Listings reuse the message of an unchanged row: any change must still show.
    job = create_job(stub)
    listed = stub.ListJobs(m.ListJobsRequest()).jobs
    assert list(listed) == [stub.GetJob(m.GetJobRequest(job_id=job.id))]
    moved = move(stub, job, SCHEDULED, RUNNING)
    progressed = stub.UpdateJobProgress(m.UpdateJobProgressRequest(
        job_id=job.id, progress=common_pb2.JobProgress(samples_done=640, steps_done=5),
        allocated=common_pb2.ResourceVector(gpus=2)))
    (after,) = stub.ListJobs(m.ListJobsRequest()).jobs
    assert after == progressed and after.state == RUNNING and after.state_version == moved.state_version
    assert after.progress.samples_done == 640 and after.allocated.gpus == 2 and after.HasField("started_at")


def test_a_refused_lower_version_heartbeat_still_keeps_the_node_alive(stub):
    stub.UpsertNode(m.UpsertNodeRequest(spec=node_spec("restarted")))
    before = stub.Heartbeat(m.HeartbeatRequest(node="restarted", applied_plan_version=7))
    time.sleep(0.4)
    # A restarted agent reports 0 until it applies the latest plan: refused, but alive.
    assert_rpc_error(lambda: stub.Heartbeat(m.HeartbeatRequest(node="restarted", applied_plan_version=0)),
                     grpc.StatusCode.FAILED_PRECONDITION, "applied_plan_version")
    node = stub.GetNode(m.GetNodeRequest(node="restarted"))
    assert node.applied_plan_version == 7
    assert node.last_heartbeat.ToNanoseconds() > before.last_heartbeat.ToNanoseconds() + 300_000_000
    fresh = stub.ListNodes(m.ListNodesRequest(liveness_window_s=0.3)).nodes
    assert {n.spec.name: n.alive for n in fresh}["restarted"] is True


def test_liveness_uses_the_requested_window(stub):
    stub.UpsertNode(m.UpsertNodeRequest(spec=node_spec("quiet")))
    time.sleep(0.4)
    stub.UpsertNode(m.UpsertNodeRequest(spec=node_spec("chatty")))
    short = stub.ListNodes(m.ListNodesRequest(liveness_window_s=0.3)).nodes
    assert {n.spec.name: n.alive for n in short} == {"chatty": True, "quiet": False}
    assert [n.spec.name for n in stub.ListNodes(m.ListNodesRequest(alive_only=True, liveness_window_s=0.3)).nodes] == ["chatty"]
    # The server default (15 s) counts both.
    assert len(stub.ListNodes(m.ListNodesRequest(alive_only=True)).nodes) == 2


# -- plans ---------------------------------------------------------------------------------


def test_plans_commit_in_sequence_and_list_newest_first(stub):
    assert_rpc_error(lambda: stub.GetLatestPlan(m.GetLatestPlanRequest()), grpc.StatusCode.NOT_FOUND, None)
    job = create_job(stub)
    first = stub.CommitPlan(m.CommitPlanRequest(plan=plan(1, plan_pb2.JobAllocation(job_id=job.id, placements=[placement("n1", 0, 1)]))))
    assert first.version == 1 and first.HasField("created_at"), "the server stamps created_at"
    given = stamp(datetime(2030, 1, 2, 3, 4, 5, 600000, tzinfo=timezone.utc))
    second = stub.CommitPlan(m.CommitPlanRequest(plan=plan(2, created_at=given, reason="arrival")))
    assert second.created_at == given and second.reason == "arrival"
    for version in range(3, 6):
        stub.CommitPlan(m.CommitPlanRequest(plan=plan(version)))
    assert stub.GetLatestPlan(m.GetLatestPlanRequest()).version == 5
    assert stub.GetPlan(m.GetPlanRequest(version=1)) == first
    pages, token = [], ""
    while True:
        page = stub.ListPlans(m.ListPlansRequest(page_size=2, page_token=token))
        pages.append([p.version for p in page.plans])
        token = page.next_page_token
        if not token:
            break
    assert pages == [[5, 4], [3, 2], [1]]
    assert [p.version for p in stub.ListPlans(m.ListPlansRequest()).plans] == [5, 4, 3, 2, 1]
    assert_rpc_error(lambda: stub.CommitPlan(m.CommitPlanRequest(plan=plan(5))), grpc.StatusCode.ABORTED, "plan.version")


def test_full_plan_round_trips(stub):
    full = plan_pb2.AllocationPlan(
        version=1, policy="deepboot", cache_mode="silod", reason="interval", storage_bandwidth_budget_bytes_per_s=10**9,
        jobs=[plan_pb2.JobAllocation(
            job_id="job-aaaaaaaaaaaa", placements=[placement("n1", 0, 1), placement("n2", 0)], batch_size=256,
            cache_grants=[plan_pb2.CacheGrant(node="n1", cache_quota_bytes=2**30, remote_io_bytes_per_s=10**8)],
            cache_policy="lrfu-cost", generation=3, fast_resize=True)],
        replicas=[plan_pb2.InferenceReplica(replica_id="r1", application="infer-1", node="i1", gpu_index=0,
                                            state=plan_pb2.REPLICA_STATE_PROTECT, task_id="job-bbbbbbbbbbbb", reuse_count=2,
                                            protect_until=stamp(datetime(2030, 1, 1, tzinfo=timezone.utc)))],
        loans=[plan_pb2.GpuLoan(node="i1", gpu_index=1, job_id="job-aaaaaaaaaaaa")],
        created_at=stamp(datetime(2030, 1, 1, tzinfo=timezone.utc)),
    )  # fmt: skip
    assert stub.CommitPlan(m.CommitPlanRequest(plan=full)) == full
    assert stub.GetLatestPlan(m.GetLatestPlanRequest()) == full


# -- metrics and models --------------------------------------------------------------------


def test_append_and_query_metrics(stub):
    job = create_job(stub)
    base = datetime(2030, 5, 1, tzinfo=timezone.utc)
    samples = [
        common_pb2.MetricSample(job_id=job.id, time=stamp(base + timedelta(seconds=i)), name=name, value=float(i), labels={"rank": "0"})
        for i in range(10)
        for name in ("step_time_s", "samples_per_s")
    ]
    assert stub.AppendMetrics(m.AppendMetricsRequest(samples=samples)).appended == 20
    # until defaults to now, which is before 2030: nothing yet.
    assert not stub.QueryMetrics(m.QueryMetricsRequest(job_id=job.id)).samples
    window = {"since": stamp(base + timedelta(seconds=2)), "until": stamp(base + timedelta(seconds=5))}
    got = stub.QueryMetrics(m.QueryMetricsRequest(job_id=job.id, name="step_time_s", **window)).samples
    assert [s.value for s in got] == [4.0, 3.0, 2.0], "newest first, since inclusive, until exclusive"
    assert got[0].labels == {"rank": "0"} and got[0].time == stamp(base + timedelta(seconds=4))
    newest = stub.QueryMetrics(m.QueryMetricsRequest(job_id=job.id, until=stamp(base + timedelta(days=1)), limit=3)).samples
    assert [s.value for s in newest] == [9.0, 9.0, 8.0]
    # A sample without a time is stamped by the server.
    stub.AppendMetrics(m.AppendMetricsRequest(samples=[common_pb2.MetricSample(job_id=job.id, name="now", value=1.5)]))
    (now_sample,) = stub.QueryMetrics(m.QueryMetricsRequest(job_id=job.id, name="now")).samples
    assert abs(now_sample.time.ToDatetime(timezone.utc) - datetime.now(timezone.utc)) < timedelta(seconds=30)


def test_put_and_get_job_model(stub):
    job = create_job(stub)
    assert_rpc_error(lambda: stub.GetJobModel(common_pb2.GetJobModelRequest(job_id=job.id)), grpc.StatusCode.NOT_FOUND, "job_id")
    model = common_pb2.JobModelParams(job_id=job.id, application="cifar10", params={"alpha_s": 0.1, "beta_s": 2e-5}, observations=7)
    stored = stub.PutJobModel(m.PutJobModelRequest(model=model))
    assert stored.params == model.params and stored.observations == 7 and stored.HasField("updated_at")
    refit = stub.PutJobModel(m.PutJobModelRequest(model=common_pb2.JobModelParams(job_id=job.id, params={"alpha_s": 0.2}, observations=9)))
    assert stub.GetJobModel(common_pb2.GetJobModelRequest(job_id=job.id)) == refit and refit.params == {"alpha_s": 0.2}


def test_concurrent_heartbeats_each_get_their_own_answer(stub):
    """Heartbeats that arrive together are written together (one transaction); each call still
    gets its node, or its own error with the field named."""
    from concurrent.futures import ThreadPoolExecutor

    names = [f"beat-{i}" for i in range(40)]
    for name in names:
        stub.UpsertNode(m.UpsertNodeRequest(spec=node_spec(name)))
    stub.Heartbeat(m.HeartbeatRequest(node=names[0], applied_plan_version=9))

    def beat(node: str, version: int) -> object:
        try:
            return stub.Heartbeat(m.HeartbeatRequest(node=node, applied_plan_version=version))
        except grpc.RpcError as exc:
            return exc

    requests = [(names[0], 8), ("no-such-node", 1)] + [(name, 2) for name in names[1:]]
    with ThreadPoolExecutor(max_workers=len(requests)) as pool:
        answers = list(pool.map(lambda r: beat(*r), requests))
    refused, missing, *beaten = answers
    assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION and "applied_plan_version" in refused.details()
    assert missing.code() == grpc.StatusCode.NOT_FOUND and "node" in missing.details()
    assert [(n.spec.name, n.applied_plan_version, n.alive) for n in beaten] == [(name, 2, True) for name in names[1:]]
