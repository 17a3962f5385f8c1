"""Live scheduler throughput: job submissions over gRPC, and one round with many pending jobs.

    .venv/bin/python benchmarks/live_scheduler.py [--jobs 1000] [--nodes 64] [--threads 8] [--client asyncio]

Part 1 starts real ``silod metadata`` (SQLite) and ``silod scheduler`` processes on loopback
and submits ``--jobs`` jobs over gRPC, ``--threads`` at a time (each submission is persisted
before it is acknowledged). The default client keeps them in flight as tasks of one asyncio
event loop; ``--client threads`` uses that many blocking threads, as the script did before,
which costs the client (on the machine it shares with the services) about 50 % more CPU per
call. Target: at least 200 submissions/s sustained. Before timing, one job per application
goes through a round and is cancelled (see warm_up).

Part 2 registers ``--nodes`` nodes of 8 GPUs and times one scheduling round over the pending
jobs in-process (snapshot from the metadata service, policy, invariant check, plan commit)
— the same code the scheduler process runs, with its garbage-collector setting
(``gc_young_threshold``). Target: under 1 s for 1,000 pending jobs on 64
nodes. Then ``--steady-rounds`` (3) steady rounds, each after ``--churn`` placed jobs end and as many arrive (a
running cluster, where a round changes few jobs): their median, against the live targets
(1 s for fifo, sjf and tiresias; 2 s for the others).

Both parts also print the CPU seconds the processes involved used (Linux /proc), and the
machine's load average: on a shared machine the wall-clock figures mostly measure the
neighbours, while the CPU cost per submission or round is what the code itself costs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from scheduler import service as scheduler_service
from scheduler.live.jobs import OVERLAP_S
from scheduler.policies.memo import memo_of
from services.runtime import gc_pauses
from silod.rpc.channels import open_channel
from silod.launcher import start_service
from silod.v1 import common_pb2, metadata_pb2, metadata_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

APPLICATIONS = ("cifar10", "bert", "ncf", "imagenet", "deepspeech2", "yolov3")


def _spec(i: int) -> common_pb2.JobSpec:
    gpus = 1 + i % 4
    return common_pb2.JobSpec(name=f"bench-{i}", application=APPLICATIONS[i % len(APPLICATIONS)],
                              min_gpus=gpus, max_gpus=gpus, batch_size=128, epochs=1)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far, all threads (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _plan_jobs(metadata: metadata_pb2_grpc.MetadataServiceStub) -> set[str]:
    try:
        return {j.job_id for j in metadata.GetLatestPlan(metadata_pb2.GetLatestPlanRequest()).jobs}
    except grpc.RpcError:
        return set()


def _wait(condition, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)


def warm_up(scheduler_addr: str, metadata_addr: str) -> None:
    """One job per application through a round, then cancelled: a scheduler process fits each
    application's profile once, the first time it meets one (seconds of CPU in all), which is
    start-up, not sustained, cost."""
    with open_channel(scheduler_addr) as channel, open_channel(metadata_addr) as md_channel:
        stub = scheduler_pb2_grpc.JobServiceStub(channel)
        metadata = metadata_pb2_grpc.MetadataServiceStub(md_channel)
        ids = {stub.SubmitJob(scheduler_pb2.SubmitJobRequest(
            spec=common_pb2.JobSpec(name=f"warm-up-{app}", application=app, min_gpus=1, max_gpus=1, batch_size=128,
                                    epochs=1))).id for app in APPLICATIONS}
        _wait(lambda: ids <= _plan_jobs(metadata), "a round over the warm-up jobs")
        for job_id in ids:
            stub.CancelJob(scheduler_pb2.CancelJobRequest(job_id=job_id, reason="benchmark warm-up"))
        _wait(lambda: not ids & _plan_jobs(metadata), "a round after the warm-up jobs were cancelled")


def submit_jobs(scheduler_addr: str, jobs: int, threads: int, client: str = "asyncio") -> float:
    """Submissions per second, from the first send to the last acknowledgement, with ``threads``
    submissions in flight: asyncio tasks on one channel (``client="asyncio"``), or blocking
    calls from that many threads (``"threads"``; Python threads contending for the GIL cost the
    client about 50 % more CPU per call, and the client shares the machine with the services)."""
    if client == "threads":
        channel = open_channel(scheduler_addr)
        stub = scheduler_pb2_grpc.JobServiceStub(channel)

        def one(i: int) -> str:
            return stub.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=_spec(i), client_request_id=f"bench-{i}")).id

        started = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            ids = list(pool.map(one, range(jobs)))
        elapsed = time.perf_counter() - started
        channel.close()
    else:
        ids, elapsed = asyncio.run(_submit_async(scheduler_addr, jobs, threads))
    assert len(set(ids)) == jobs, "every submission must create one job"
    return jobs / elapsed


async def _submit_async(scheduler_addr: str, jobs: int, concurrency: int) -> tuple[list[str], float]:
    channel = open_channel(scheduler_addr, aio=True)
    stub = scheduler_pb2_grpc.JobServiceStub(channel)
    ids = [""] * jobs
    todo = iter(range(jobs))

    async def submitter() -> None:
        for i in todo:
            reply = await stub.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=_spec(i), client_request_id=f"bench-{i}"))
            ids[i] = reply.id

    try:
        started = time.perf_counter()
        await asyncio.gather(*(submitter() for _ in range(concurrency)))
        return ids, time.perf_counter() - started
    finally:
        await channel.close()


async def register_nodes(md: metadata_pb2_grpc.MetadataServiceStub, nodes: int, concurrency: int = 64) -> None:
    # Concurrently: one by one, 1,000 registrations took longer than the scheduler's node-poll
    # rhythm, and the timed round then warned that the metadata service had been unreachable.
    gate = asyncio.Semaphore(concurrency)

    async def register(n: int) -> None:
        async with gate:
            await md.UpsertNode(metadata_pb2.UpsertNodeRequest(spec=common_pb2.NodeSpec(
                name=f"bench-node-{n}", gpus=8, pool=common_pb2.NODE_POOL_TRAINING, gpu_model="emulated",
                agent_address=f"127.0.0.1:{20000 + n}")))

    await asyncio.gather(*(register(n) for n in range(nodes)))


async def heartbeat_nodes(md: metadata_pb2_grpc.MetadataServiceStub, nodes: int, concurrency: int = 64) -> None:
    # As many in flight as register_nodes: 5,000 at once were CANCELLED.
    gate = asyncio.Semaphore(concurrency)

    async def beat(n: int) -> None:
        async with gate:
            await md.Heartbeat(metadata_pb2.HeartbeatRequest(node=f"bench-node-{n}"))

    await asyncio.gather(*(beat(n) for n in range(nodes)))


async def time_round(metadata_addr: str, policy: str, nodes: int, metadata_pid: int,
                     steady_rounds: int = 3, churn: int = 50,
                     ) -> tuple[float, float, int, list[tuple[float, float, dict[str, float]]]]:
    """Seconds for one in-process round, CPU seconds it took (this process and the metadata
    service), how many jobs the committed plan places; then ``steady_rounds`` rounds after
    ``churn`` placed jobs end and as many new ones arrive, each (seconds, CPU seconds, seconds
    by phase): the rounds of a running cluster, where few jobs change."""
    # A 60-s node timeout, as live_scale.py's: registering 5,000 nodes takes 11 to 16 s here, and
    # under the default 15 s the first nodes aged out before the first round (12,272 jobs placed
    # of 16,000 in one run, and the next round a whole pass when they came back).
    settings = scheduler_service.Settings(metadata_address=metadata_addr, policy=policy, interval_s=3600,
                                          node_timeout_s=60, log_level="warning")
    definition = scheduler_service.definition(settings)
    core = definition.core  # type: ignore[attr-defined]
    if settings.gc_young_threshold:  # as the scheduler service does once started (services.runtime.server)
        gc_pauses.tune(settings.gc_young_threshold)
    channel = open_channel(metadata_addr, aio=True, default_timeout_s=120)
    core.md = metadata_pb2_grpc.MetadataServiceStub(channel)
    try:
        # Profiles are fitted once per application, the first time a round meets one: not timed.
        await core.warm_up()
        # Registered just before the round: on a loaded machine the warm-up may outlast even that
        # window for nodes registered earlier, and the round would see fewer GPUs.
        await register_nodes(core.md, nodes)
        cpu_before = cpu_seconds(os.getpid()) + cpu_seconds(metadata_pid)
        started = time.perf_counter()
        plan = await core.run_round("benchmark")
        elapsed = time.perf_counter() - started
        cpu = cpu_seconds(os.getpid()) + cpu_seconds(metadata_pid) - cpu_before
        placed = sum(1 for job in plan.jobs if job.placements) if plan is not None else 0
        if placed < (steady_rounds + 1) * churn:  # the ended jobs' GPUs stay held (below): it would run dry
            raise SystemExit(f"live_scheduler: --churn {churn}: the first round placed {placed} jobs and each of "
                             f"{steady_rounds} steady rounds ends {churn} more; use --churn "
                             f"{placed // (steady_rounds + 1)} or less, or more --nodes")
        steady = []
        for r in range(steady_rounds):
            # Rounds of a running cluster are seconds apart: the scheduler's incremental job read
            # re-reads the changes of its overlap window (scheduler.live.jobs), not a burst of
            # thousands of moves made a moment ago.
            await asyncio.sleep(OVERLAP_S + 0.5)
            running = [job.job_id for job in core.latest.jobs if job.placements][:churn]
            for job_id in running:  # they end ...
                await core.md.TransitionJob(metadata_pb2.TransitionJobRequest(
                    job_id=job_id, expected_state=common_pb2.JOB_STATE_SCHEDULED,
                    new_state=common_pb2.JOB_STATE_CANCELLED, message="benchmark churn"))
            for i in range(churn):  # ... and as many arrive
                await core.md.CreateJob(metadata_pb2.CreateJobRequest(spec=_spec(100_000 * (r + 1) + i)))
            await heartbeat_nodes(core.md, nodes)  # the nodes stay alive, as agents keep them
            cpu_before = cpu_seconds(os.getpid()) + cpu_seconds(metadata_pid)
            started = time.perf_counter()
            await core.run_round("benchmark")
            phases = dict(getattr(core, "last_round_seconds", {}))
            queue = memo_of(core.policy)  # fifo's queue, sjf's and tiresias' ranked jobs: did the round use them?
            if queue is not None:
                phases["policy from its queue" if queue.last_call == "queue" else f"whole pass ({queue.why_whole})"] = -1
            steady.append((time.perf_counter() - started,
                           cpu_seconds(os.getpid()) + cpu_seconds(metadata_pid) - cpu_before, phases))
            still = sum(1 for job in core.latest.jobs if job.placements)
            # The ended jobs' GPUs stay held until a node acks their release, and no agent runs
            # here: a steady round places the survivors.
            assert still > (placed - (r + 1) * churn) // 2, \
                f"a steady round placed {still} jobs, the first {placed} ({(r + 1) * churn} ended): nodes aged out?"
    finally:
        await channel.close()
    return elapsed, cpu, placed, steady


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--threads", type=int, default=8, help="submissions in flight at a time")
    parser.add_argument("--client", choices=("asyncio", "threads"), default="asyncio",
                        help="how the submissions are kept in flight (see submit_jobs)")
    parser.add_argument("--policy", default="fifo")
    parser.add_argument("--churn", type=int, default=50, help="jobs that end and arrive before each steady round")
    parser.add_argument("--steady-rounds", type=int, default=3,
                        help="steady rounds to time after the first round (fifo answers the first of them with a "
                             "whole pass that builds its queue)")
    args = parser.parse_args(argv)
    for flag in ("jobs", "nodes", "threads"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag}: must be >= 1, got {getattr(args, flag)}")
    if args.churn < 0:
        parser.error(f"--churn: must be >= 0, got {args.churn}")
    if args.steady_rounds < 1:
        parser.error(f"--steady-rounds: must be >= 1, got {args.steady_rounds}")
    print(f"$ python benchmarks/live_scheduler.py --jobs {args.jobs} --nodes {args.nodes} "
          f"--threads {args.threads} --policy {args.policy} --client {args.client}")
    with tempfile.TemporaryDirectory(prefix="silod-bench-") as tmp:
        workdir = Path(tmp)
        with start_service("metadata", "--db", f"sqlite:///{workdir / 'm.db'}", "--log-level", "warning",
                           workdir=workdir) as metadata:
            with start_service("scheduler", "--metadata-address", metadata.address, "--interval-s", "3600",
                               "--log-level", "warning", workdir=workdir) as scheduler:
                warm_up(scheduler.address, metadata.address)
                pids = (os.getpid(), scheduler.pid, metadata.pid)
                cpu_before = [cpu_seconds(pid) for pid in pids]
                rate = submit_jobs(scheduler.address, args.jobs, args.threads, args.client)
                ms = [(cpu_seconds(pid) - before) * 1000 / args.jobs for pid, before in zip(pids, cpu_before)]
                print(f"submissions: {args.jobs} jobs over gRPC, {rate:,.0f}/s sustained  [target >= 200/s: "
                      f"{'ok' if rate >= 200 else 'MISSED'}]; CPU {sum(ms):.1f} ms per submission "
                      f"(client {ms[0]:.2f}, scheduler {ms[1]:.2f}, metadata {ms[2]:.2f})")
            seconds, cpu, placed, steady = asyncio.run(time_round(metadata.address, args.policy, args.nodes, metadata.pid,
                                                                  steady_rounds=args.steady_rounds, churn=args.churn))
            print(f"round: {args.jobs} pending jobs on {args.nodes} nodes x 8 GPUs, {args.policy}: {seconds:.2f} s, "
                  f"{placed} jobs placed  [target < 1 s: {'ok' if seconds < 1 else 'MISSED'}]; CPU {cpu:.2f} s "
                  "(scheduler and metadata)")
            wall, cpus = sorted(w for w, _, _ in steady), sorted(c for _, c, _ in steady)
            target = 1.0 if args.policy in ("fifo", "sjf", "tiresias") else 2.0
            print(f"steady round ({args.churn} placed jobs end and {args.churn} arrive before each; median of "
                  f"{len(steady)}): {wall[len(wall) // 2]:.2f} s  [target <= {target:g} s: "
                  f"{'ok' if wall[len(wall) // 2] <= target else 'MISSED'}]; CPU {cpus[len(cpus) // 2]:.2f} s "
                  "(scheduler and metadata)")
            for n, (_, _, phases) in enumerate(steady, start=1):
                if phases:
                    print(f"  steady round {n} by phase: " + ", ".join(f"{k} {v:.2f} s" if v >= 0 else k
                                                                         for k, v in phases.items()))
    print(f"load average over the last minute: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
