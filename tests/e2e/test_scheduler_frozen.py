"""A frozen leader (SIGSTOP: its connections stay open, nothing answers on them) with the deployed
lease (5 s, renewed every second) and the nodes' default watch settings: the standby is elected
and every worker agent and cache server follows its plans within 5 s of that election (the item's
target; the election time is the one the new leader logs). The nodes need not notice the silence:
they watch both schedulers, and the standby answers the watch it held the moment it wins (before
that, with one watch at a time and the HTTP/2 keepalive to notice, they followed 54-64 s after the
election: a new watch to the frozen host waits on a connection that never completes its
handshake). Thawed, the old leader stands by and no plan of its epoch comes after the new
leader's. The same through the allocation service (the nodes given it alone, as deployed), which
follows both schedulers as the nodes would."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from datetime import datetime
from pathlib import Path

import grpc
import pytest

from silod.v1 import cache_pb2, cache_pb2_grpc, common_pb2, metadata_pb2, worker_agent_pb2
from tests.e2e.harness import wait_until
from tests.e2e.test_scheduler_failover import TwoSchedulers, TwoSchedulersAndAllocation, submit_to
from tests.support.procs import start_service

FOLLOW_S = 5.0  # every node follows the new leader within this of its election
ELECTION = ("--leader-election", "--log-level", "info")  # the deployed lease: --lease-ttl-s 5, --lease-renew-s 1


class DeployedLease(TwoSchedulers):
    def _start(self, i: int):  # type: ignore[no-untyped-def]
        return start_service(
            "scheduler", "--listen", self.addresses[i], "--metadata-address", self.metadata.address,
            "--metrics-port", str(self.metrics_ports[i]), *self._scheduler_args, *ELECTION,
            workdir=self.root / f"scheduler-{i}", timeout_s=60)


class DeployedLeaseAndAllocation(DeployedLease, TwoSchedulersAndAllocation):
    """The nodes given the allocation service alone, which follows both schedulers (as deployed)."""


def won_at(log: str, epoch: int) -> float:
    """Wall time of the "leadership won" line of ``epoch`` in a scheduler's JSON log."""
    for line in log.splitlines():
        if '"leadership won"' in line:
            record = json.loads(line)
            if record.get("epoch") == epoch:
                return datetime.fromisoformat(record["ts"].replace("Z", "+00:00")).timestamp()
    raise AssertionError(f"no 'leadership won' of epoch {epoch} in the log")


class Followers(threading.Thread):
    """Polls every agent's and cache server's applied plan version; records when each first
    reached ``self.version`` (set once the new leader's first plan is known)."""

    def __init__(self, cluster: DeployedLease, caches: dict[str, cache_pb2_grpc.CacheServiceStub]) -> None:
        super().__init__(daemon=True)
        self.cluster, self.caches = cluster, caches
        self.version = 0
        self.reached: dict[str, float] = {}
        self.stop = threading.Event()

    def applied(self) -> dict[str, int]:
        found = {}
        for name, agent in self.cluster.agents.items():
            status = agent.stub.GetNodeStatus(worker_agent_pb2.GetNodeStatusRequest(), timeout=5)
            found[f"agent {name}"] = status.applied_plan_version
        for name, stats in self.caches.items():
            found[f"cache {name}"] = stats(cache_pb2.StatsRequest(), timeout=5).plan_version
        return found

    def run(self) -> None:
        while not self.stop.is_set():
            if self.version:
                now = time.time()
                for who, version in self.applied().items():
                    if version >= self.version:
                        self.reached.setdefault(who, now)
            self.stop.wait(0.05)


