"""Fast elastic resize (AFE): with ``fast_resize`` the agent keeps surviving ranks running across a
resize, removes ranks without a checkpoint and launches joiners; without it (or when the
survivors' GPUs change) it falls back to checkpoint-and-relaunch."""

from __future__ import annotations

import re
import sys

from silod.v1 import allocation_pb2, plan_pb2
from tests.support.procs import free_port
from tests.worker_agent.conftest import assignment, node_plan, scrape_metrics, wait_until
from worker_agent.gpus import check_exclusive

EXITED = allocation_pb2.TASK_PHASE_EXITED
RUNNING = allocation_pb2.TASK_PHASE_RUNNING
STARTING = allocation_pb2.TASK_PHASE_STARTING
BUDGET = 6000  # 8 samples per 0.02 s step: ~15 s of work, several times what the resizes take
# The last resize of a case doubles the batch (a fast resize takes the new one): the ~5,000 samples
# left then take half the time, still seconds more than the checks of the new world need.
LAST_BATCH = 16


def _ranks(job: str, world: int, generation: int, gpus: list[int] | None = None, *, fast: bool = True,
           batch: int = 8) -> list[plan_pb2.TaskAssignment]:
    tasks = []
    for rank, gpu in enumerate(gpus if gpus is not None else range(world)):
        a = assignment(job, rank, world, [gpu], generation, budget=BUDGET, batch=batch)
        a.fast_resize = fast
        a.spec.env["SILOD_CHECKPOINT_EVERY_S"] = "0.5"
        tasks.append(a)
    return tasks


def _latest(allocation, job, rank, generation):  # type: ignore[no-untyped-def]
    found = [t for t in allocation.task_reports() if (t.job_id, t.rank, t.generation) == (job, rank, generation)]
    return found[-1] if found else None


def _phase(allocation, job, rank, generation) -> int:  # type: ignore[no-untyped-def]
    """The phase of its latest report; RUNNING only once its SDK has reported progress under that
    generation (a rank is RUNNING as soon as its process starts, before its signal handlers are in
    place; a survivor is STARTING until it has re-formed)."""
    report = _latest(allocation, job, rank, generation)
    if report is None:
        return -1
    if report.phase == RUNNING and report.progress.samples_done == 0:
        return STARTING
    return report.phase


def _pids(agent, job: str) -> dict[tuple[int, int], int]:  # type: ignore[no-untyped-def]
    """(rank, generation) -> pid of the job's live tasks, as the agent shows them."""
    return {(t.rank, t.generation): t.pid for t in agent.status().tasks if t.job_id == job and t.state != "exited"}


