"""The worker agent as a real process against in-process metadata and a scripted AllocationService."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
import time

import grpc
import pytest

from silod.v1 import allocation_pb2, common_pb2, metadata_pb2, worker_agent_pb2
from tests.support.procs import free_port
from tests.worker_agent.conftest import assignment, node_plan, scrape_metrics, wait_until
from worker_agent.gpus import check_exclusive

EXITED = allocation_pb2.TASK_PHASE_EXITED
RUNNING = allocation_pb2.TASK_PHASE_RUNNING
STARTING = allocation_pb2.TASK_PHASE_STARTING


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for whoever inherited it does not count)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _node(metadata, name):  # type: ignore[no-untyped-def]
    nodes = metadata.stub.ListNodes(metadata_pb2.ListNodesRequest(), timeout=5).nodes
    return next((n for n in nodes if n.spec.name == name), None)


def _phases(allocation, job, rank, generation=1):  # type: ignore[no-untyped-def]
    seq = []
    for t in allocation.task_reports():
        if (t.job_id, t.rank, t.generation) == (job, rank, generation) and (not seq or seq[-1] != t.phase):
            seq.append(t.phase)
    return seq


def _latest(allocation, job, rank, generation):  # type: ignore[no-untyped-def]
    found = [t for t in allocation.task_reports() if (t.job_id, t.rank, t.generation) == (job, rank, generation)]
    return found[-1] if found else None


def _training(allocation, job, rank, generation=1) -> bool:  # type: ignore[no-untyped-def]
    """RUNNING and its SDK has reported progress: its signal handlers are in place. (A rank is
    RUNNING as soon as its process started, whether or not it uses the SDK.)"""
    report = _latest(allocation, job, rank, generation)
    return report is not None and report.phase == RUNNING and report.progress.samples_done > 0


def test_registers_with_metadata_and_heartbeats(metadata, start_agent) -> None:  # type: ignore[no-untyped-def]
    agent = start_agent()
    node = wait_until(lambda: _node(metadata, agent.node), what="node registered")
    assert node.spec.agent_address == agent.address
    assert (node.spec.gpus, node.spec.gpu_model, node.spec.pool) == (4, "emulated", common_pb2.NODE_POOL_TRAINING)
    first = node.last_heartbeat.ToMicroseconds()
    wait_until(lambda: _node(metadata, agent.node).last_heartbeat.ToMicroseconds() > first, what="a later heartbeat")
    assert _node(metadata, agent.node).alive
    status = agent.status()
    assert status.spec.name == agent.node and list(status.free_gpus) == [0, 1, 2, 3]


def test_two_ranks_launch_with_env_report_phases_and_exit(metadata, allocation, start_agent) -> None:  # type: ignore[no-untyped-def]
    agent = start_agent()
    plan = node_plan(agent.node, 1, assignment("job-two", 0, 2, [0], budget=160, step_s=0.05),
                     assignment("job-two", 1, 2, [2, 3], budget=160, step_s=0.05))
    allocation.push(plan)
    wait_until(lambda: all(_phases(allocation, "job-two", r)[-1:] == [EXITED] for r in (0, 1)), what="both ranks exited")
    for rank in (0, 1):
        # RUNNING from its first report: its process had started (STARTING only while it starts)
        assert _phases(allocation, "job-two", rank) in ([RUNNING, EXITED], [STARTING, RUNNING, EXITED])
        final = _latest(allocation, "job-two", rank, 1)
        assert final.exit_code == 0 and list(final.gpu_indices) == []
        assert final.progress.samples_done == 160 and final.progress.fraction_done == 1.0
    running = [t for t in allocation.task_reports() if t.job_id == "job-two" and t.rank == 1 and t.phase == RUNNING]
    assert list(running[0].gpu_indices) == [2, 3]
    env = json.loads(re.search(r"silod-env: (.*)", agent.log("job-two", 1)).group(1))
    assert env["SILOD_JOB_ID"] == "job-two" and env["SILOD_RANK"] == "1" and env["SILOD_WORLD_SIZE"] == "2"
    assert env["SILOD_GENERATION"] == "1" and env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert env["SILOD_AGENT_ADDR"] == agent.address and env["SILOD_METADATA_ADDR"] == metadata.address
    assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["SILOD_BATCH_SIZE"]) == ("127.0.0.1", "29511", "8")
    # A contained rank (as root, the default) finds the job's checkpoint directory at a path of
    # its own; it is <work_dir>/checkpoints/job-two on the host.
    assert env["SILOD_CHECKPOINT_DIR"] == "/silod/checkpoint"
    assert env["SILOD_TEST_MARK"] == "yes" and env["SILOD_SAMPLE_BUDGET"] == "160"
    # Acked once, and acknowledged exits are forgotten by the agent.
    wait_until(lambda: [a.version for a in allocation.servicer.acks] == [1], what="ack of v1")
    assert allocation.servicer.acks[0].ok
    wait_until(lambda: not agent.status().tasks, what="acknowledged exits forgotten")
    # The same plan version delivered again is not applied again (nothing relaunched, no second ack).
    allocation.push(plan)
    time.sleep(1.0)
    assert [a.version for a in allocation.servicer.acks] == [1]
    assert agent.log("job-two", 0).count("--- silod: generation") == 1
    assert agent.status().applied_plan_version == 1
    # TailLogs returns the captured output.
    chunks = list(agent.stub.TailLogs(worker_agent_pb2.TailLogsRequest(job_id="job-two", rank=0), timeout=5))
    assert b"emulated: done samples=160" in b"".join(c.data for c in chunks)
    wait_until(lambda: _node(metadata, agent.node).applied_plan_version == 1, what="heartbeat with applied version")


def test_resize_checkpoints_relaunches_and_resumes(allocation, start_agent) -> None:  # type: ignore[no-untyped-def]
    metrics_port = free_port()
    agent = start_agent("--metrics-port", str(metrics_port))
    allocation.push(node_plan(agent.node, 1, *(assignment("job-rs", r, 4, [r]) for r in range(4))))
    wait_until(lambda: (_latest(allocation, "job-rs", 0, 1) or allocation_pb2.TaskReport()).progress.samples_done >= 80,
               what="generation 1 making progress")
    # Follow the log of rank 3, which the resize removes: the stream ends when the task exits.
    follow = agent.stub.TailLogs(worker_agent_pb2.TailLogsRequest(job_id="job-rs", rank=3, follow=True), timeout=30)
    allocation.push(node_plan(agent.node, 2, assignment("job-rs", 0, 2, [0], 2), assignment("job-rs", 1, 2, [1], 2)))
    assert b"checkpointed at samples=" in b"".join(c.data for c in follow)
    wait_until(lambda: _training(allocation, "job-rs", 0, 2), what="generation 2 training")
    log = agent.log("job-rs", 0)
    saved = int(re.search(r"checkpointed at samples=(\d+)", log).group(1))
    resumed = int(re.findall(r"resumed at samples=(\d+)", log)[-1])
    assert resumed == saved > 0
    for rank in range(4):
        assert _latest(allocation, "job-rs", rank, 1).phase == EXITED
        assert _latest(allocation, "job-rs", rank, 1).exit_code == 0
    assert _latest(allocation, "job-rs", 0, 2).progress.samples_done >= saved  # did not restart from 0
    assert sorted(allocation.servicer.acks[-1].released_jobs) == ["job-rs"]
    status = agent.status()
    assert sorted((t.rank, t.generation) for t in status.tasks if t.state != "exited") == [(0, 2), (1, 2)]
    assert list(status.free_gpus) == [2, 3]
    # The SDK of a superseded generation is told so.
    with pytest.raises(grpc.RpcError) as stale:
        agent.stub.ReportProgress(worker_agent_pb2.ReportProgressRequest(job_id="job-rs", rank=0, generation=1), timeout=5)
    assert stale.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "generation" in stale.value.details()
    with pytest.raises(grpc.RpcError) as unknown:
        agent.stub.ReportProgress(worker_agent_pb2.ReportProgressRequest(job_id="job-nope", rank=0, generation=1), timeout=5)
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND and unknown.value.details().startswith("job_id")
    # Tasks removed from the plan are stopped.
    allocation.push(node_plan(agent.node, 3))
    wait_until(lambda: all((_latest(allocation, "job-rs", r, 2) or allocation_pb2.TaskReport()).phase == EXITED
                           for r in (0, 1)), what="generation 2 stopped")
    wait_until(lambda: [a.version for a in allocation.servicer.acks] == [1, 2, 3], what="acks")
    check_exclusive(agent.gpu_history())
    # The agent's own figures: 6 cold launches, 6 ranks that checkpointed when asked, 3 plans.
    m = scrape_metrics(metrics_port)
    assert m[("silod_agent_launches_total", frozenset({("start", "cold")}))] == 6
    assert m[("silod_agent_rank_exits_total", frozenset({("cause", "checkpointed")}))] == 6
    assert m[("silod_agent_checkpoint_seconds_count", frozenset())] == 6
    assert m[("silod_agent_plan_version", frozenset())] == 3
    assert m[("silod_agent_plan_apply_seconds_count", frozenset())] == 3
    assert m[("silod_agent_ranks_running", frozenset())] == 0


def test_new_task_never_starts_on_a_gpu_held_by_an_exiting_task(allocation, start_agent) -> None:  # type: ignore[no-untyped-def]
    agent = start_agent(checkpoint_deadline_s=1.5)
    stubborn = [sys.executable, "-c",
                "import signal,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(120)"]
    allocation.push(node_plan(agent.node, 1, assignment("job-old", 0, 1, [0, 1], command=stubborn)))
    wait_until(lambda: "up" in agent.log("job-old", 0), what="stubborn task up")
    allocation.push(node_plan(agent.node, 2, assignment("job-new", 0, 1, [1, 2])))
    wait_until(lambda: any(t.state == "checkpointing" for t in agent.status().tasks), what="old task asked to stop")
    assert not any(t.job_id == "job-new" for t in agent.status().tasks)  # waits: GPU 1 still held
    directive = agent.stub.GetDirective(worker_agent_pb2.GetDirectiveRequest(job_id="job-old", rank=0, generation=1))
    assert directive.action == worker_agent_pb2.DIRECTIVE_ACTION_CHECKPOINT_AND_EXIT and 0 < directive.deadline_s <= 1.5
    assert list(agent.status().free_gpus) == [2, 3]
    wait_until(lambda: _phases(allocation, "job-new", 0)[-1:] == [RUNNING], what="new task running")
    old = _latest(allocation, "job-old", 0, 1)
    assert old.phase == EXITED and old.exit_code == 128 + signal.SIGKILL  # killed after the deadline
    history = agent.gpu_history()
    check_exclusive(history)
    release_old = next(e for e in history if e["event"] == "release" and e["task"] == "job-old/0/1")
    acquire_new = next(e for e in history if e["event"] == "acquire" and e["task"] == "job-new/0/1")
    assert history.index(release_old) < history.index(acquire_new)
    assert acquire_new["t"] - release_old["t"] >= 0
    assert [e["event"] for e in history].count("acquire") == 2


def test_sigterm_stops_tasks_and_exits_zero(allocation, start_agent) -> None:  # type: ignore[no-untyped-def]
    agent = start_agent()
    allocation.push(node_plan(agent.node, 1, assignment("job-term", 0, 1, [3])))
    wait_until(lambda: _training(allocation, "job-term", 0), what="task training")
    pid = next(t.pid for t in agent.status().tasks)
    assert pid > 0
    code = agent.proc.terminate(timeout=20)
    assert code == 0, agent.log("job-term", 0)
    assert not _alive(pid)
    assert "checkpointed at samples=" in agent.log("job-term", 0), agent.log("job-term", 0)
    # Exit 0 after a shutdown checkpoint must not read as completion: never reported EXITED.
    assert EXITED not in _phases(allocation, "job-term", 0)
    assert [line for line in agent.proc.log().splitlines() if '"shutdown complete"' in line]


def test_watch_reconnects_with_its_applied_version(allocation, start_agent) -> None:  # type: ignore[no-untyped-def]
    agent = start_agent()
    allocation.push(node_plan(agent.node, 1, assignment("job-w", 0, 1, [0], budget=40, step_s=0.01)))
    wait_until(lambda: [a.version for a in allocation.servicer.acks] == [1], what="ack of v1")
    directive = agent.stub.GetDirective(worker_agent_pb2.GetDirectiveRequest(job_id="job-w", rank=0, generation=1))
    assert directive.action == worker_agent_pb2.DIRECTIVE_ACTION_CONTINUE
    allocation.drop_watchers()
    wait_until(lambda: len(allocation.servicer.watch_requests) >= 2, what="re-watch")
    again = allocation.servicer.watch_requests[-1]
    assert (again.node, again.known_version) == (agent.node, 1)
    assert again.component == allocation_pb2.PLAN_COMPONENT_WORKER_AGENT
    # The reconnect delivered v1 again: not re-applied, not re-acked. v2 still applies.
    allocation.push(node_plan(agent.node, 2))
    wait_until(lambda: [a.version for a in allocation.servicer.acks] == [1, 2], what="ack of v2 only")
    assert agent.log("job-w", 0).count("--- silod: generation") == 1
    with pytest.raises(grpc.RpcError) as missing:
        agent.stub.TailLogs(worker_agent_pb2.TailLogsRequest(job_id="job-none", rank=0)).next()
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND and missing.value.details().startswith("job_id")


def _group(pgid: int) -> list[int]:
    """Running members of process group ``pgid``."""
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except FileNotFoundError:
                continue
            if fields[0] != "Z" and int(fields[2]) == pgid:
                members.append(int(entry))
    return members


def test_task_dies_with_its_killed_agent(allocation, start_agent) -> None:  # type: ignore[no-untyped-def]
    # A killed agent's task would otherwise run on unsupervised and, once the scheduler requeues
    # the job elsewhere, write the job's checkpoints concurrently with its successor.
    agent = start_agent()
    allocation.push(node_plan(agent.node, 1, assignment("job-pdeath", 0, 1, [0])))
    wait_until(lambda: _training(allocation, "job-pdeath", 0), what="task training")
    pid = next(t.pid for t in agent.status().tasks)
    assert _alive(pid)
    agent.proc.kill()
    wait_until(lambda: not _group(pid), timeout=10, what="task gone with its agent")
    assert "checkpointed at" not in agent.log("job-pdeath", 0)  # killed like on a crashed machine, not asked


def test_a_jobs_image_on_a_node_without_containers_is_noted_in_its_log(allocation, start_agent) -> None:  # type: ignore[no-untyped-def]
    # The contained runtime (as root) runs the command on the node's own system: it says so.
    agent = start_agent()
    a = assignment("job-image", 0, 1, [0], budget=16, step_s=0.01)
    a.spec.image = "registry.example:5000/team/train:1.4"
    allocation.push(node_plan(agent.node, 1, a))
    wait_until(lambda: (_latest(allocation, "job-image", 0, 1) or allocation_pb2.TaskReport()).phase == EXITED,
               what="task exited")
    assert ("--- silod: this node runs no containers (runtime contained): image registry.example:5000/team/train:1.4 "
            "is not used") in agent.log("job-image", 0)
    assert _latest(allocation, "job-image", 0, 1).exit_code == 0


def test_task_whose_command_cannot_start_exits_127(allocation, start_agent) -> None:  # type: ignore[no-untyped-def]
    metrics_port = free_port()
    agent = start_agent("--metrics-port", str(metrics_port))
    command = ["/nonexistent/silod-test-command", "--flag"]
    allocation.push(node_plan(agent.node, 1, assignment("job-missing", 0, 1, [2], command=command)))
    wait_until(lambda: (_latest(allocation, "job-missing", 0, 1) or allocation_pb2.TaskReport()).phase == EXITED,
               what="task exited")
    assert _latest(allocation, "job-missing", 0, 1).exit_code == 127
    assert "--- silod: cannot launch ['/nonexistent/silod-test-command', '--flag']" in agent.log("job-missing", 0)
    check_exclusive(agent.gpu_history())
    assert 2 in agent.status().free_gpus
    m = scrape_metrics(metrics_port)
    # The process started (the agent's wrapper), then could not exec the command: exit 127.
    assert m[("silod_agent_launches_total", frozenset({("start", "cold")}))] == 1
    assert m[("silod_agent_rank_exits_total", frozenset({("cause", "launch_failed")}))] == 1


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except FileNotFoundError:
        return ""


def test_restarted_agent_stops_tasks_its_killed_predecessor_left_then_resumes_them(allocation, start_agent) -> None:  # type: ignore[no-untyped-def]
    # The task is a shell (its leader, which dies with the agent) that started the training
    # process and a helper in its process group; neither inherits the death signal. Training
    # uses the SDK, which sees the agent gone and exits without checkpointing; the helper does
    # not, and the next agent must stop the group before it relaunches the job. (Contained ranks
    # need none of this: everything they start dies with their PID namespace; the next test.)
    first = start_agent("--runtime", "process")
    command = ["/bin/sh", "-c", f"SILOD_CHECKPOINT_EVERY_S=0.2 '{sys.executable}' -m silod.jobs.emulated & sleep 120 & wait"]
    allocation.push(node_plan(first.node, 1, assignment("job-orphan", 0, 1, [1], command=command)))
    saves = first.work_dir / "checkpoints" / "job-orphan" / "checkpoints.jsonl"
    wait_until(lambda: saves.exists(), what="a periodic checkpoint")
    leader = next(t.pid for t in first.status().tasks)
    second = None
    try:
        first.proc.kill()  # no graceful shutdown
        wait_until(lambda: not _alive(leader), timeout=10, what="leader gone with its agent")
        wait_until(lambda: not [p for p in _group(leader) if "silod.jobs.emulated" in _cmdline(p)], timeout=10,
                   what="training exits once it sees its agent gone")
        helpers = _group(leader)
        assert helpers, "the helper outlives its shell"
        gone_at = int(re.search(r"agent gone at samples=(\d+); exiting without a checkpoint",
                                first.log("job-orphan", 0)).group(1))
        env = json.loads(re.search(r"silod-env: (.*)", first.log("job-orphan", 0)).group(1))
        assert "SILOD_GPUS" not in env and "SILOD_NODE_NAME" not in env  # agent settings do not leak into jobs
        last_saved = json.loads(saves.read_text().splitlines()[-1])["samples_done"]
        assert 0 < last_saved <= gone_at

        second = start_agent("--runtime", "process", node=first.node, work_dir=first.work_dir)
        assert not _group(leader) and not any(_alive(p) for p in helpers)  # stopped before the new agent served
        wait_until(lambda: second.log("job-orphan", 0).count("--- silod: generation 1") == 2, what="relaunch")
        wait_until(lambda: "resumed at samples=" in second.log("job-orphan", 0).split("--- silod: generation 1")[-1],
                   what="resume")
        resumed = int(re.findall(r"resumed at samples=(\d+)", second.log("job-orphan", 0))[-1])
        assert resumed == last_saved  # the dead generation wrote nothing after its agent died
        check_exclusive(second.gpu_history())
    finally:
        # The helpers (the first one if the test failed early, the relaunched shell's) do not die
        # with their agent and would outlive the test.
        groups = [leader] + ([t.pid for t in second.status().tasks if t.pid] if second is not None else [])
        for pgid in groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)


def test_everything_a_contained_rank_started_dies_with_its_killed_agent(allocation, start_agent) -> None:  # type: ignore[no-untyped-def]
    # As root the agent contains ranks: the shell, the training process and the helper share a
    # PID namespace whose init dies with the agent, and the kernel kills the rest with it.
    agent = start_agent()
    command = ["/bin/sh", "-c", f"'{sys.executable}' -m silod.jobs.emulated & sleep 120 & wait"]
    allocation.push(node_plan(agent.node, 1, assignment("job-ns", 0, 1, [1], command=command)))
    wait_until(lambda: _training(allocation, "job-ns", 0), what="training")
    launcher = next(t.pid for t in agent.status().tasks)
    members = _group(launcher)
    assert len(members) >= 5  # launcher, init, shell, training, sleep
    assert any("sleep 120" in _cmdline(p) for p in members)
    agent.proc.kill()
    wait_until(lambda: not any(_alive(p) for p in members), timeout=10, what="every process of the rank gone")


def test_pytorch_example_under_the_agent_checkpoints_on_resize_and_finishes(allocation, start_agent) -> None:  # type: ignore[no-untyped-def]
    from tests.support.procs import REPO_ROOT

    agent = start_agent()
    command = [sys.executable, str(REPO_ROOT / "examples" / "train_cifar_like.py"), "--steps", "60",
               "--emulated-gpu-s", "0.05", "--batch-size", "16"]
    allocation.push(node_plan(agent.node, 1, assignment("job-torch", 0, 1, [0, 1], command=command)))
    wait_until(lambda: (_latest(allocation, "job-torch", 0, 1) or allocation_pb2.TaskReport()).progress.steps_done >= 5,
               timeout=40, what="example training")
    allocation.push(node_plan(agent.node, 2, assignment("job-torch", 0, 1, [2], generation=2, command=command)))
    wait_until(lambda: (_latest(allocation, "job-torch", 0, 2) or allocation_pb2.TaskReport()).phase == EXITED,
               timeout=60, what="generation 2 finished")
    assert _latest(allocation, "job-torch", 0, 1).exit_code == 0
    final = _latest(allocation, "job-torch", 0, 2)
    assert final.exit_code == 0 and final.progress.steps_done == 60
    log = agent.log("job-torch", 0)
    saved = int(re.search(r"checkpointed at step (\d+)", log).group(1))
    assert f"resumed from checkpoint at step {saved}" in log and "done at step 60" in log
    check_exclusive(agent.gpu_history())


def test_emulated_inference_task_holds_its_gpu_for_its_duration(allocation, start_agent) -> None:  # type: ignore[no-untyped-def]
    agent = start_agent()
    task = assignment("job-inf", 0, 1, [2])
    task.spec.kind = common_pb2.JOB_KIND_INFERENCE
    task.spec.inference_duration_s = 1.0
    allocation.push(node_plan(agent.node, 1, task))
    wait_until(lambda: _phases(allocation, "job-inf", 0)[-1:] == [EXITED], what="inference task done")
    final = _latest(allocation, "job-inf", 0, 1)
    assert final.exit_code == 0 and final.progress.fraction_done == 1.0
    assert "emulated inference: done after 1s" in agent.log("job-inf", 0)
    acquire, release = agent.gpu_history()
    assert (acquire["gpus"], release["gpus"]) == ([2], [2]) and release["t"] - acquire["t"] >= 1.0
