"""Fixtures: an in-process metadata service (SQLite), the scripted AllocationService double,
and real `silod worker-agent` processes pointed at both."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from services.metadata.service import Settings as MetadataSettings
from services.metadata.service import definition as metadata_definition
from silod.v1 import common_pb2, metadata_pb2_grpc, plan_pb2, worker_agent_pb2_grpc
from tests.support.inprocess import InProcessServer
from tests.support.procs import ServiceProcess, start_service
from tests.worker_agent.scripted_allocation import AllocationServer


@pytest.fixture(scope="session")
def metadata(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    db = tmp_path_factory.mktemp("agent-meta") / "meta.db"
    settings = MetadataSettings(db=f"sqlite:///{db}", log_level="warning", liveness_window_s=5)
    with InProcessServer(metadata_definition(settings), settings, thread_name="metadata") as server:
        server.stub = metadata_pb2_grpc.MetadataServiceStub(server.channel)  # type: ignore[attr-defined]
        yield server


@pytest.fixture
def allocation() -> Iterator[AllocationServer]:
    with AllocationServer() as server:
        yield server


class AgentHandle:
    def __init__(self, proc: ServiceProcess, work_dir: Path, node: str) -> None:
        self.proc = proc
        self.work_dir = work_dir
        self.node = node
        self.address = proc.address
        self.channel = grpc.insecure_channel(proc.address)
        self.stub = worker_agent_pb2_grpc.WorkerAgentServiceStub(self.channel)

    def status(self) -> Any:
        return self.stub.GetNodeStatus(__import__("silod.v1.worker_agent_pb2", fromlist=["x"]).GetNodeStatusRequest(), timeout=5)

    def log(self, job: str, rank: int) -> str:
        path = self.work_dir / "jobs" / job / f"rank-{rank}.log"
        return path.read_text() if path.exists() else ""

    def gpu_history(self) -> list[dict[str, Any]]:
        import json

        path = self.work_dir / "gpu-table.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def close(self) -> None:
        self.channel.close()
        self.proc.close()


@pytest.fixture
def start_agent(
    metadata: InProcessServer, allocation: AllocationServer, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Callable[..., AgentHandle]]:
    handles: list[AgentHandle] = []

    def start(*extra: str, gpus: int = 4, checkpoint_deadline_s: float = 10, node: str = "",
              work_dir: Path | None = None) -> AgentHandle:
        node = node or f"node-{request.node.name[:40].replace('_', '-')}-{len(handles)}"
        work_dir = work_dir or tmp_path / f"agent-{len(handles)}"
        proc = start_service(
            "worker-agent",
            "--metadata-address", metadata.address,
            "--scheduler-address", allocation.address,
            "--node-name", node,
            "--gpus", str(gpus),
            "--work-dir", str(work_dir),
            "--heartbeat-s", "0.3",
            "--report-s", "0.3",
            "--checkpoint-deadline-s", str(checkpoint_deadline_s),
            "--stop-grace-s", "10",
            "--log-level", "info",
            *extra,
            workdir=tmp_path / f"agent-proc-{len(handles)}",
        )
        handle = AgentHandle(proc, work_dir, node)
        handles.append(handle)
        return handle

    yield start
    for h in handles:
        h.close()


def wait_until(predicate: Callable[[], Any], timeout: float = 20, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def assignment(
    job: str, rank: int, world: int, gpus: list[int], generation: int = 1, *, budget: int = 10_000_000,
    step_s: float = 0.02, batch: int = 8, command: list[str] | None = None,
) -> plan_pb2.TaskAssignment:
    return plan_pb2.TaskAssignment(
        job_id=job, rank=rank, world_size=world, gpu_indices=gpus, master_addr="127.0.0.1", master_port=29511,
        batch_size=batch, generation=generation,
        spec=common_pb2.JobSpec(
            name=job, min_gpus=1, max_gpus=4, batch_size=batch, sample_budget=budget,
            emulated_step_compute_s=step_s, command=command or [], env={"SILOD_TEST_MARK": "yes"},
        ),
    )


def node_plan(node: str, version: int, *tasks: plan_pb2.TaskAssignment) -> plan_pb2.NodePlan:
    return plan_pb2.NodePlan(version=version, node=node, tasks=list(tasks))


def scrape_metrics(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """The agent's /metrics: (sample name, its labels other than node) -> value."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {(sample.name, frozenset((k, v) for k, v in sample.labels.items() if k != "node")): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}
