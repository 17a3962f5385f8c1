"""The snapshot phase of a live scheduler round (scheduler.live.snapshot.SnapshotBuilder.build)
at scale, on an in-process fake of the metadata service and of the estimator: no gRPC, no
database, only the scheduler's own work on the answers.

    .venv/bin/python benchmarks/snapshot_round.py [--jobs 20000] [--nodes 5000] [--rounds 10]
        [--changes 5] [--reports 0] [--fitted-every 4] [--verify] [--profile N]

``--nodes`` nodes of 8 GPUs (half v100, half p100: every job has a model per type) and ``--jobs``
active jobs of the packaged applications, one GPU each, running while GPUs last (the plan in
force places them), the rest pending; the estimator has a fitted model for one job in
``--fitted-every`` (0: for none).
A first build reads everything; then each of ``--rounds`` steady rounds comes after
``--changes`` jobs ended and as many arrived, every node heartbeated (a new ListNodes answer,
parsed as gRPC would), and ``--reports`` running jobs reported progress.

Prints the first build's time and the steady builds' median, min and max, with the parts of
a steady build that are not the snapshot's own: parsing the ListNodes answer (gRPC's work in a
deployment), the fake's ListJobs, and SnapshotBuilder._current (what the jobs hold under the
plan in force); then the time of a build right after KnownJobs read every job whole (it does
every 30 s, and every job's message is then new), which includes the fake's ListJobs.
``--verify`` then builds a snapshot from scratch with a fresh scheduler on the same state and
checks that it equals the last incremental one. ``--profile N`` prints the N functions of
most own time over the steady builds.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import cProfile
import dataclasses
import logging
import math
import pstats
import statistics
import sys
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from estimator.job_model import JobModel  # noqa: E402
from estimator.profiles import POLLUX_APPLICATIONS  # noqa: E402
from scheduler.live.clients import ACTIVE_STATES  # noqa: E402
from scheduler.live.core import SchedulerCore  # noqa: E402
from silod.v1 import access_pb2, common_pb2, metadata_pb2, plan_pb2  # noqa: E402

GPUS_PER_NODE = 8
GPU_TYPES = ("v100", "p100")
DATASETS = 50
PAGE = 1000


class FakeMetadata:
    """The metadata calls a snapshot makes, answered from memory on a clock the benchmark moves."""

    def __init__(self, nodes: int, jobs: int) -> None:
        self.now = 1_000_000  # seconds; each round moves it on
        self.nodes = [common_pb2.Node(spec=common_pb2.NodeSpec(
            name=f"node-{i:05d}", gpus=GPUS_PER_NODE, gpu_model="emulated", gpu_type=GPU_TYPES[i % len(GPU_TYPES)],
            agent_address=f"node-{i:05d}.local:7000", cache_address=f"node-{i:05d}.local:7001",
            cache_capacity_bytes=1 << 40, memory_cache_bytes=64 << 30, network_bandwidth_bytes_per_s=3 << 30,
            cpus=96.0, memory_bytes=1 << 40, labels={"rack": f"r{i // 40}"}), alive=True) for i in range(nodes)]
        self.jobs: dict[str, tuple[common_pb2.Job, int]] = {}  # id -> (job, time of its last state change)
        self._changes: list[tuple[int, str]] = []  # (time, job id) of every state change, in time order
        self._listing: tuple[tuple[int | None, int], list[common_pb2.Job]] = ((0, 0), [])  # see ListJobs
        self._next_job = 0
        for _ in range(jobs):
            self.arrive()
        self.heartbeat()
        self.list_nodes_s = 0.0  # spent parsing ListNodes answers
        self.list_jobs_s = 0.0  # spent answering ListJobs: the fake's own work

    def arrive(self) -> common_pb2.Job:
        n = self._next_job
        self._next_job += 1
        job = common_pb2.Job(id=f"job-{n:012x}", state=common_pb2.JOB_STATE_PENDING, state_version=1, spec=common_pb2.JobSpec(
            name=f"j{n}", application=POLLUX_APPLICATIONS[n % len(POLLUX_APPLICATIONS)], dataset=f"ds-{n % DATASETS}",
            min_gpus=1, max_gpus=1, batch_size=128, epochs=3, tenant=f"t{n % 7}"))
        job.created_at.FromSeconds(self.now)
        self._changed(job)
        return job

    def move(self, job_id: str, state: int) -> None:
        job, _ = self.jobs[job_id]
        moved = common_pb2.Job()
        moved.CopyFrom(job)
        moved.state, moved.state_version = state, job.state_version + 1
        self._changed(moved)

    def progressed(self, job_id: str, progress: common_pb2.JobProgress) -> None:
        """Progress as the scheduler's ProgressWriter stores it: not a state change."""
        job, at = self.jobs[job_id]
        updated = common_pb2.Job()
        updated.CopyFrom(job)
        updated.progress.CopyFrom(progress)
        self.jobs[job_id] = (updated, at)
        self._listing = ((0, 0), [])  # holds the message replaced: worked out again when next asked

    def _changed(self, job: common_pb2.Job) -> None:
        self.jobs[job.id] = (job, self.now)
        self._changes.append((self.now, job.id))

    def heartbeat(self) -> None:
        for node in self.nodes:
            node.last_heartbeat.FromSeconds(self.now)
        self._nodes_answer = metadata_pb2.ListNodesResponse(nodes=self.nodes).SerializeToString()

    async def ListNodes(self, request):  # noqa: N802
        started = time.perf_counter()
        answer = metadata_pb2.ListNodesResponse.FromString(self._nodes_answer)  # new messages, as gRPC gives
        self.list_nodes_s += time.perf_counter() - started
        return answer

    async def ListJobs(self, request):  # noqa: N802
        started = time.perf_counter()
        if request.job_ids:
            found = [self.jobs[i][0] for i in request.job_ids if i in self.jobs]
        else:
            since = request.state_changed_since.seconds if request.HasField("state_changed_since") else None
            if self._listing[0] != (since, len(self._changes)):  # worked out once for all its pages
                first_change = bisect.bisect_left(self._changes, (since, "")) if since is not None else 0
                ids = dict.fromkeys(i for _, i in self._changes[first_change:])
                self._listing = ((since, len(self._changes)), [self.jobs[i][0] for i in ids])
            found = self._listing[1]
        if request.states:
            states = set(request.states)
            found = [j for j in found if j.state in states]
        if request.view == metadata_pb2.JOB_VIEW_STATE:
            found = [common_pb2.Job(id=j.id, state=j.state, state_version=j.state_version) for j in found]
        first = int(request.page_token or 0)
        reply = metadata_pb2.ListJobsResponse(jobs=found[first:first + PAGE])
        if first + PAGE < len(found):
            reply.next_page_token = str(first + PAGE)
        reply.read_at.FromSeconds(self.now)
        self.list_jobs_s += time.perf_counter() - started
        return reply

    async def ListTenants(self, request):  # noqa: N802
        return access_pb2.ListTenantsResponse()

    async def GetDataset(self, request):  # noqa: N802
        return common_pb2.Dataset(spec=common_pb2.DatasetSpec(name=request.name), num_objects=50_000,
                                  total_bytes=50_000 * 110_000)