@pytest.mark.parametrize("via", ["schedulers", "allocation service"])
def test_every_node_follows_the_new_leader_within_5s_of_its_election(tmp_path: Path, e2e_postgres, via: str) -> None:  # type: ignore[no-untyped-def]
    kind = DeployedLeaseAndAllocation if via == "allocation service" else DeployedLease
    cluster = kind(tmp_path / "cluster", e2e_postgres.create(), nodes=2)
    caches, channels, frozen, followers = {}, [], None, None
    try:
        a, b = cluster.addresses
        followed = cluster.allocation.address if via == "allocation service" else f"{a},{b}"
        for node in sorted(cluster.agents):
            cache = start_service("cache-server", "--metadata-address", cluster.metadata.address, "--node", node,
                                  "--scheduler-address", followed, "--disk-cache-dir", str(tmp_path / f"cache-{node}"),
                                  "--memory-cache-bytes", "0", "--no-fsync", "--lease-socket", "off",
                                  "--log-level", "info", workdir=tmp_path / f"cache-{node}-proc", timeout_s=60)
            cluster.agents[node].cache = cache  # type: ignore[attr-defined]  # closed below
            channel = grpc.insecure_channel(cache.address)
            channels.append(channel)
            caches[node] = cache_pb2_grpc.CacheServiceStub(channel).Stats
        first = cluster.leadership()
        jobs = [submit_to(a, f"long-{i}", 2, 100_000_000) for i in range(2)]
        wait_until(lambda: all(cluster.job(j).state == common_pb2.JOB_STATE_RUNNING for j in jobs), 60, "jobs running")
        followers = Followers(cluster, caches)
        # (A node is sent the plans that change its part only: versions differ from node to node.)
        wait_until(lambda: all(followers.applied().values()), 30, "every node on a plan of the leader")
        time.sleep(2)
        followers.start()

        frozen = cluster.schedulers[0]
        os.kill(frozen.pid, signal.SIGSTOP)  # its sockets stay open: nothing resets the nodes' watches
        frozen_at = time.time()
        wait_until(lambda: cluster.leader() == b, 20, "the standby to lead")
        epoch = first.epoch + 1
        elected = won_at(cluster.schedulers[1].log(), epoch)

        def first_plan() -> int:  # the new leader's first plan, committed at once even if nothing changed
            plans = cluster.md.ListPlans(metadata_pb2.ListPlansRequest(page_size=100), timeout=10).plans
            return min((p.version for p in plans if p.epoch == epoch), default=0)

        followers.version = wait_until(first_plan, 10, "the new leader's first plan")
        expected = {f"agent {n}" for n in cluster.agents} | {f"cache {n}" for n in caches}
        wait_until(lambda: set(followers.reached) == expected, 30, "every node following the new leader")
        followers.stop.set()
        followers.join(10)
        took = {who: at - elected for who, at in followers.reached.items()}
        print(f"[frozen leader] elected {elected - frozen_at:.1f}s after the freeze; nodes following it "
              + ", ".join(f"{who} {s:+.2f}s" for who, s in sorted(took.items())) + " after its election")
        assert max(took.values()) < FOLLOW_S, took

        os.kill(frozen.pid, signal.SIGCONT)  # thawed: it finds the lease lost and stands by
        wait_until(lambda: f"the leader is at {b}" in _watch_refusal(a), 30, "the old leader to stand by")
        time.sleep(2)
        plans = cluster.md.ListPlans(metadata_pb2.ListPlansRequest(page_size=100), timeout=10).plans
        assert not [p.version for p in plans if p.version > followers.version and p.epoch != epoch]
        assert all(cluster.job(j).state == common_pb2.JOB_STATE_RUNNING for j in jobs)
    finally:
        if followers is not None:
            followers.stop.set()
            followers.join(10)
        if frozen is not None and frozen.running():
            os.kill(frozen.pid, signal.SIGCONT)
        for channel in channels:
            channel.close()
        for agent in cluster.agents.values():
            cache = getattr(agent, "cache", None)
            if cache is not None:
                cache.close()
        cluster.close()


def _watch_refusal(address: str) -> str:
    from silod.v1 import allocation_pb2, allocation_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            next(iter(allocation_pb2_grpc.AllocationServiceStub(channel).Watch(
                allocation_pb2.WatchPlanRequest(node="probe"), timeout=5)))
        except grpc.RpcError as exc:
            return exc.details() or ""
    return ""
