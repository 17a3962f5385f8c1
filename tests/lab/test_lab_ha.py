"""High availability in the lab: deploy/compose.yaml's two schedulers (--leader-election) on two
hosts, sharing the lab's PostgreSQL through the metadata host, while jobs run and a client keeps
submitting. The leader's host loses its link, then the new leader is killed with -9; each time
the standby leads within 10 s, no acknowledged submission is lost, no generation of a job is
launched twice, no GPU is held by two tasks (each agent's GPU table log), the jobs that were
running keep training in the same processes, and every worker agent and cache server follows the
new leader's plans within 5 s of its election (the time its log gives): with its host cut off the
old leader's watches go silent, and the standby answers the watches it held once it wins. Back on
the network, the deposed leader does not act: it stands by, commits nothing, and a plan of its epoch
is refused.

The quick cases run in `make test`; the 30 s partition runs in `make lab-test` (lab_full).
Runs where namespaces can be made (root and `ip`), like test_lab.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
import urllib.request
from datetime import datetime
from pathlib import Path

import grpc
import pytest

from silod.lab import netns

REASON = netns.available()
if REASON and os.environ.get("CI") == "true":
    raise RuntimeError(f"tests/lab must run under CI=true: {REASON}")
pytestmark = pytest.mark.skipif(bool(REASON), reason=REASON or "namespaces available")

from silod.cli.client_commands import all_pages  # noqa: E402
from silod.lab.cluster import Lab  # noqa: E402
from silod.rpc.channels import open_channel  # noqa: E402
from silod.v1 import (  # noqa: E402
    allocation_pb2, allocation_pb2_grpc, cache_pb2, cache_pb2_grpc, common_pb2, metadata_pb2, metadata_pb2_grpc,
    scheduler_pb2, scheduler_pb2_grpc, worker_agent_pb2, worker_agent_pb2_grpc,
)
from tests.e2e.harness import LAUNCH_MARK  # noqa: E402
from tests.lab.test_lab import ROOT, rank_env, task_pids, wait_for  # noqa: E402
from worker_agent.gpus import check_exclusive  # noqa: E402

SCHEDULERS = ("scheduler", "scheduler-2")
AGENTS = ("agent-0", "agent-1")
CACHES = ("cache-0", "cache-1")
FAILOVER_S = 10.0  # the target: the standby leads within this after the leader is gone
FOLLOW_S = 5.0  # the target: every node follows the new leader within this of its election
LONG = 2  # jobs running through every failover (1 GPU each, of the lab's 2 nodes x 2 GPUs)


class Submitter(threading.Thread):
    """A client submitting a short job every ``every_s`` through either scheduler, retrying each
    with its request id until acknowledged, moving to the other scheduler when one fails (what a
    client given both addresses does)."""

    def __init__(self, lab: Lab, every_s: float = 2.5) -> None:
        super().__init__(daemon=True)
        self.stubs = [scheduler_pb2_grpc.JobServiceStub(open_channel(lab.address(s, 7073))) for s in SCHEDULERS]
        self.every_s = every_s
        self.acknowledged: dict[str, str] = {}  # name -> job id
        self.failures: list[str] = []
        self.stop = threading.Event()
        self._use = 0

    def run(self) -> None:
        n = 0
        while not self.stop.is_set():
            name = f"ha-{n:04d}"
            spec = common_pb2.JobSpec(name=name, application="cifar10", min_gpus=1, max_gpus=1, batch_size=16,
                                      sample_budget=160, emulated_step_compute_s=0.01)
            while name not in self.acknowledged and not self.stop.is_set():
                try:
                    job = self.stubs[self._use].SubmitJob(
                        scheduler_pb2.SubmitJobRequest(spec=spec, client_request_id=f"lab-ha-{name}"), timeout=4)
                    self.acknowledged[name] = job.id
                except grpc.RpcError as exc:
                    self.failures.append(f"{SCHEDULERS[self._use]}: {exc.code().name}")
                    self._use = 1 - self._use
                    time.sleep(0.2)
            n += 1
            self.stop.wait(self.every_s)


class Applied(threading.Thread):
    """Samples every agent's and cache server's applied plan version every 0.1 s (time.time()),
    from before the leader is lost, so that when each reached the new leader's first plan is known
    to the sample however late the test looks."""

    def __init__(self, lab: Lab) -> None:
        super().__init__(daemon=True)
        agents = {a: worker_agent_pb2_grpc.WorkerAgentServiceStub(open_channel(lab.address(a, 7074))) for a in AGENTS}
        caches = {c: cache_pb2_grpc.CacheServiceStub(open_channel(lab.address(c, 7071))) for c in CACHES}
        self.reads = {**{a: (lambda s=s: s.GetNodeStatus(worker_agent_pb2.GetNodeStatusRequest(), timeout=2)
                             .applied_plan_version) for a, s in agents.items()},
                      **{c: (lambda s=s: s.Stats(cache_pb2.StatsRequest(), timeout=2).plan_version)
                         for c, s in caches.items()}}
        self.samples: list[tuple[float, str, int]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            for who, read in self.reads.items():
                try:
                    self.samples.append((time.time(), who, read()))
                except grpc.RpcError:
                    pass
            self.stop.wait(0.1)

    def reached(self, version: int) -> dict[str, float]:
        """When each node was first seen at ``version`` or newer."""
        first: dict[str, float] = {}
        for at, who, applied in list(self.samples):
            if applied >= version:
                first.setdefault(who, at)
        return first


def leadership_won_at(log: str, epoch: int) -> float | None:
    """Wall time of a scheduler's JSON log line "leadership won" for ``epoch``."""
    for line in log.splitlines():
        if '"leadership won"' not in line:
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("msg") == "leadership won" and record.get("epoch") == epoch:
            return datetime.fromisoformat(record["ts"].replace("Z", "+00:00")).timestamp()
    return None