class FakeEstimator:
    """A fitted model (the profile's, a little slower) for one job in ``every`` (0: none), NOT_FOUND for the others."""

    def __init__(self, fake: FakeMetadata, every: int) -> None:
        self.fake = fake
        self.every = every

    async def GetJobModel(self, request, timeout=None):  # noqa: N802
        job, _ = self.fake.jobs[request.job_id]
        if not self.every or int(request.job_id[4:], 16) % self.every:
            raise grpc.aio.AioRpcError(grpc.StatusCode.NOT_FOUND, grpc.aio.Metadata(), grpc.aio.Metadata(), "not observed")
        params = JobModel.from_profile(job.spec.application).to_params()
        params["perf.alpha_c_s"] *= 1.25
        return common_pb2.JobModelParams(job_id=job.id, application=job.spec.application, params=params)


def place_running(fake: FakeMetadata) -> plan_pb2.AllocationPlan:
    """Start the pending jobs while GPUs last: the plan in force, and the jobs RUNNING in the store."""
    plan = plan_pb2.AllocationPlan(version=1, policy="fifo", cache_mode="silod")
    free = ((n.spec.name, n.spec.gpu_type, i) for n in fake.nodes for i in range(n.spec.gpus))
    for (job_id, _), (node, gpu_type, index) in zip(list(fake.jobs.items()), free):
        fake.move(job_id, common_pb2.JOB_STATE_RUNNING)
        entry = plan.jobs.add(job_id=job_id, batch_size=128, generation=1, gpu_type=gpu_type)
        entry.placements.add(node=node, gpu_indices=[index])
    return plan


