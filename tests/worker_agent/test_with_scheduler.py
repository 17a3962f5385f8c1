"""Contract check against the real scheduler (`silod scheduler`, AllocationService + JobService):
metadata, scheduler and worker agent as real processes; jobs submitted through JobService."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from silod.v1 import common_pb2, metadata_pb2, scheduler_pb2, scheduler_pb2_grpc, worker_agent_pb2, worker_agent_pb2_grpc
from tests.support.procs import start_service
from tests.worker_agent.conftest import wait_until


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[scheduler_pb2_grpc.JobServiceStub, worker_agent_pb2_grpc.WorkerAgentServiceStub, Path]]:
    # One cluster for the module (three process starts): each test submits its own job, and the
    # node's 4 GPUs fit both tests' 2-GPU jobs.
    tmp_path = tmp_path_factory.mktemp("with-scheduler")
    agent_dir = tmp_path / "agent"
    with start_service("metadata", "--db", f"sqlite:///{tmp_path / 'm.db'}", "--log-level", "warning",
                       workdir=tmp_path) as md, \
         start_service("scheduler", "--metadata-address", md.address, "--interval-s", "1", "--restart-cost-s", "1",
                       "--log-level", "warning", workdir=tmp_path) as sch, \
         start_service("worker-agent", "--metadata-address", md.address, "--scheduler-address", sch.address,
                       "--node-name", "n1", "--gpus", "4", "--work-dir", str(agent_dir), "--report-s", "0.5",
                       "--heartbeat-s", "0.5", "--checkpoint-deadline-s", "5", "--log-level", "warning",
                       workdir=tmp_path) as ag:
        with grpc.insecure_channel(sch.address) as c1, grpc.insecure_channel(ag.address) as c2:
            yield scheduler_pb2_grpc.JobServiceStub(c1), worker_agent_pb2_grpc.WorkerAgentServiceStub(c2), agent_dir


def _submit(jobs, budget: int):  # type: ignore[no-untyped-def]
    spec = common_pb2.JobSpec(name="e2e", application="cifar10", min_gpus=2, max_gpus=2, batch_size=16,
                              sample_budget=budget, emulated_step_compute_s=0.02)
    return jobs.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec), timeout=10)


def _state(jobs, job_id):  # type: ignore[no-untyped-def]
    return jobs.GetJob(metadata_pb2.GetJobRequest(job_id=job_id), timeout=10)


def test_submitted_job_runs_on_the_agent_to_success(cluster) -> None:  # type: ignore[no-untyped-def]
    jobs, agent, agent_dir = cluster
    job = _submit(jobs, 800)
    done = wait_until(lambda: (j := _state(jobs, job.id)).state in (common_pb2.JOB_STATE_SUCCEEDED, common_pb2.JOB_STATE_FAILED) and j,
                      timeout=40, what="job finished")
    assert done.state == common_pb2.JOB_STATE_SUCCEEDED, done.message
    assert done.progress.samples_done == 800
    # The job succeeds once rank 0 has exited. Rank 1 runs on its own clock (the emulation has no
    # collective to keep the ranks in step): it either reaches the budget too, or, if it started
    # late, the plan that drops the finished job stops it a few steps short. Either way it ran and
    # ended cleanly, once.
    rank1 = agent_dir / "jobs" / job.id / "rank-1.log"
    endings = ("emulated: done samples=800", "emulated: checkpointed at samples=")
    wait_until(lambda: any(e in rank1.read_text() for e in endings), timeout=20, what="rank 1's last line")
    log = rank1.read_text()
    assert "emulated: resumed at samples=0" in log
    assert sum(log.count(e) for e in endings) == 1, log
    wait_until(lambda: all(t.state == "exited" and t.exit_code == 0
                           for t in agent.GetNodeStatus(worker_agent_pb2.GetNodeStatusRequest(), timeout=5).tasks
                           if t.job_id == job.id), timeout=20, what="both ranks exited with code 0")


def test_cancelled_job_is_stopped_by_the_agent(cluster) -> None:  # type: ignore[no-untyped-def]
    jobs, agent, agent_dir = cluster
    job = _submit(jobs, 10_000_000)
    wait_until(lambda: _state(jobs, job.id).state == common_pb2.JOB_STATE_RUNNING, timeout=40, what="running")
    time.sleep(0.5)
    jobs.CancelJob(scheduler_pb2.CancelJobRequest(job_id=job.id), timeout=10)
    wait_until(lambda: not [t for t in agent.GetNodeStatus(worker_agent_pb2.GetNodeStatusRequest(), timeout=5).tasks
                            if t.state != "exited"], timeout=30, what="tasks stopped")
    assert "checkpointed at samples=" in (agent_dir / "jobs" / job.id / "rank-0.log").read_text()
    assert _state(jobs, job.id).state == common_pb2.JOB_STATE_CANCELLED


def test_a_command_without_the_sdk_shows_running_with_its_gpus(cluster) -> None:  # type: ignore[no-untyped-def]
    # A rank counts as running once its process has started, whether or not it ever calls the
    # agent: `silod jobs` then shows RUNNING and the job's GPUs, not SCHEDULED and "-".
    import sys

    jobs, agent, _ = cluster
    spec = common_pb2.JobSpec(name="plain", min_gpus=1, max_gpus=1, batch_size=1, sample_budget=1,
                              command=[sys.executable, "-c", "import time; time.sleep(6)"])
    job = jobs.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec), timeout=10)
    running = wait_until(lambda: (j := _state(jobs, job.id)).state == common_pb2.JOB_STATE_RUNNING
                         and j.allocated.gpus == 1 and j, timeout=20, what="RUNNING with its GPU")
    assert "ranks of generation" in running.message
    done = wait_until(lambda: (j := _state(jobs, job.id)).state in (common_pb2.JOB_STATE_SUCCEEDED, common_pb2.JOB_STATE_FAILED) and j,
                      timeout=30, what="job finished")
    assert done.state == common_pb2.JOB_STATE_SUCCEEDED, done.message