class HA:
    def __init__(self, lab: Lab) -> None:
        self.lab = lab
        self.meta = metadata_pb2_grpc.MetadataServiceStub(open_channel(lab.address("metadata", 7070)))
        self.long: list[str] = []
        self.pids: dict[str, list[int]] = {}  # long job -> its rank's pids
        self.submitter = Submitter(lab)

    def leadership(self) -> metadata_pb2.Leadership:
        return self.meta.GetLeadership(metadata_pb2.GetLeadershipRequest(), timeout=10)

    def leader(self) -> str:
        """The compose service (host) of the scheduler that holds the lease."""
        return self.leadership().address.rsplit(":", 1)[0]

    def job(self, job_id: str) -> common_pb2.Job:
        return self.meta.GetJob(metadata_pb2.GetJobRequest(job_id=job_id), timeout=10)

    def samples(self) -> dict[str, int]:
        return {j: self.job(j).progress.samples_done for j in self.long}

    def rank_pids(self, job_id: str) -> list[int]:
        return sorted(pid for host in AGENTS for pid in task_pids(self.lab, host)
                      if rank_env(pid).get("SILOD_JOB_ID") == job_id)

    def metric(self, scheduler: str, name: str) -> float | None:
        try:
            text = urllib.request.urlopen(f"http://{self.lab.address(scheduler, 9100)}/metrics", timeout=5).read().decode()
        except OSError:
            return None
        m = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
        return float(m.group(1)) if m else None

    def plans(self) -> list:  # type: ignore[type-arg]
        return all_pages(lambda token: self.meta.ListPlans(
            metadata_pb2.ListPlansRequest(page_size=100, page_token=token), timeout=10), "plans")

    def work_dir(self, agent: str) -> Path:
        return self.lab.work_dir(agent)

    def launches(self, agents: tuple[str, ...] = AGENTS) -> list[tuple[str, int, int]]:
        """(job, rank, generation) of every process the agents launched, from their task logs."""
        found = []
        for agent in agents:
            for log in sorted((self.work_dir(agent) / "jobs").glob("*/rank-*.log")):
                found += [(log.parent.name, int(m.group(2)), int(m.group(1)))
                          for m in LAUNCH_MARK.finditer(log.read_text(errors="replace"))]
        return found

    def gpu_history(self, agent: str) -> list[dict[str, object]]:
        path = self.work_dir(agent) / "gpu-table.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


@pytest.fixture(scope="module")
def ha(tmp_path_factory):
    lab = Lab(tmp_path_factory.mktemp("lab-ha"), nodes=2, inference_nodes=0)
    for name in SCHEDULERS:  # rounds every 2 s instead of 10: the cases stay short, failover is the same
        lab.services[name].environment["SILOD_INTERVAL_S"] = "2"
    with lab:
        ha = HA(lab)
        jobs = scheduler_pb2_grpc.JobServiceStub(open_channel(lab.address("scheduler", 7073)))
        for i in range(LONG):
            spec = common_pb2.JobSpec(name=f"long-{i}", application="cifar10", min_gpus=1, max_gpus=1, batch_size=16,
                                      sample_budget=100_000_000, emulated_step_compute_s=0.05,
                                      env={"SILOD_CHECKPOINT_EVERY_S": "1"})
            ha.long.append(jobs.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec, client_request_id=f"lab-ha-long-{i}"),
                                          timeout=15).id)
        wait_for(lambda: all(v > 0 for v in ha.samples().values()), 90, "the long jobs training")
        ha.pids = {j: wait_for(lambda j=j: ha.rank_pids(j), 30, f"{j}'s rank") for j in ha.long}
        ha.submitter.start()
        try:
            yield ha
        finally:
            ha.submitter.stop.set()
            ha.submitter.join(30)


