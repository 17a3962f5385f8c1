"""Two schedulers with --leader-election on PostgreSQL, two worker agents (emulated jobs): kill -9
of the leader while jobs run; the standby takes over within 10 s. The nodes follow both
schedulers directly, or (as the deployments run them) the allocation service, which follows both. No acknowledged submission is
lost (submitted before the kill through the leader, during the failover through the standby), no
generation is launched twice, no GPU is held by two tasks, and the jobs running at the kill keep
training in the same processes to their end."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest

from silod.v1 import cache_pb2, cache_pb2_grpc, common_pb2, metadata_pb2, scheduler_pb2, scheduler_pb2_grpc
from tests.e2e.harness import Cluster, wait_until
from tests.support.procs import free_port, start_service

LEASE = ("--leader-election", "--lease-ttl-s", "3", "--lease-renew-s", "0.5")
BEFORE = [("a", 2, 9600), ("b", 2, 9600), ("c", 4, 9600)]  # 8 GPUs of 8: c waits across the kill
DURING = [("d", 2, 4800), ("e", 2, 4800)]
ENV = {"SILOD_CHECKPOINT_EVERY_S": "1"}


class TwoSchedulers(Cluster):
    """The harness's cluster with two schedulers; the agents get both addresses (``a,b``)."""

    def start_scheduler(self) -> None:
        self.addresses = [self.scheduler_address, f"127.0.0.1:{free_port()}"]
        self.metrics_ports = [self.metrics_port, free_port()]
        self.schedulers = [self._start(0)]
        try:
            wait_until(lambda: self.leader() == self.addresses[0], timeout=30, what="the first scheduler leads")
            self.schedulers.append(self._start(1))
        except BaseException:
            # The harness may try again on other ports (LaunchError: address in use): the first
            # scheduler must not stay behind holding the lease the next one waits for.
            self.schedulers[0].close()
            raise
        self.scheduler = self.schedulers[0]

    def _start(self, i: int):  # type: ignore[no-untyped-def]
        return start_service(
            "scheduler", "--listen", self.addresses[i], "--metadata-address", self.metadata.address,
            "--metrics-port", str(self.metrics_ports[i]), *self._scheduler_args, *LEASE,
            workdir=self.root / f"scheduler-{i}", timeout_s=60)

    def leadership(self) -> metadata_pb2.Leadership:
        with grpc.insecure_channel(self.metadata.address) as channel:
            from silod.v1 import metadata_pb2_grpc

            return metadata_pb2_grpc.MetadataServiceStub(channel).GetLeadership(
                metadata_pb2.GetLeadershipRequest(), timeout=10)

    def leader(self) -> str:
        return self.leadership().address

    def _start_agents(self, nodes: list[tuple[str, str]]) -> None:
        self.scheduler_address = ",".join(self.addresses)  # what the agents follow
        try:
            super()._start_agents(nodes)
        finally:
            self.scheduler_address = self.addresses[0]

    def close(self) -> None:
        for proc in getattr(self, "schedulers", [])[1:]:
            proc.close()
        super().close()


class TwoSchedulersAndAllocation(TwoSchedulers):
    """The same, with the nodes given the allocation service (silod allocation) alone, which
    follows both schedulers: the deployments' topology."""

    def start_scheduler(self) -> None:
        super().start_scheduler()
        self.allocation = start_service(
            "allocation", "--metadata-address", self.metadata.address, "--scheduler-address", ",".join(self.addresses),
            workdir=self.root / "allocation", timeout_s=60)

    def _start_agents(self, nodes: list[tuple[str, str]]) -> None:
        self.scheduler_address = self.allocation.address
        try:
            Cluster._start_agents(self, nodes)
        finally:
            self.scheduler_address = self.addresses[0]

    def close(self) -> None:
        if getattr(self, "allocation", None) is not None:
            self.allocation.close()
        super().close()


def submit_to(address: str, name: str, gpus: int, samples: int) -> str:
    spec = common_pb2.JobSpec(name=name, application="cifar10", min_gpus=gpus, max_gpus=gpus, batch_size=32,
                              sample_budget=samples, emulated_step_compute_s=0.02, env=ENV)
    with grpc.insecure_channel(address) as channel:
        return scheduler_pb2_grpc.JobServiceStub(channel).SubmitJob(
            scheduler_pb2.SubmitJobRequest(spec=spec, client_request_id=f"ha-{name}"),
            timeout=30, wait_for_ready=True).id