def test_fast_resize_keeps_survivors_running_across_4_2_4(allocation, start_agent) -> None:  # type: ignore[no-untyped-def]
    metrics_port = free_port()
    agent = start_agent("--metrics-port", str(metrics_port))
    job = "job-afe"
    allocation.push(node_plan(agent.node, 1, *_ranks(job, 4, 1)))
    wait_until(lambda: all(_phase(allocation, job, r, 1) == RUNNING for r in range(4)), what="4 ranks running")
    first = _pids(agent, job)
    assert len(first) == 4 and all(first.values())

    # Shrink to ranks 0 and 1 on GPUs 0 and 1: they survive, 2 and 3 leave without a checkpoint.
    allocation.push(node_plan(agent.node, 2, *_ranks(job, 2, 2)))
    wait_until(lambda: all(_phase(allocation, job, r, 2) == RUNNING for r in range(2)), timeout=30,
               what="survivors running under generation 2")
    wait_until(lambda: all(_phase(allocation, job, r, 1) == EXITED for r in (2, 3)), what="removed ranks exited")
    assert _pids(agent, job) == {(0, 2): first[(0, 1)], (1, 2): first[(1, 1)]}
    for r in (2, 3):
        assert _latest(allocation, job, r, 1).exit_code == 0
        assert "emulated: left the job at samples=" in agent.log(job, r)
        assert "checkpointed at" not in agent.log(job, r)
    assert list(agent.status().free_gpus) == [2, 3]
    shrunk_at = _latest(allocation, job, 0, 2).progress.samples_done

    # Grow back: the survivors move to generation 3, new ranks 2 and 3 join.
    allocation.push(node_plan(agent.node, 3, *_ranks(job, 4, 3, batch=LAST_BATCH)))
    wait_until(lambda: all(_phase(allocation, job, r, 3) == RUNNING for r in range(4)), timeout=30,
               what="all 4 ranks running under generation 3")
    pids = _pids(agent, job)
    assert (pids[(0, 3)], pids[(1, 3)]) == (first[(0, 1)], first[(1, 1)])
    assert pids[(2, 3)] not in first.values() and pids[(3, 3)] not in first.values()

    wait_until(lambda: all(_phase(allocation, job, r, 3) == EXITED for r in range(4)), timeout=120,
               what="the job finished")
    final = _latest(allocation, job, 0, 3)
    assert final.exit_code == 0 and final.progress.samples_done == BUDGET and final.progress.fraction_done == 1.0
    assert final.progress.samples_done > shrunk_at > 0
    log0 = agent.log(job, 0)
    assert log0.count("--- silod: generation") == 1  # launched once
    assert log0.count("emulated: resumed at samples=") == 1 and "resumed at samples=0 " in log0  # never reloaded
    assert re.search(r"emulated: fast resize to rank 0 of 2 generation 2 at samples=\d+", log0)
    assert re.search(r"emulated: fast resize to rank 0 of 4 generation 3 at samples=\d+", log0)
    assert "checkpointed at" not in log0
    # The survivors never reported under an old generation after the resize: no EXITED for them there.
    assert all(_phase(allocation, job, r, g) == RUNNING for r, g in ((0, 1), (1, 1), (0, 2), (1, 2)))
    # Six processes went through the GPU table (4 + 2 joiners), never two on one GPU, all released.
    history = agent.gpu_history()
    check_exclusive(history)
    assert sorted(e["task"] for e in history if e["event"] == "acquire") == sorted(
        [f"{job}/{r}/1" for r in range(4)] + [f"{job}/2/3", f"{job}/3/3"])
    wait_until(lambda: list(agent.status().free_gpus) == [0, 1, 2, 3], what="every GPU free")
    # The agent counted it: two survivors re-formed twice each, two ranks left, the rest ended the job.
    m = scrape_metrics(metrics_port)
    assert m[("silod_agent_reform_seconds_count", frozenset())] == 4
    assert m[("silod_agent_rank_exits_total", frozenset({("cause", "left")}))] == 2
    assert m[("silod_agent_rank_exits_total", frozenset({("cause", "succeeded")}))] == 4


def test_a_survivor_below_which_the_world_shrank_is_renumbered(allocation, start_agent) -> None:  # type: ignore[no-untyped-def]
    # Ranks are 0..world-1, so removing rank 0 renumbers the survivors (matched by their GPUs):
    # the process on GPU 1 becomes rank 0 and writes the job's checkpoints from then on.
    agent = start_agent()
    job = "job-renumber"
    allocation.push(node_plan(agent.node, 1, *_ranks(job, 3, 1)))
    wait_until(lambda: all(_phase(allocation, job, r, 1) == RUNNING for r in range(3)), what="3 ranks running")
    first = _pids(agent, job)
    allocation.push(node_plan(agent.node, 2, *_ranks(job, 2, 2, gpus=[1, 2], batch=LAST_BATCH)))
    wait_until(lambda: all(_phase(allocation, job, r, 2) == RUNNING for r in range(2)), timeout=30,
               what="survivors renumbered and running")
    assert _pids(agent, job) == {(0, 2): first[(1, 1)], (1, 2): first[(2, 1)]}
    wait_until(lambda: _phase(allocation, job, 0, 1) == EXITED, what="old rank 0 exited")
    assert "emulated: left the job at samples=" in agent.log(job, 0)
    wait_until(lambda: re.search(r"emulated: fast resize to rank 0 of 2 generation 2 .*\(was rank 1 of 3\)",
                                 agent.log(job, 1)), what="the survivor's own account of its renumbering")
    wait_until(lambda: _phase(allocation, job, 0, 2) == EXITED, timeout=120, what="the job finished")
    assert _latest(allocation, job, 0, 2).progress.samples_done == BUDGET
    saves = [line for line in (agent.work_dir / "checkpoints" / job / "checkpoints.jsonl").read_text().splitlines()]
    # The final save is the survivor's: generation 2's rank 0, the old rank 1 (its pid above is
    # unchanged; the pid the rank saw itself as is its namespace's where it is contained).
    assert '"generation": 2' in saves[-1] and '"rank": 0' in saves[-1]
    check_exclusive(agent.gpu_history())


