"""The snapshot is made incrementally (scheduler.live.snapshot): a round makes again only the
JobInfos and NodeInfos whose inputs changed. Each test changes one input and checks that what
is made of it changed, that the rest is the very same object, and that the snapshot equals one
made from scratch by a fresh scheduler over the same state."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest
from google.protobuf import timestamp_pb2

from estimator.job_model import JobModel
from scheduler.live import models as models_module
from scheduler.live.core import SchedulerCore
from scheduler.policy import ClusterSnapshot
from silod.v1 import access_pb2, common_pb2, estimator_pb2, metadata_pb2

PENDING, RUNNING, SUCCEEDED = common_pb2.JOB_STATE_PENDING, common_pb2.JOB_STATE_RUNNING, common_pb2.JOB_STATE_SUCCEEDED


class FakeStore:
    """The metadata calls of a snapshot, and an estimator, answered from memory; jobs carry the
    time of their last state change so that KnownJobs reads only what changed."""

    def __init__(self) -> None:
        self.now = 1000
        self.nodes: dict[str, common_pb2.Node] = {}
        self.jobs: dict[str, tuple[common_pb2.Job, int]] = {}
        self.fitted: dict[str, dict[str, float]] = {}  # job -> what GetJobModel answers (none: NOT_FOUND)

    # -- the test's side --
    def add_node(self, name: str, gpus: int = 4, gpu_type: str = "v100", **spec: object) -> None:
        self.nodes[name] = common_pb2.Node(spec=common_pb2.NodeSpec(
            name=name, gpus=gpus, gpu_type=gpu_type, agent_address=f"{name}:7000", cpus=32.0, memory_bytes=1 << 36,
            **spec))

    def add_job(self, job_id: str, state: int = RUNNING, **spec: object) -> common_pb2.Job:
        self.now += 1
        spec = {"application": "cifar10", "min_gpus": 1, "max_gpus": 2, "batch_size": 128, "epochs": 2, **spec}
        job = common_pb2.Job(id=job_id, state=state, state_version=1, spec=common_pb2.JobSpec(**spec))
        job.created_at.FromSeconds(self.now)
        self.jobs[job_id] = (job, self.now)
        return job

    def move(self, job_id: str, state: int) -> None:
        self.now += 1
        job = self._copy(job_id)
        job.state, job.state_version = state, job.state_version + 1
        self.jobs[job_id] = (job, self.now)

    def edit(self, job_id: str, edit) -> common_pb2.Job:  # type: ignore[no-untyped-def]
        """A change to the job that is not a state change (progress, an admin's spec edit)."""
        job = self._copy(job_id)
        edit(job)
        self.jobs[job_id] = (job, self.jobs[job_id][1])
        return job

    def _copy(self, job_id: str) -> common_pb2.Job:
        job = common_pb2.Job()
        job.CopyFrom(self.jobs[job_id][0])
        return job

    # -- the metadata service --
    async def ListNodes(self, request):  # noqa: N802
        answer = metadata_pb2.ListNodesResponse(nodes=list(self.nodes.values()))
        for node in answer.nodes:  # a whole listing each time, as a store from before changed_after answers
            node.last_heartbeat.FromSeconds(self.now)  # heartbeats move on every listing
            node.alive = True
        return metadata_pb2.ListNodesResponse.FromString(answer.SerializeToString())

    async def ListJobs(self, request):  # noqa: N802
        since = request.state_changed_since.seconds if request.HasField("state_changed_since") else None
        found = [job for job, at in self.jobs.values()
                 if (not request.states or job.state in request.states) and (since is None or at >= since)
                 and (not request.job_ids or job.id in request.job_ids)]
        if request.view == metadata_pb2.JOB_VIEW_STATE:
            found = [common_pb2.Job(id=j.id, state=j.state, state_version=j.state_version) for j in found]
        reply = metadata_pb2.ListJobsResponse(jobs=found)
        reply.read_at.CopyFrom(timestamp_pb2.Timestamp(seconds=self.now))
        return reply

    async def ListTenants(self, request):  # noqa: N802
        return access_pb2.ListTenantsResponse()

    async def GetDataset(self, request):  # noqa: N802
        return common_pb2.Dataset(spec=common_pb2.DatasetSpec(name=request.name), num_objects=1000, total_bytes=10**8)

    # -- the estimator --
    async def GetJobModel(self, request, timeout=None):  # noqa: N802
        if request.job_id not in self.fitted:
            raise grpc.aio.AioRpcError(grpc.StatusCode.NOT_FOUND, grpc.aio.Metadata(), grpc.aio.Metadata(), "")
        return common_pb2.JobModelParams(job_id=request.job_id, params=self.fitted[request.job_id])

    async def Observe(self, request, timeout=None):  # noqa: N802
        return estimator_pb2.ObserveResponse(model=common_pb2.JobModelParams(
            job_id=request.job_id, params=self.fitted[request.job_id]))


def _core(store: FakeStore) -> SchedulerCore:
    core = SchedulerCore(None, policy="fifo", interval_s=60.0, restart_cost_s=30.0, node_timeout_s=15.0,
                         cache_mode="silod")
    core.md = store
    core.estimator = store
    return core


def _slower(application: str, factor: float) -> dict[str, float]:
    params = JobModel.from_profile(application).to_params()
    params["perf.alpha_c_s"] *= factor
    return params


class Rounds:
    """A scheduler's snapshots over a FakeStore, each checked against one made from scratch."""

    def __init__(self, store: FakeStore) -> None:
        self.store = store
        self.core = _core(store)

    async def snapshot(self) -> ClusterSnapshot:
        self.store.now += 10  # past KnownJobs' overlap: the next read asks only for what changes after this one
        snap, _ = await self.core.snapshot()
        scratch, _ = await _core(self.store).snapshot()
        assert dataclasses.replace(snap, time_s=0) == dataclasses.replace(scratch, time_s=0)
        return snap


def _jobs(snap: ClusterSnapshot) -> dict:
    return {info.job_id: info for info in snap.jobs}


def _nodes(snap: ClusterSnapshot) -> dict:
    return {info.name: info for info in snap.nodes}


def _cluster() -> FakeStore:
    store = FakeStore()
    for i in range(4):
        store.add_node(f"n{i}", gpu_type="v100" if i % 2 else "p100", cache_capacity_bytes=1 << 30,
                       cache_address=f"n{i}:7001")
    for i in range(6):
        store.add_job(f"job-{i}", dataset="ds" if i % 2 else "")
    store.fitted["job-1"] = _slower("cifar10", 2.0)
    return store


def test_a_job_whose_message_changes_gets_a_new_info_the_others_keep_theirs() -> None:
    async def scenario() -> None:
        store = _cluster()
        rounds = Rounds(store)
        before = _jobs(await rounds.snapshot())
        again = _jobs(await rounds.snapshot())
        assert all(again[j] is before[j] for j in before), "nothing changed: every info is last round's"

        progress = common_pb2.JobProgress(samples_done=512)
        store.edit("job-2", lambda job: job.progress.CopyFrom(progress))
        rounds.core.jobs.reported("job-2", progress)  # progress as the ranks report it: a new message
        edited = store.edit("job-3", lambda job: setattr(job.spec, "batch_size", 256))
        rounds.core.jobs.saw(edited)  # e.g. a move made here, with the job as it is now
        after = _jobs(await rounds.snapshot())
        assert after["job-2"] is not again["job-2"] and after["job-2"].samples_done == 512
        assert after["job-2"].model is again["job-2"].model, "progress changes no model"
        assert after["job-3"].batch_size == 256 and after["job-3"].model.bounds.init_batch_size == 256
        assert all(after[j] is again[j] for j in after if j not in ("job-2", "job-3"))
        assert rounds.core.specs["job-3"].batch_size == 256

    asyncio.run(scenario())


def test_a_new_message_with_nothing_new_for_the_policy_keeps_the_info() -> None:
    async def scenario() -> None:
        store = _cluster()
        store.add_job("queued", state=PENDING)
        rounds = Rounds(store)
        before = _jobs(await rounds.snapshot())
        store.move("queued", RUNNING)  # a new message: nothing the policy sees of it changed
        after = _jobs(await rounds.snapshot())
        assert after["queued"] is before["queued"]
        rounds.core.jobs.reset()  # a whole read of the jobs, as every 30 s: every message new
        again = _jobs(await rounds.snapshot())
        assert all(again[j] is after[j] for j in after)

    asyncio.run(scenario())


def test_a_job_whose_fitted_model_changes_gets_the_new_model(monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario() -> None:
        store = _cluster()
        rounds = Rounds(store)
        before = _jobs(await rounds.snapshot())

        # The estimator's answer to an Observe of ours brings a new fit.
        store.fitted["job-1"] = _slower("cifar10", 3.0)
        await rounds.core.feedback._send_observation(estimator_pb2.ObserveRequest(job_id="job-1"))
        after = _jobs(await rounds.snapshot())
        assert after["job-1"].model != before["job-1"].model
        assert after["job-1"].model.perf.alpha_c == pytest.approx(3.0 * JobModel.from_profile("cifar10").perf.alpha_c)
        assert after["job-1"].type_models != before["job-1"].type_models, "its models per type follow"
        assert all(after[j] is before[j] for j in after if j != "job-1")

        # Re-read when older than the TTL (every round here): a new fit and a first one change
        # their job's model; the same parameters again change nothing.
        monkeypatch.setattr(models_module, "ESTIMATE_TTL_S", 0.0)
        store.fitted["job-1"] = _slower("cifar10", 4.0)
        store.fitted["job-4"] = _slower("cifar10", 1.5)
        again = _jobs(await rounds.snapshot())
        assert again["job-1"].model.perf.alpha_c == pytest.approx(4.0 * JobModel.from_profile("cifar10").perf.alpha_c)
        assert again["job-4"].model != after["job-4"].model
        assert all(again[j] is after[j] for j in again if j not in ("job-1", "job-4"))
        del store.fitted["job-4"]  # NOT_FOUND now: back to the profile's model
        last = _jobs(await rounds.snapshot())
        assert last["job-4"].model == before["job-4"].model and last["job-1"] is again["job-1"]

    asyncio.run(scenario())


def test_a_node_whose_spec_changes_gets_a_new_info_heartbeats_change_nothing() -> None:
    async def scenario() -> None:
        store = _cluster()
        rounds = Rounds(store)
        first = await rounds.snapshot()
        second = await rounds.snapshot()  # only the heartbeats moved
        assert second.nodes is first.nodes and rounds.core.snapshots.node_types["n1"] == "v100"

        store.nodes["n0"].spec.gpus = 2
        store.nodes["n1"].spec.gpu_type = "k80"
        store.nodes["n2"].spec.cache_capacity_bytes = 1 << 31
        third = await rounds.snapshot()
        before, after = _nodes(second), _nodes(third)
        assert after["n0"].gpus == 2 and after["n1"].gpu_type == "k80"
        assert after["n2"].cache_capacity_bytes == float(1 << 31)
        assert after["n3"] is before["n3"]
        assert rounds.core.snapshots.node_types["n1"] == "k80"
        assert [n.name for n in third.nodes] == ["n0", "n1", "n2", "n3"]
        # A third GPU type: every job's models per type are made again, with it.
        assert all("k80" in info.type_models for info in third.jobs)

        store.add_node("m0", gpus=8, gpu_type="v100", cache_address="m0:7001")
        del store.nodes["n3"]
        store.add_node("empty", gpus=0)  # no GPUs: not the policy's
        fourth = await rounds.snapshot()
        assert [n.name for n in fourth.nodes] == ["m0", "n0", "n1", "n2"]
        assert rounds.core.plans.agent_addresses["m0"] == "m0:7000"
        assert rounds.core.rank_room == frozenset({(32.0, 1 << 36)})

    asyncio.run(scenario())


def test_faulted_gpus_reach_the_usable_gpus_without_a_spec_change() -> None:
    async def scenario() -> None:
        store = _cluster()
        rounds = Rounds(store)
        await rounds.snapshot()
        assert rounds.core.snapshots.usable.faulted == {}
        store.nodes["n1"].gpu_faults.add(index=2, reason="Xid 79")
        await rounds.snapshot()
        assert rounds.core.snapshots.usable.faulted == {"n1": frozenset({2})}
        del store.nodes["n1"].gpu_faults[:]
        await rounds.snapshot()
        assert rounds.core.snapshots.usable.faulted == {}

    asyncio.run(scenario())


def test_a_finished_job_is_forgotten_and_one_arriving_is_made() -> None:
    async def scenario() -> None:
        store = _cluster()
        rounds = Rounds(store)
        await rounds.snapshot()
        models = rounds.core.models
        assert "job-1" in models.profiles and "job-1" in models.fitted
        rounds.core.feedback._observed["job-1"] = ("last observation",)

        store.move("job-1", SUCCEEDED)
        store.add_job("job-new", dataset="ds2")
        snap = await rounds.snapshot()
        assert "job-1" not in _jobs(snap) and "job-new" in _jobs(snap)
        assert "job-1" not in models.profiles and "job-1" not in models.fitted
        assert "job-1" not in rounds.core.feedback._observed
        assert "job-new" in models.profiles and rounds.core.specs["job-new"].dataset == "ds2"

    asyncio.run(scenario())


def test_an_inference_job_is_kept_apart() -> None:
    async def scenario() -> None:
        store = _cluster()
        store.add_job("serve", application="", kind=common_pb2.JOB_KIND_INFERENCE, max_gpus=1)
        rounds = Rounds(store)
        snap = await rounds.snapshot()
        assert "serve" not in _jobs(snap) and "serve" in rounds.core.specs
        store.move("serve", SUCCEEDED)
        assert "serve" not in _jobs(await rounds.snapshot())

    asyncio.run(scenario())