@pytest.mark.parametrize("via", ["schedulers", "allocation service"])
def test_standby_takes_over_after_kill_9_of_the_leader(tmp_path: Path, e2e_postgres, via: str) -> None:  # type: ignore[no-untyped-def]
    kind = TwoSchedulersAndAllocation if via == "allocation service" else TwoSchedulers
    cluster = kind(tmp_path / "cluster", e2e_postgres.create(), nodes=2)
    cache = None
    try:
        a, b = cluster.addresses
        followed = cluster.allocation.address if via == "allocation service" else f"{a},{b}"
        # A cache server follows both schedulers too: after the failover it applies the new leader's plans.
        node = sorted(cluster.agents)[0]
        cache = start_service("cache-server", "--metadata-address", cluster.metadata.address, "--node", node,
                              "--scheduler-address", followed, "--disk-cache-dir", str(tmp_path / "cache"),
                              "--memory-cache-bytes", "0", "--no-fsync", "--lease-socket", "off",
                              "--log-level", "warning", workdir=tmp_path / "cache-proc", timeout_s=60)
        first = cluster.leadership()
        ids = {name: submit_to(a, name, gpus, samples) for name, gpus, samples in BEFORE}

        def running_tasks() -> dict[tuple[str, int, int], int]:
            return {(t.job_id, t.rank, t.generation): t.pid for agent in cluster.agents.values()
                    for t in agent.tasks() if t.state == "running" and t.pid}

        def mid_run() -> dict[tuple[str, int, int], int] | None:
            jobs = [j for j in cluster.all_jobs() if j.state == common_pb2.JOB_STATE_RUNNING
                    and j.progress.samples_done > 0]
            return running_tasks() if len(jobs) >= 2 else None

        before = wait_until(mid_run, timeout=60, what="jobs running")
        killed_at = time.monotonic()
        cluster.schedulers[0].kill()
        # The deposed leader's last plan (the standby waits out the 3-s lease before its first).
        deposed_last = cluster.md.ListPlans(metadata_pb2.ListPlansRequest(page_size=1), timeout=10).plans[0].version
        # Submissions during the failover, through the standby: persisted by the metadata store.
        ids.update({name: submit_to(b, name, gpus, samples) for name, gpus, samples in DURING})
        wait_until(lambda: cluster.leader() == b, timeout=10, what="the standby to take over")
        assert time.monotonic() - killed_at < 10
        assert cluster.leadership().epoch == first.epoch + 1
        # Retried submissions (same client_request_id) get the same jobs back from the new leader.
        assert submit_to(b, "a", 2, 9600) == ids["a"] and submit_to(b, "d", 2, 4800) == ids["d"]

        finished = cluster.wait_terminal(list(ids.values()), timeout=90)
        for name, job_id in ids.items():
            assert finished[job_id].state == common_pb2.JOB_STATE_SUCCEEDED, f"{name}: {finished[job_id].message}"
        plans = cluster.md.ListPlans(metadata_pb2.ListPlansRequest(page_size=100), timeout=10).plans
        assert {p.epoch for p in plans} <= {first.epoch, first.epoch + 1} and plans[0].epoch == first.epoch + 1

        launches = [launch for agent in cluster.agents.values() for launch in agent.launches()]
        keys = [(job, rank, generation) for job, rank, generation, _ in launches]
        assert len(keys) == len(set(keys)), f"a generation launched twice: {sorted(keys)}"
        for job_id, rank, generation in before:
            assert [(j, r) for j, r, g, _ in launches if j == job_id and r == rank] == [(job_id, rank)], \
                f"{job_id} rank {rank} relaunched"
            if rank == 0:  # kept training across the failover: its last checkpoint is by the same process
                history = cluster.checkpoint_history(job_id)
                final = history[-1]
                assert final["generation"] == generation
                assert {s["launch"] for s in history if s["generation"] == generation} == {final["launch"]}
                assert final["samples_done"] == finished[job_id].progress.samples_done
        cluster.metrics_port = cluster.metrics_ports[1]
        cluster.assert_gpus_never_double_held()
        assert cluster.double_held_total() == 0
        # A node is sent only the plans that change its part (AllocationService.Watch), and the new
        # leader's first plan changes every node's part (its epoch): the cache server must apply a
        # plan of the new epoch. The newest plan need not reach it: the last rounds may release
        # jobs of the other node only (it then rightly keeps the version that last changed its part).
        with grpc.insecure_channel(cache.address) as channel:
            stats = cache_pb2_grpc.CacheServiceStub(channel).Stats
            wait_until(lambda: stats(cache_pb2.StatsRequest(), timeout=10).plan_version > deposed_last,
                       timeout=30, what="the cache server to apply a plan of the new leader")
    finally:
        if cache is not None:
            cache.close()
        cluster.close()