def lose_the_leader(ha: HA, how) -> tuple[str, str, metadata_pb2.Leadership, float]:  # type: ignore[no-untyped-def]
    """``how(leader)`` takes the leader away under load; returns (old leader, new leader, the lease
    before, seconds until the standby held the lease), after checking that the jobs kept
    training and that submissions went on."""
    before = ha.leadership()
    old = ha.leader()
    new = next(s for s in SCHEDULERS if s != old)
    assert ha.metric(old, "silod_scheduler_leader") == 1 and ha.metric(new, "silod_scheduler_leader") == 0
    wait_for(lambda: len(ha.submitter.acknowledged) >= 2, 30, "submissions flowing")
    samples = ha.samples()
    submitted = len(ha.submitter.acknowledged)
    applied = Applied(ha.lab)
    applied.start()
    t0 = time.monotonic()
    how(old)
    wait_for(lambda: ha.leader() == new, FAILOVER_S + 5, f"{new} to lead")
    took = time.monotonic() - t0
    assert took < FAILOVER_S, f"the standby took {took:.1f}s to lead"
    lease = ha.leadership()
    assert lease.epoch == before.epoch + 1
    # Every node follows the new leader: each applies its first plan (committed at its election
    # whatever changed) within FOLLOW_S of the election.
    elected = wait_for(lambda: leadership_won_at(ha.lab.log(new), lease.epoch), 10, f"{new}'s 'leadership won'")
    first = wait_for(lambda: min((p.version for p in ha.plans() if p.epoch == lease.epoch), default=0), 20,
                     "the new leader's first plan")
    try:
        wait_for(lambda: len(applied.reached(first)) == len(applied.reads), 30, "every node following the new leader")
    finally:
        applied.stop.set()
        applied.join(10)
    following = {who: at - elected for who, at in applied.reached(first).items()}
    assert max(following.values()) < FOLLOW_S, f"nodes following the new leader, seconds after its election: {following}"
    wait_for(lambda: ha.metric(new, "silod_scheduler_leader") == 1, 10, f"{new}'s silod_scheduler_leader at 1")
    assert ha.metric(new, "silod_scheduler_leadership_epoch") == lease.epoch
    shown = ha.lab.run("agent-0", [str(ROOT / ".venv/bin/silod"), "admin", "leader", "--metadata", "metadata:7070",
                                   "--json"])
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert json.loads(shown.stdout)["address"] == f"{new}:7073" and json.loads(shown.stdout)["epoch"] == lease.epoch
    # The new leader places jobs submitted after the loss ...
    late = f"ha-{submitted + 1:04d}"
    wait_for(lambda: late in ha.submitter.acknowledged, 60, "a submission acknowledged after the loss")
    wait_for(lambda: ha.job(ha.submitter.acknowledged[late]).state == common_pb2.JOB_STATE_SUCCEEDED, 90,
             f"{late}, submitted after the loss, to run to its end")
    # ... and the running jobs kept training, in the same processes, their progress reaching it.
    wait_for(lambda: all(ha.job(j).progress.samples_done > samples[j] for j in ha.long), 45,
             "the long jobs' progress reported to the new leader")
    progress_s = time.monotonic() - t0
    for j in ha.long:
        assert ha.rank_pids(j) == ha.pids[j], f"{j} was restarted"
        assert ha.job(j).state == common_pb2.JOB_STATE_RUNNING
    print(f"[lab-ha] {old} lost: {new} led after {took:.1f}s (epoch {lease.epoch}); every node followed it "
          f"{max(following.values()):.2f}s after its election (" + ", ".join(
              f"{who} {s:+.2f}s" for who, s in sorted(following.items())) + "); running jobs' progress "
          f"reported again after {progress_s:.1f}s; {len(ha.submitter.acknowledged) - submitted} submissions "
          f"acknowledged meanwhile ({len(ha.submitter.failures)} client retries so far)")
    return old, new, before, took