def new_core(fake: FakeMetadata, fitted_every: int) -> SchedulerCore:
    core = SchedulerCore(None, policy="fifo", interval_s=60.0, restart_cost_s=30.0, node_timeout_s=15.0,
                         cache_mode="silod")
    core.md = fake
    core.estimator = FakeEstimator(fake, fitted_every)
    core.jobs.full_every_s = math.inf  # no periodic whole read in the background: rounds stay comparable
    return core


def comparable(snapshot) -> object:  # type: ignore[no-untyped-def]
    return dataclasses.replace(snapshot, time_s=0.0)


async def run(args: argparse.Namespace) -> None:
    fake = FakeMetadata(args.nodes, args.jobs)
    plan = place_running(fake)
    fake.now += 10  # the first round's read is whole: the next one's asks only for what changed after it
    core = new_core(fake, args.fitted_every)
    await core.plans.set_latest(plan)
    await core.warm_up()  # fitting the profiles: once per process, not part of a round
    current_s = [0.0]
    current = core.snapshots._current

    def timed_current(*call_args):  # type: ignore[no-untyped-def]
        started = time.perf_counter()
        try:
            return current(*call_args)
        finally:
            current_s[0] += time.perf_counter() - started

    core.snapshots._current = timed_current

    started = time.perf_counter()
    snapshot, jobs = await core.snapshots.build()
    first_s = time.perf_counter() - started
    print(f"{args.jobs} jobs ({sum(1 for j in jobs if j.state == common_pb2.JOB_STATE_RUNNING)} running), "
          f"{args.nodes} nodes x {GPUS_PER_NODE} GPUs ({'/'.join(GPU_TYPES)}), "
          + (f"one job in {args.fitted_every} fitted" if args.fitted_every else "no job fitted"))
    print(f"first build: {first_s:.3f} s")

    steady: list[float] = []
    parse: list[float] = []
    list_jobs: list[float] = []
    in_current: list[float] = []
    profile = cProfile.Profile() if args.profile else None
    running = [j.id for j in jobs if j.state == common_pb2.JOB_STATE_RUNNING]
    for round_no in range(args.rounds):
        fake.now += 10
        for job_id in running[round_no * args.changes:(round_no + 1) * args.changes]:
            fake.move(job_id, common_pb2.JOB_STATE_SUCCEEDED)
        for _ in range(args.changes):
            fake.arrive()
        fake.heartbeat()
        last = len(running) - round_no * args.reports  # from the other end than the jobs that end
        for job_id in running[last - args.reports:last]:
            progress = common_pb2.JobProgress(samples_done=1000 * (round_no + 1))
            core.jobs.reported(job_id, progress)
            fake.progressed(job_id, progress)
        fake.list_nodes_s, fake.list_jobs_s, current_s[0] = 0.0, 0.0, 0.0
        if profile is not None:
            profile.enable()
        started = time.perf_counter()
        snapshot, jobs = await core.snapshots.build()
        steady.append(time.perf_counter() - started)
        if profile is not None:
            profile.disable()
        parse.append(fake.list_nodes_s)
        list_jobs.append(fake.list_jobs_s)
        in_current.append(current_s[0])
        assert len(snapshot.jobs) == sum(1 for j, _ in fake.jobs.values() if j.state in ACTIVE_STATES)
    print(f"steady build ({args.changes} ended, {args.changes} arrived, {args.reports} reported progress, "
          f"every node heartbeated), {args.rounds} rounds: median {statistics.median(steady) * 1e3:.1f} ms "
          f"(min {min(steady) * 1e3:.1f}, max {max(steady) * 1e3:.1f})")
    print(f"  of which parsing the ListNodes answer (gRPC's part): median {statistics.median(parse) * 1e3:.1f} ms; "
          f"the fake ListJobs: {statistics.median(list_jobs) * 1e3:.1f} ms; "
          f"SnapshotBuilder._current: {statistics.median(in_current) * 1e3:.1f} ms")
    # KnownJobs reads every active job whole now and then (every 30 s): each job's message is new.
    core.jobs.reset()
    started = time.perf_counter()
    snapshot, jobs = await core.snapshots.build()
    print(f"build after a whole read of the jobs (every job's message new): {(time.perf_counter() - started) * 1e3:.1f} ms")
    if profile is not None:
        pstats.Stats(profile).sort_stats("tottime").print_stats(args.profile)
    if args.verify:
        fresh = new_core(fake, args.fitted_every)
        await fresh.plans.set_latest(plan)
        scratch, _ = await fresh.snapshots.build()
        same = comparable(scratch) == comparable(snapshot)
        print(f"verify: the last steady snapshot {'equals' if same else 'DIFFERS FROM'} one built from scratch")
        if not same:
            differing = [f.name for f in dataclasses.fields(snapshot) if f.name != "time_s"
                         and getattr(snapshot, f.name) != getattr(scratch, f.name)]
            jobs_apart = [(a, b) for a, b in zip(snapshot.jobs, scratch.jobs) if a != b][:1]
            raise SystemExit(f"differing: {differing}; first differing job: {jobs_apart}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=20_000, help="active jobs (default 20,000)")
    parser.add_argument("--nodes", type=int, default=5_000, help=f"nodes of {GPUS_PER_NODE} GPUs (default 5,000)")
    parser.add_argument("--rounds", type=int, default=10, help="steady rounds timed (default 10)")
    parser.add_argument("--changes", type=int, default=5, help="jobs that end, and jobs that arrive, before each steady round")
    parser.add_argument("--reports", type=int, default=0, help="running jobs that report progress before each steady round")
    parser.add_argument("--fitted-every", type=int, default=4, metavar="N",
                        help="one job in N has a fitted model at the estimator; 0: none (default 4)")
    parser.add_argument("--verify", action="store_true", help="compare the last snapshot with one built from scratch")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="print the N functions of most own time")
    args = parser.parse_args()
    if args.jobs < 1:
        parser.error(f"--jobs: at least 1, not {args.jobs}")
    if args.nodes < 1:
        parser.error(f"--nodes: at least 1, not {args.nodes}")
    if args.rounds < 1:
        parser.error(f"--rounds: at least 1, not {args.rounds}")
    running = min(args.jobs, args.nodes * GPUS_PER_NODE)
    if args.changes < 0:
        parser.error(f"--changes: 0 or more, not {args.changes}")
    if args.reports < 0:
        parser.error(f"--reports: 0 or more, not {args.reports}")
    if (args.changes + args.reports) * args.rounds > running:
        parser.error(f"--changes plus --reports, times --rounds, must not exceed the {running} running jobs "
                     f"(each round ends and reports on jobs of its own)")
    if args.fitted_every < 0:
        parser.error(f"--fitted-every: 0 or more, not {args.fitted_every}")
    if args.profile < 0:
        parser.error(f"--profile: 0 or more, not {args.profile}")
    # The first build takes seconds: the liveness then warns of a metadata service unseen as long.
    logging.getLogger("silod.scheduler").setLevel(logging.ERROR)
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
