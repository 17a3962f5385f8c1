"""Fixtures: the metadata service (SQLite, or PostgreSQL for ``cluster_any_db``) and the scheduler,
both served in-process; tests act as job clients and as worker agents."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from scheduler.service import Settings as SchedulerSettings
from scheduler.service import definition as scheduler_definition
from services.metadata.migrate import upgrade
from services.metadata.service import Settings as MetadataSettings
from silod.v1 import allocation_pb2, allocation_pb2_grpc, common_pb2, metadata_pb2, scheduler_pb2, scheduler_pb2_grpc
from tests.support.fixtures import postgres_scratch
from tests.metadata.metadata_harness import InProcessServer as MetadataServer
from tests.metadata.metadata_harness import PostgresScratch
from tests.support.inprocess import InProcessServer
from tests.support.tcp_proxy import TcpProxy


@pytest.fixture(scope="session")
def sched_sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sched-sqlite-template") / "template.db"
    upgrade(f"sqlite:///{path}")
    return path


@pytest.fixture(scope="session")
def sched_postgres() -> Iterator[PostgresScratch]:
    yield from postgres_scratch()


class Cluster:
    """A metadata server plus a scheduler; helpers act as agents (register, heartbeat, report)."""

    def __init__(self, db_url: str, metadata_link: bool = False, **scheduler_settings: object) -> None:
        """``metadata_link``: the scheduler reaches the metadata through ``self.link``, a relay
        the test can cut (the test's own stubs, standing for the agents, go direct)."""
        self.metadata = MetadataServer(MetadataSettings(db=db_url, auto_migrate=True))
        self.md = self.metadata.stub
        self.link = TcpProxy(self.metadata.address) if metadata_link else None
        self._settings = SchedulerSettings(metadata_address=self.link.address if self.link else self.metadata.address,
                                           **{"interval_s": 60.0, **scheduler_settings})
        self._start_scheduler()

    def _start_scheduler(self) -> None:
        settings = self._settings
        self.definition = scheduler_definition(settings)
        self.core = self.definition.core  # type: ignore[attr-defined]
        self.scheduler = InProcessServer(self.definition, settings, thread_name="scheduler-server")
        self.jobs = scheduler_pb2_grpc.JobServiceStub(self.scheduler.channel)
        self.alloc = allocation_pb2_grpc.AllocationServiceStub(self.scheduler.channel)

    def restart_scheduler(self) -> None:
        """A new scheduler process on the same metadata store (in-memory state gone)."""
        self.scheduler.stop()
        self._start_scheduler()

    def close(self) -> None:
        if not getattr(self, "_closed", False):
            self._closed = True
            self.scheduler.stop()
            if self.link:
                self.link.close()
            self.metadata.stop()

    # -- agent side --
    def add_node(self, name: str, gpus: int = 4, pool: int = common_pb2.NODE_POOL_TRAINING, gpu_type: str = "") -> None:
        self.md.UpsertNode(metadata_pb2.UpsertNodeRequest(spec=common_pb2.NodeSpec(
            name=name, gpus=gpus, pool=pool, gpu_model="emulated", agent_address=f"{name}.local:7000", gpu_type=gpu_type)))
        self.md.Heartbeat(metadata_pb2.HeartbeatRequest(node=name))

    def heartbeat(self, name: str) -> None:
        self.md.Heartbeat(metadata_pb2.HeartbeatRequest(node=name))

    def report(self, node: str, version: int, *tasks: allocation_pb2.TaskReport) -> allocation_pb2.ReportTasksResponse:
        return self.alloc.ReportTasks(allocation_pb2.ReportTasksRequest(node=node, applied_plan_version=version, tasks=tasks))

    # -- scheduler side --
    def round(self, reason: str = "test"):
        """Run a round now; the plan in force after it.

        Submissions and node changes also trigger rounds in the background, so on a busy
        machine one of those may already have committed this plan, and the explicit round
        then has nothing to change (it returns None): fall back to the latest plan.
        """
        return self.scheduler.submit(self.core.run_round(reason)) or self.latest()

    def submit(self, name: str = "j", min_gpus: int = 1, max_gpus: int = 1, **spec: object) -> common_pb2.Job:
        spec = {"application": "cifar10", "batch_size": 128, "epochs": 1, **spec}
        return self.jobs.SubmitJob(scheduler_pb2.SubmitJobRequest(
            spec=common_pb2.JobSpec(name=name, min_gpus=min_gpus, max_gpus=max_gpus, **spec)))

    def state(self, job_id: str) -> int:
        return self.md.GetJob(metadata_pb2.GetJobRequest(job_id=job_id)).state

    def latest(self):
        return self.md.GetLatestPlan(metadata_pb2.GetLatestPlanRequest())


@pytest.fixture
def sqlite_url(sched_sqlite_template: Path, tmp_path: Path) -> str:
    path = tmp_path / "metadata.db"
    shutil.copyfile(sched_sqlite_template, path)
    return f"sqlite:///{path}"


@pytest.fixture
def cluster(sqlite_url: str) -> Iterator[Cluster]:
    c = Cluster(sqlite_url)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def make_cluster(sqlite_url: str) -> Iterator[Callable[..., Cluster]]:
    made: list[Cluster] = []

    def make(**settings: object) -> Cluster:
        made.append(Cluster(sqlite_url, **settings))
        return made[-1]

    try:
        yield make
    finally:
        for c in made:
            c.close()


@pytest.fixture(params=["sqlite", "postgresql"])
def cluster_any_db(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    if request.param == "sqlite":
        url = request.getfixturevalue("sqlite_url")
    else:
        url = request.getfixturevalue("sched_postgres").create()
        upgrade(url)
    c = Cluster(url)
    try:
        yield c
    finally:
        c.close()
