"""A real DDP job (examples/train_ddp_digits.py: PyTorch, gloo, scikit-learn's digits as PNG
files in a real S3-protocol store, read through each node's cache server with silod.data) on
two real worker agents, resized in place 2 -> 4 -> 1 -> 4
ranks across both nodes in the middle of epochs. The plans come from a scripted
AllocationService (the scheduler's decisions are not under test here; its NodePlans are built
with the scheduler's own convert.node_plan).

Checked from the ranks' logs: after every step all ranks hold identical parameters; every
sample of every epoch was trained on exactly once; the loss goes down; surviving processes kept
their pids (re-formed in place, not relaunched)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import contextlib

import grpc

from scheduler.live import convert
from silod.v1 import allocation_pb2, cache_pb2, cache_pb2_grpc, common_pb2, plan_pb2
from tests.cache_server.harness import moto_s3, register
from tests.support.contained import readable
from tests.support.procs import start_service
from tests.worker_agent.conftest import wait_until

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_ddp_digits.py"
JOB = "job-ddp-digits"
# Enough work that each resize comes mid-training: a grow is held (the ranks train on at the old
# size) while its newcomers start, which takes seconds on a busy machine. The three resizes used
# about 7 % of 6 epochs' steps at load 9 (newcomers start warm); 4 epochs keep a wide margin and
# spend little time training on after the last resize, which is all the rest of the test does.
EPOCHS = 4
DIGITS = 1797
BATCH = 64
# The last grow is the one that can come too late: its newcomers start while the one rank left
# trains on, and their warm processes may still be refilling after the first grow (one run at
# load 15 trained the last 111 steps at one rank in 11 s and ended before they checked in, so
# the job never trained at 4 ranks again). The one-rank phase runs at a quarter of the batch, as
# an elastic scheduler sizes a one-GPU job's batch down: each of its steps takes a quarter of the
# samples, so the samples left last four times the steps while the newcomers start, and the
# last world (back at BATCH) still trains on most of them.
ONE_RANK_BATCH = BATCH // 4


def _steps(agents) -> list[dict]:  # type: ignore[no-untyped-def]
    found = []
    for agent in agents:
        for log in (agent.work_dir / "jobs" / JOB).glob("rank-*.log"):
            for line in log.read_text(errors="replace").splitlines():
                if line.startswith("step {"):
                    found.append(json.loads(line[5:]))
    return found


def _pids(agents) -> dict[tuple[str, int], int]:  # type: ignore[no-untyped-def]
    return {(a.node, t.rank): t.pid for a in agents for t in a.status().tasks if t.job_id == JOB and t.pid}


def test_a_ddp_job_grows_and_shrinks_in_place_across_two_nodes(metadata, allocation, start_agent, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import s3fs

    store = tmp_path / "digits"
    subprocess.run([sys.executable, str(EXAMPLE), "prepare", str(store)], check=True, capture_output=True, timeout=120)
    with contextlib.ExitStack() as stack:
        endpoint = stack.enter_context(moto_s3())
        s3 = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint})
        s3.mkdir("digits-bucket")
        s3.put(str(store) + "/", "digits-bucket/png/", recursive=True)
        register(metadata.address, "ddp-digits", "s3://digits-bucket/png", f"endpoint_url={endpoint}")
        caches = [stack.enter_context(start_service(
            "cache-server", "--metadata-address", metadata.address, "--disk-cache-dir", str(tmp_path / f"cache-{i}"),
            "--memory-cache-bytes", "0", "--no-fsync", "--log-level", "warning", workdir=tmp_path / f"cache-proc-{i}"))
            for i in range(2)]
        # One checkpoint root for both nodes, as shared storage would be in a cluster: a restart on
        # the other node and a rank launched after the training ended (it finds rank 0's mark) need it.
        # Warm processes (worker_agent.warm_start), as deployments run agents: newcomers start in them.
        agents = [start_agent("--cache-address", caches[i].address, "--checkpoint-root", str(tmp_path / "checkpoints"),
                              "--warm-processes", "2", gpus=2, node=f"ddp-n{i}") for i in range(2)]
        _train_and_resize(agents, caches, allocation)


def _train_and_resize(agents, caches, allocation) -> None:  # type: ignore[no-untyped-def]
    spec = common_pb2.JobSpec(
        name="ddp-digits", min_gpus=1, max_gpus=4, batch_size=BATCH, epochs=EPOCHS, dataset="ddp-digits",
        resize_in_place=True, command=[sys.executable, str(EXAMPLE)],
        env={"SILOD_EXAMPLE_STEP_SLEEP_S": "0.04", "SILOD_CHECKPOINT_EVERY_S": "2"},
    )
    addresses = {a.node: a.address for a in agents}
    previous: dict[str, plan_pb2.JobAllocation] = {}
    version = 0

    def place(generation: int, layout: dict[int, list[int]], batch: int = BATCH) -> None:  # node index -> GPUs
        nonlocal version, previous
        version += 1
        plan = plan_pb2.AllocationPlan(version=version)
        entry = plan.jobs.add(job_id=JOB, batch_size=batch, generation=generation, fast_resize=generation > 1)
        for i, gpus in sorted(layout.items()):
            entry.placements.add(node=agents[i].node, gpu_indices=gpus)
        convert.assign_master_ports(plan, previous)
        previous = {JOB: entry}
        for agent in agents:
            allocation.push(convert.node_plan(plan, agent.node, {JOB: spec}, addresses))

    def trained_with(world: int, after: int = 0):  # type: ignore[no-untyped-def]
        return lambda: [s for s in _steps(agents) if s["world"] == world and s["step"] > after]

    place(1, {0: [0, 1]})
    wait_until(trained_with(2), 120, "steps with 2 ranks")
    pids = _pids(agents)
    place(2, {0: [0, 1], 1: [0, 1]})
    grown = wait_until(trained_with(4), 120, "steps with 4 ranks on both nodes")
    assert _pids(agents)[(agents[0].node, 0)] == pids[(agents[0].node, 0)], "rank 0 survived the grow"
    place(3, {0: [0]}, batch=ONE_RANK_BATCH)
    alone = wait_until(trained_with(1, after=max(s["step"] for s in grown)), 120, "steps with 1 rank")
    assert all(s["batch"] == ONE_RANK_BATCH for s in alone), "the shrink's batch size took effect with it"
    place(4, {0: [0, 1], 1: [0, 1]})

    def finished():  # type: ignore[no-untyped-def]
        reports = [t for t in allocation.task_reports() if t.job_id == JOB and t.generation == 4]
        exited = {t.rank: t.exit_code for t in reports if t.phase == allocation_pb2.TASK_PHASE_EXITED}
        return exited if len(exited) == 4 else None

    exits = wait_until(finished, 240, "all four ranks of the last world to finish")
    logs = "\n".join(a.log(JOB, r) for a in agents for r in range(2))
    assert exits == {0: 0, 1: 0, 2: 0, 3: 0}, logs[-4000:]
    steps = _steps(agents)

    # The worlds the job trained in, in order: each resize took effect.
    worlds = []
    for s in sorted(steps, key=lambda s: s["step"]):
        if not worlds or worlds[-1] != s["world"]:
            worlds.append(s["world"])
    assert worlds == [2, 4, 1, 4]
    last_world = [s for s in steps if s["world"] == 4 and s["step"] > max(a["step"] for a in alone)]
    assert last_world and all(s["batch"] == BATCH for s in last_world), "the last grow restored the batch size"
    assert "re-formed in place" in logs
    # Every group was formed as a GPU job's is, under a backend that refuses CPU tensors as NCCL does.
    assert "training on cpu (backend cpu:gloo,cuda:cudaonly)" in logs, logs[-4000:]
    # The ranks above ran in warm processes: the first grow's two newcomers on the second node at least.
    warm = [a.proc.log().count('"warm": true') for a in agents]
    assert warm[1] >= 2 and sum(warm) >= 4, warm

    # Identical replicas after every step: one hash per step, reported by every rank of that world.
    by_step: dict[int, list[dict]] = defaultdict(list)
    for s in steps:
        by_step[s["step"]].append(s)
    for number, reports in by_step.items():
        assert len(reports) == reports[0]["world"], f"step {number}: {len(reports)} ranks logged it"
        assert len({r["hash"] for r in reports}) == 1, f"step {number}: replicas differ"

    # Exactly once: the positions trained on in each epoch are every sample, none twice.
    reads: dict[int, list[int]] = defaultdict(list)
    for s in steps:
        reads[s["epoch"]].extend(s["read"])
    assert sorted(reads) == list(range(EPOCHS))
    for epoch, positions in reads.items():
        assert sorted(positions) == list(range(DIGITS)), f"epoch {epoch} read some samples twice or never"
    # The resizes came in the middle of epochs: the first step of each new world started there.
    firsts = [s for s in sorted(steps, key=lambda s: s["step"])
              if s["step"] > 1 and s["rank"] == 0 and s["world"] != by_step[s["step"] - 1][0]["world"]]
    assert len(firsts) == 3 and all(s["start"] > 0 for s in firsts), [(s["world"], s["start"]) for s in firsts]
    # The loss goes down.
    losses = [s["loss"] for s in sorted(steps, key=lambda s: s["step"]) if s["rank"] == 0 and s["loss"] is not None]
    assert sum(losses[-10:]) / 10 < 0.5 * sum(losses[:10]) / 10

    # The samples came through the nodes' cache servers from the S3 store.
    served = 0
    for cache in caches:
        with grpc.insecure_channel(cache.address) as channel:
            stats = cache_pb2_grpc.CacheServiceStub(channel).Stats(cache_pb2.StatsRequest(job_id=JOB), timeout=10)
        served += sum(j.hits + j.misses for j in stats.jobs)
    assert served >= EPOCHS * DIGITS


def test_a_re_form_that_cannot_complete_falls_back_to_checkpoint_restart(metadata, allocation, start_agent,  # type: ignore[no-untyped-def]
                                                                         tmp_path) -> None:
    """A grow whose newcomer never checks in (its node never got the plan): rank 0 holds the new
    world for the re-form timeout, switches anyway, the group does not form, and rank 0 saves the
    checkpoint and exits 75, the status that asks the scheduler for a restart from it. Under the
    NCCL stand-in, as every DDP job of the suite."""
    store = tmp_path / "digits"
    subprocess.run([sys.executable, str(EXAMPLE), "prepare", str(store)], check=True, capture_output=True, timeout=120)
    register(metadata.address, "ddp-digits-fallback", f"file://{store}")
    agent = start_agent("--checkpoint-root", str(tmp_path / "checkpoints"), *readable(store), gpus=1,
                        node="fallback-n0")
    spec = common_pb2.JobSpec(
        name="ddp-fallback", min_gpus=1, max_gpus=2, batch_size=32, epochs=50, dataset="ddp-digits-fallback",
        resize_in_place=True, command=[sys.executable, str(EXAMPLE)],
        env={"SILOD_EXAMPLE_STEP_SLEEP_S": "0.05", "SILOD_CHECKPOINT_EVERY_S": "600", "SILOD_REFORM_TIMEOUT_S": "4"},
    )
    job = "job-ddp-fallback"
    previous: dict[str, plan_pb2.JobAllocation] = {}
    addresses = {agent.node: agent.address, "ghost-node": "127.0.0.1:9"}
    for version, layout in enumerate(([(agent.node, [0])], [(agent.node, [0]), ("ghost-node", [0])]), start=1):
        plan = plan_pb2.AllocationPlan(version=version)
        entry = plan.jobs.add(job_id=job, batch_size=32, generation=version, fast_resize=version > 1)
        for node, gpus in layout:
            entry.placements.add(node=node, gpu_indices=gpus)
        convert.assign_master_ports(plan, previous)
        previous = {job: entry}
        allocation.push(convert.node_plan(plan, agent.node, {job: spec}, addresses))
        if version == 1:
            wait_until(lambda: "step {" in agent.log(job, 0), 120, "the first steps at one rank")

    def exited():  # type: ignore[no-untyped-def]
        return [t for t in allocation.task_reports()
                if t.job_id == job and t.phase == allocation_pb2.TASK_PHASE_EXITED] or None

    report = wait_until(exited, 120, "rank 0 to give up the re-form")[0]
    log = agent.log(job, 0)
    assert report.exit_code == 75, log[-3000:]
    assert "falling back to checkpoint-restart (checkpoint saved), exit 75" in log, log[-3000:]
    assert "training on cpu (backend cpu:gloo,cuda:cudaonly)" in log
    import torch

    state = torch.load(tmp_path / "checkpoints" / job / "checkpoint.pt", weights_only=False)
    steps = [json.loads(line[5:])["step"] for line in log.splitlines() if line.startswith("step {")]
    assert state["steps"] == max(steps) > 0  # the checkpoint holds the last step trained