def test_fast_resize_falls_back_to_checkpoint_and_relaunch_when_survivors_move(allocation, start_agent) -> None:  # type: ignore[no-untyped-def]
    agent = start_agent()
    job = "job-moved"
    allocation.push(node_plan(agent.node, 1, *_ranks(job, 2, 1, gpus=[0, 1])))
    wait_until(lambda: all(_phase(allocation, job, r, 1) == RUNNING for r in range(2)), what="2 ranks running")
    wait_until(lambda: (_latest(allocation, job, 0, 1).progress.samples_done or 0) > 0, what="progress")
    first = _pids(agent, job)
    # Same world size, other GPUs: no rank keeps its placement, so nothing survives.
    allocation.push(node_plan(agent.node, 2, *_ranks(job, 2, 2, gpus=[2, 3])))
    wait_until(lambda: all(_phase(allocation, job, r, 2) == RUNNING for r in range(2)), timeout=30,
               what="generation 2 relaunched")
    assert not set(_pids(agent, job).values()) & set(first.values())
    log0 = agent.log(job, 0)
    saved = int(re.search(r"checkpointed at samples=(\d+)", log0).group(1))
    assert int(re.findall(r"resumed at samples=(\d+)", log0)[-1]) == saved > 0
    assert "fast resize" not in log0
    check_exclusive(agent.gpu_history())


def test_without_fast_resize_a_shrink_checkpoints_and_relaunches_every_rank(allocation, start_agent) -> None:  # type: ignore[no-untyped-def]
    agent = start_agent()
    job = "job-slow"
    allocation.push(node_plan(agent.node, 1, *_ranks(job, 2, 1, fast=False)))
    wait_until(lambda: all(_phase(allocation, job, r, 1) == RUNNING for r in range(2)), what="2 ranks running")
    first = _pids(agent, job)
    allocation.push(node_plan(agent.node, 2, *_ranks(job, 1, 2, fast=False)))
    wait_until(lambda: _phase(allocation, job, 0, 2) == RUNNING, timeout=30, what="generation 2 running")
    assert _pids(agent, job)[(0, 2)] != first[(0, 1)]
    assert all(_latest(allocation, job, r, 1).phase == EXITED for r in range(2))
    assert "checkpointed at samples=" in agent.log(job, 0) and "fast resize" not in agent.log(job, 0)
    check_exclusive(agent.gpu_history())


def test_pytorch_example_is_told_of_a_fast_resize_through_its_callback(allocation, start_agent) -> None:  # type: ignore[no-untyped-def]
    from tests.support.procs import REPO_ROOT

    agent = start_agent()
    job = "job-torch-afe"
    command = [sys.executable, str(REPO_ROOT / "examples" / "train_cifar_like.py"), "--steps", "100000",
               "--emulated-gpu-s", "0.05", "--batch-size", "16"]
    tasks = [assignment(job, r, 2, [r], 1, command=command) for r in range(2)]
    for a in tasks:
        a.fast_resize = True
    allocation.push(node_plan(agent.node, 1, *tasks))
    wait_until(lambda: all(_phase(allocation, job, r, 1) == RUNNING for r in range(2)), timeout=60,
               what="both ranks training")
    first = _pids(agent, job)
    survivor = assignment(job, 0, 1, [0], 2, command=command)
    survivor.fast_resize = True
    allocation.push(node_plan(agent.node, 2, survivor))
    wait_until(lambda: re.search(r"re-formed at step \d+: rank 0 of 1 \(was 2\), generation 2", agent.log(job, 0)),
               timeout=30, what="the survivor's callback")
    wait_until(lambda: _phase(allocation, job, 1, 1) == EXITED, what="rank 1 left")
    assert _latest(allocation, job, 1, 1).exit_code == 0
    assert re.search(r"stopping at step \d+; exiting", agent.log(job, 1))  # its save_checkpoint wrote nothing
    assert _pids(agent, job) == {(0, 2): first[(0, 1)]}
    wait_until(lambda: _phase(allocation, job, 0, 2) == RUNNING, what="the survivor running under generation 2")
    assert not (agent.work_dir / "checkpoints" / job / "checkpoints.jsonl").exists()  # nobody checkpointed
    check_exclusive(agent.gpu_history())