def assert_the_deposed_leader_does_not_act(ha: HA, old: str, new: str, old_epoch: int) -> None:
    """Back on the network, the old leader stands by (its nodes' calls answered UNAVAILABLE naming
    the new leader), commits no plan, and the store refuses a plan of its epoch."""
    wait_for(lambda: ha.metric(old, "silod_scheduler_leader") == 0
             and ha.metric(old, "silod_scheduler_leadership_epoch") == old_epoch + 1, 30,
             f"{old} to see the new epoch and stand by")
    alloc = allocation_pb2_grpc.AllocationServiceStub(open_channel(ha.lab.address(old, 7073)))
    with pytest.raises(grpc.RpcError) as refused:
        next(iter(alloc.Watch(allocation_pb2.WatchPlanRequest(
            node="node-0", component=allocation_pb2.PLAN_COMPONENT_WORKER_AGENT), timeout=10,
            wait_for_ready=True)))  # a restarted scheduler: its connection may still be in reconnect backoff
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert f"the leader is at {new}:7073" in refused.value.details(), refused.value.details()
    time.sleep(5)  # two of its would-be rounds
    plans = ha.plans()
    first_new = min(p.version for p in plans if p.epoch == old_epoch + 1)
    late = [(p.version, p.epoch) for p in plans if p.version > first_new and p.epoch != old_epoch + 1]
    assert not late, f"plans of another epoch after the new leader's first: {late}"
    latest = ha.meta.GetLatestPlan(metadata_pb2.GetLatestPlanRequest(), timeout=10)
    stale = type(latest)()
    stale.CopyFrom(latest)
    stale.version, stale.epoch = latest.version + 1, old_epoch
    with pytest.raises(grpc.RpcError) as fenced:
        ha.meta.CommitPlan(metadata_pb2.CommitPlanRequest(plan=stale), timeout=10)
    assert fenced.value.code() == grpc.StatusCode.FAILED_PRECONDITION, fenced.value
    assert f"epoch {old_epoch} is older" in fenced.value.details()


def assert_nothing_lost_or_doubled(ha: HA) -> None:
    acknowledged = dict(ha.submitter.acknowledged)
    listed = [j for j in all_pages(lambda token: ha.meta.ListJobs(
        metadata_pb2.ListJobsRequest(page_size=100, page_token=token), timeout=10), "jobs") if j.spec.name.startswith("ha-")]
    names = [j.spec.name for j in listed]
    assert len(names) == len(set(names)), "a submission stored twice"
    stored = {j.spec.name: j.id for j in listed}
    assert {n: stored.get(n) for n in acknowledged} == acknowledged, "an acknowledged submission is missing"
    launches = ha.launches()
    assert len(launches) == len(set(launches)), f"a generation launched twice: {sorted(launches)}"
    for j in ha.long:
        mine = [(r, g) for job, r, g in launches if job == j]
        assert len(mine) == 1, f"{j} launched again: {mine}"
    for agent in AGENTS:
        history = ha.gpu_history(agent)
        assert history, f"{agent}: no GPU table log"
        check_exclusive(history)  # no GPU ever held by two tasks
        acquired = sorted(str(e["task"]) for e in history if e["event"] == "acquire")
        launched = sorted(f"{job}/{rank}/{generation}" for job, rank, generation in ha.launches((agent,)))
        assert acquired == launched, f"{agent}: GPU table acquires differ from launched processes"
    leader = ha.leader()
    assert ha.metric(leader, "silod_scheduler_gpu_double_held_total") == 0


def test_the_leaders_host_cut_off_the_standby_leads_and_the_deposed_leader_cannot_act(ha: HA) -> None:
    cut: list[str] = []

    def pull_the_cable(host: str) -> None:
        ha.lab.link(host, up=False)
        cut.append(host)

    try:
        old, new, before, _ = lose_the_leader(ha, pull_the_cable)
    finally:
        for host in cut:
            ha.lab.link(host, up=True)
    assert_the_deposed_leader_does_not_act(ha, old, new, before.epoch)
    assert_nothing_lost_or_doubled(ha)


def test_kill_9_of_the_leader_the_standby_leads_and_the_restarted_one_stands_by(ha: HA) -> None:
    def kill_9(host: str) -> None:
        os.killpg(ha.lab.procs[host].pid, signal.SIGKILL)
        ha.lab.procs[host].wait(10)

    old, new, before, _ = lose_the_leader(ha, kill_9)
    ha.lab.start(old)  # as compose's restart policy would
    wait_for(lambda: ha.lab.healthy(old), 60, f"{old} serving again")
    assert_the_deposed_leader_does_not_act(ha, old, new, before.epoch)
    assert ha.leader() == new
    assert_nothing_lost_or_doubled(ha)


@pytest.mark.lab_full  # a 30 s partition of the leader's host: `make lab-test` (tests/lab/conftest.py)
def test_the_leaders_host_cut_off_for_30s_under_load(ha: HA) -> None:
    cut: list[tuple[str, float]] = []

    def pull_the_cable(host: str) -> None:
        ha.lab.link(host, up=False)
        cut.append((host, time.monotonic()))

    try:
        old, new, before, _ = lose_the_leader(ha, pull_the_cable)
        while time.monotonic() - cut[0][1] < 30:  # the jobs keep training, the new leader stays
            at = ha.samples()
            time.sleep(3)
            assert ha.leader() == new, "leadership moved while the old leader was cut off"
            assert all(ha.job(j).progress.samples_done > at[j] for j in ha.long), "a long job stopped progressing"
    finally:
        for host, _ in cut:
            ha.lab.link(host, up=True)
    assert_the_deposed_leader_does_not_act(ha, old, new, before.epoch)
    assert_nothing_lost_or_doubled(ha)
