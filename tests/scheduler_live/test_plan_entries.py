"""A round's plan built from the plan in force (scheduler.live.entries) is the plan built whole.

Rounds of real policies over a changing cluster (jobs end and arrive, messages change, restarts,
GPU types change, a policy that resizes in place): every plan the incremental builder makes
must equal, entry for entry, the plan a fresh planner builds from the same inputs, and what it
says it changed must be exactly what differs from the plan in force.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from estimator.job_model import JobModel
from scheduler.live import convert, entries
from scheduler.live.gpu_health import UsableGpus
from scheduler.live.inference import LiveInference
from scheduler.live.planner import RoundPlanner, configured_policy
from scheduler.plan_changes import changes_between
from scheduler.policies.fifo_queue import FifoQueue
from scheduler.policy import ChangedSince, ClusterSnapshot, JobInfo, NodeInfo, Plan
from silod.v1 import common_pb2, plan_pb2

MODEL = JobModel.from_profile("cifar10")


class Cluster:
    """Nodes, jobs (their messages and JobInfos) and the plan in force, changed at random."""

    def __init__(self, rng: random.Random, nodes: int, jobs: int) -> None:
        self.rng = rng
        self.types = ["v100"] * nodes
        self.messages: dict[str, common_pb2.Job] = {}
        self.infos: dict[str, JobInfo] = {}
        self.nodes = nodes
        self.arrived = 0
        for _ in range(jobs):
            self.arrive()

    def arrive(self) -> None:
        self.arrived += 1
        job_id = f"job-{self.arrived:04d}"
        low = self.rng.randint(1, 3)
        high = low + self.rng.choice([0, 0, 2, 5])
        message = common_pb2.Job(id=job_id, state=common_pb2.JOB_STATE_PENDING)
        message.spec.min_gpus, message.spec.max_gpus = low, high
        message.spec.batch_size = self.rng.choice([0, 64])
        message.spec.max_batch_size = 256 if message.spec.batch_size else 0
        message.spec.resize_in_place = self.rng.random() < 0.5
        self.messages[job_id] = message
        self.infos[job_id] = JobInfo(job_id=job_id, model=MODEL, submit_time_s=float(self.arrived), min_gpus=low,
                                     max_gpus=high, target_samples=1e7, samples_done=self.rng.uniform(0, 1e6),
                                     attained_gpu_s=self.rng.uniform(0, 1e4), batch_size=message.spec.batch_size)

    def leave(self, job_id: str) -> None:
        del self.messages[job_id], self.infos[job_id]

    def touch(self, job_id: str) -> None:
        """A new message for the job (KnownJobs hands out a new one on any change): its state or
        progress moved, or (half the time) its spec changed."""
        message = common_pb2.Job()
        message.CopyFrom(self.messages[job_id])
        message.progress.samples_done += 100
        if self.rng.random() < 0.5:
            message.spec.batch_size = self.rng.choice([0, 32, 64])
        self.messages[job_id] = message

    def snapshot(self, base: plan_pb2.AllocationPlan | None, time_s: float) -> ClusterSnapshot:
        # The same tuple while no node changes, as the live snapshot keeps it (fifo's queue holds to it).
        nodes = tuple(NodeInfo(name=f"node-{k:03d}", gpus=4, gpu_type=self.types[k]) for k in range(self.nodes))
        if nodes != getattr(self, "_nodes", None):
            self._nodes = nodes
        nodes = self._nodes
        return ClusterSnapshot(time_s=time_s, nodes=nodes, jobs=tuple(self.infos.values()),
                               current=convert.plan_from_proto(base))

    def move_on(self, plan: plan_pb2.AllocationPlan) -> None:
        """The round after ``plan``: a few placed jobs end, some arrive, some messages change."""
        placed = [e.job_id for e in plan.jobs if e.placements]
        for job_id in self.rng.sample(placed, min(3, len(placed))):
            self.leave(job_id)
        for _ in range(self.rng.randint(0, 4)):
            self.arrive()
        for job_id in self.rng.sample(sorted(self.messages), 3):
            self.touch(job_id)

    def node_messages(self) -> list[common_pb2.Node]:
        return [common_pb2.Node(spec=common_pb2.NodeSpec(name=f"node-{k:03d}", gpus=4, gpu_type=self.types[k]))
                for k in range(self.nodes)]


def _planner(policy_name: str, cache_mode: str = "lru") -> RoundPlanner:
    policy, co_designs = configured_policy(policy_name, cache_mode)
    return RoundPlanner(policy, policy_name, co_designs, cache_mode, LiveInference(policy))


def _by_job(plan: plan_pb2.AllocationPlan) -> dict[str, bytes]:
    return {e.job_id: e.SerializeToString(deterministic=True) for e in plan.jobs}


@pytest.mark.parametrize("policy_name", ["fifo", "sjf", "tiresias", "deepboot"])
def test_incremental_plans_equal_whole_plans_round_after_round(policy_name: str) -> None:
    rng = random.Random(7)
    cluster = Cluster(rng, nodes=30, jobs=90)
    incremental = _planner(policy_name)
    base: plan_pb2.AllocationPlan | None = None
    patched = []
    answered: list[str] = []  # fifo: from its kept queue, or a whole pass
    for round_number in range(1, 25):
        snap = cluster.snapshot(base, time_s=1000.0 * round_number)
        jobs = list(cluster.messages.values())
        usable = UsableGpus(cluster.node_messages())
        busy = {gpu: e.job_id for e in base.jobs for gpu in convert.ranks_of(e)} if base is not None else {}
        restarting = frozenset(rng.sample(sorted(cluster.messages), 2)) if round_number % 6 == 0 else frozenset()
        built = incremental.plan(snap, jobs, usable, base=base, busy=busy, restarting=restarting, reason="test")
        whole = _planner(policy_name).plan(snap, jobs, usable, base=base, busy=busy, restarting=restarting,
                                           reason="test")
        assert _by_job(built) == _by_job(whole), f"round {round_number}"
        queue = getattr(incremental.policy, "queue", None)
        if isinstance(queue, FifoQueue):
            answered.append(queue.last_call if queue.last_call == "queue" else queue.why_whole)
        assert incremental.placements == {e.job_id: convert.placement_of(e) for e in whole.jobs}
        if base is not None:
            expected = changes_between(_by_job(base), _by_job(whole))
            changes = incremental.changes
            assert changes is not None
            assert set(changes.upserts) == set(expected.upserts)
            assert set(changes.removals) == set(expected.removals)
            assert {j: e.SerializeToString(deterministic=True) for j, e in changes.upserts.items()} == \
                {j: _by_job(whole)[j] for j in expected.upserts}
            old = _by_job(base)
            assert {j: e.SerializeToString(deterministic=True) for j, e in changes.previous.items()} == \
                {j: old[j] for j in (*expected.upserts, *expected.removals) if j in old}
            patched.append(incremental.entries.patched)
        # Committed as built (the metadata store keeps the scheduler's objects), then the cluster moves on.
        built.version = round_number
        convert.remember_placements(built, incremental.placements)
        base = built
        cluster.move_on(base)
        if round_number % 8 == 0:  # a node changes type: every entry's context changes
            k = rng.randrange(cluster.nodes)
            cluster.types[k] = "p100" if cluster.types[k] == "v100" else "v100"
    # Built from the plan in force every round but those after a node changed type.
    assert [n for n, p in enumerate(patched, start=2) if not p] == [9, 17]
    if policy_name == "fifo":  # its queue answered every round from the third until the cluster got two GPU types
        assert answered[:8] == ["no queue for these nodes"] * 2 + ["queue"] * 6, answered[:8]


def _job_changes(before: dict[str, common_pb2.Job], after: dict[str, common_pb2.Job]) -> ChangedSince:
    """KnownJobs.changed_since from one round's messages to the next's: new jobs last, in order."""
    entries = {job_id: after.get(job_id) for job_id in before if before[job_id] is not after.get(job_id)}
    entries.update((job_id, job) for job_id, job in after.items() if job_id not in before)
    return ChangedSince(before, after, entries)


@pytest.mark.parametrize("policy_name", ["fifo", "sjf", "tiresias", "themis"])
def test_plans_that_follow_the_hints_equal_whole_plans(policy_name: str) -> None:
    """As the live scheduler runs it: the current plan from Holdings, the holders of the GPUs
    from the plan in force, and the jobs' and policy's hints (fifo, sjf and tiresias give one, themis none). The
    entries follow the hints where the whole chain gives them, and the plans are still the whole ones."""
    from scheduler.live.holdings import Holdings
    from scheduler.live.releases import BusyGpus

    rng = random.Random(11)
    cluster = Cluster(rng, nodes=30, jobs=90)
    incremental = _planner(policy_name, "silod")  # the default: no cache and no IO budget here, nothing to grant
    committed: list[tuple[plan_pb2.AllocationPlan | None, plan_pb2.AllocationPlan, object]] = []

    def changes_from(plan):  # type: ignore[no-untyped-def]  # as PlanStore.changes_from
        if not committed:
            return None
        base, _, changes = committed[-1]
        return changes if plan is base and plan is not None else None

    holdings = Holdings(changes_from)
    base: plan_pb2.AllocationPlan | None = None
    last_messages: dict[str, common_pb2.Job] | None = None
    last_jobs: tuple | None = None
    looked = []
    for round_number in range(1, 25):
        messages = dict(cluster.messages)
        snap = cluster.snapshot(base, time_s=1000.0 * round_number)
        alive = {info.name: info for info in snap.nodes}
        usable = UsableGpus(cluster.node_messages())
        current = holdings.current(base, {j: m.spec.min_gpus for j, m in messages.items()}, alive, usable)
        snap = dataclasses.replace(snap, current=current)
        if last_jobs is not None:
            old = {info.job_id: info for info in last_jobs}
            now = {info.job_id: info for info in snap.jobs}
            snap = dataclasses.replace(snap, jobs_changed=ChangedSince(last_jobs, snap.jobs, {
                j: now.get(j) for j in old.keys() | now.keys() if old.get(j) is not now.get(j)}))
        job_changes = _job_changes(last_messages, messages) if last_messages is not None else None
        held = {gpu: e.job_id for e in base.jobs for gpu in convert.ranks_of(e)} if base is not None else {}
        busy = BusyGpus(held, {}, current_follows_held=True)
        jobs = list(messages.values())
        restarting = frozenset(rng.sample(sorted(messages), 2)) if round_number % 6 == 0 else frozenset()
        built = incremental.plan(snap, jobs, usable, base=base, busy=busy, restarting=restarting, reason="test",
                                 job_changes=job_changes)
        whole = _planner(policy_name, "silod").plan(snap, jobs, usable, base=base, busy=busy, restarting=restarting,
                                                    reason="test")
        assert _by_job(built) == _by_job(whole), f"round {round_number}"
        if base is not None:
            assert set(incremental.changes.upserts) == set(changes_between(_by_job(base), _by_job(whole)).upserts)
        looked.append(incremental.entries.last_looked)
        built.version = round_number
        convert.remember_placements(built, incremental.placements)
        committed.append((base, built, incremental.changes))
        base, last_messages, last_jobs = built, messages, snap.jobs
        cluster.move_on(base)
    followed = [n for n in looked if n is not None]
    if policy_name in ("fifo", "sjf", "tiresias"):  # from its memo on (the third round), the whole chain gives hints
        assert len(followed) >= 18 and max(followed) < 40, looked
    else:
        assert not followed, looked


def _first_plan(seed: int) -> tuple[Cluster, RoundPlanner, UsableGpus, plan_pb2.AllocationPlan]:
    """A small cluster, a fifo planner and its first plan (version 1)."""
    cluster = Cluster(random.Random(seed), nodes=10, jobs=30)
    planner = _planner("fifo")
    usable = UsableGpus(cluster.node_messages())
    first = planner.plan(cluster.snapshot(None, 1.0), list(cluster.messages.values()), usable, base=None, busy={},
                         restarting=frozenset(), reason="test")
    first.version = 1
    return cluster, planner, usable, first


def test_a_plan_not_built_here_is_built_whole() -> None:
    """Reuse holds only for the plan the builder made (or its unchanged base): a plan in force
    read from the store, here a copy of the built one, gets every entry rebuilt, and the same plan."""
    cluster, planner, usable, first = _first_plan(seed=3)
    from_store = plan_pb2.AllocationPlan()
    from_store.CopyFrom(first)
    cluster.leave(next(e.job_id for e in first.jobs if e.placements))
    snap = cluster.snapshot(from_store, 2.0)
    jobs = list(cluster.messages.values())
    second = planner.plan(snap, jobs, usable, base=from_store, busy={}, restarting=frozenset(), reason="test")
    assert not planner.entries.patched
    whole = _planner("fifo").plan(snap, jobs, usable, base=from_store, busy={}, restarting=frozenset(), reason="test")
    assert _by_job(second) == _by_job(whole)
    assert len(planner.changes.removals) == 1


def test_a_plan_in_force_in_the_stores_order_is_followed_by_job_not_by_position() -> None:
    """A restarted scheduler's plan in force is read from the store, its entries in the store's
    order, not in the order of the jobs. A round that changes nothing leaves it in force; the next
    round's entries built from it must find each job's entry where that plan has it (found in a
    restart test: the entries of other jobs were overwritten and removed, so a running job's
    entry vanished from the scheduler's plan and its end was never taken in)."""
    cluster, _, usable, first = _first_plan(seed=3)
    from_store = plan_pb2.AllocationPlan()
    from_store.CopyFrom(first)
    entries_in_store_order = [plan_pb2.JobAllocation.FromString(e.SerializeToString())
                              for e in sorted(first.jobs, key=lambda e: e.job_id, reverse=True)]
    del from_store.jobs[:]
    from_store.jobs.extend(entries_in_store_order)
    restarted = _planner("fifo")
    jobs = list(cluster.messages.values())
    restarted.plan(cluster.snapshot(from_store, 2.0), jobs, usable, base=from_store, busy={},
                   restarting=frozenset(), reason="test")
    assert not restarted.changes  # nothing to commit: the plan read stays in force
    for job_id in [e.job_id for e in first.jobs if e.placements][:2]:
        cluster.leave(job_id)
    jobs = list(cluster.messages.values())
    snap = cluster.snapshot(from_store, 3.0)
    second = restarted.plan(snap, jobs, usable, base=from_store, busy={}, restarting=frozenset(), reason="test")
    whole = _planner("fifo").plan(snap, jobs, usable, base=from_store, busy={}, restarting=frozenset(), reason="test")
    assert _by_job(second) == _by_job(whole)
    assert {j: e.SerializeToString(deterministic=True) for j, e in restarted.changes.upserts.items()} == \
        {j: b for j, b in _by_job(whole).items() if _by_job(from_store).get(j) != b}
    assert set(restarted.changes.removals) == set(_by_job(from_store)) - set(_by_job(whole))


def test_many_changes_build_every_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the share of changed jobs a patch is worth, the builder builds the plan whole."""
    monkeypatch.setattr(entries, "PATCH_ALWAYS_UP_TO", 0)
    cluster, planner, usable, first = _first_plan(seed=5)
    convert.remember_placements(first, planner.placements)
    for job_id in list(cluster.messages)[:20]:  # a new spec each (a new message with the same spec reuses the entry)
        message = common_pb2.Job()
        message.CopyFrom(cluster.messages[job_id])
        message.spec.batch_size += 8
        cluster.messages[job_id] = message
    calls = []
    full = planner.entries._full
    monkeypatch.setattr(planner.entries, "_full", lambda *a, **k: (calls.append(1), full(*a, **k)))
    second = planner.plan(cluster.snapshot(first, 2.0), list(cluster.messages.values()), usable, base=first,
                          busy={}, restarting=frozenset(), reason="test")
    assert calls == [1]
    assert {e.job_id for e in second.jobs} == set(cluster.messages)


@pytest.mark.parametrize("hints", [False, True])
def test_a_resized_entry_is_rebuilt_once_more_without_its_fast_resize(hints: bool) -> None:
    """The plan that resizes a job in place marks its entry fast_resize; the next plan carries
    the entry without the mark and in the same generation, as a whole build would: one upsert
    more, then none. A restart then gives it a new generation. With ``hints`` saying nothing
    changed of the job or its allocation, the entry is rebuilt all the same."""
    from scheduler.live.entries import EntryBuilder
    from scheduler.policy import Allocation

    job = common_pb2.Job(id="job-1", state=common_pb2.JOB_STATE_RUNNING)
    job.spec.min_gpus, job.spec.max_gpus, job.spec.resize_in_place = 1, 4, True
    two = Plan({"job-1": Allocation(placement=(("node-a", (0, 1)),))})
    four = Plan({"job-1": Allocation(placement=(("node-a", (0, 1, 2, 3)),))})
    active = {"job-1": job}
    builder = EntryBuilder()
    base = None
    last_plan = None
    seen = []
    for version, plan in enumerate([two, four, four, four, four], start=1):
        proto = plan_pb2.AllocationPlan(version=version)
        restarting = frozenset({"job-1"}) if version == 5 else frozenset()

        def fill(entry, job, alloc, placement):  # type: ignore[no-untyped-def]
            for node, idx in (alloc.placement if alloc is not None else ()):
                entry.placements.add(node=node, gpu_indices=list(idx))

        job_changes = None
        if hints and last_plan is not None:
            plan = Plan(plan.allocations, changed=ChangedSince(
                last_plan.allocations, plan.allocations, {} if plan.allocations is last_plan.allocations else
                dict(plan.allocations)))
            job_changes = ChangedSince(active, active, {})
        builder.build(proto, [job], plan, base=base, restarting=restarting, context=(), node_types={},
                      policy_afe=False, fill=fill, job_changes=job_changes)
        if hints and version > 2:
            assert builder.last_looked is not None, "the hints were followed"
        convert.remember_placements(proto, builder.placements)
        entry = proto.jobs[0]
        seen.append((entry.generation, entry.fast_resize, sorted(builder.changes.upserts) if builder.changes is not None else None))
        base, last_plan = proto, plan
    assert seen == [(1, False, None), (2, True, ["job-1"]), (2, False, ["job-1"]), (2, False, []), (3, False, ["job-1"])]
    assert builder.patched


def test_what_jobs_hold_follows_each_plan_by_its_changes() -> None:
    """The snapshot's current plan, carried from plan to plan by their changes (scheduler.live.holdings),
    is the one converted from the whole plan in force: same allocations in the same order, also
    after nodes are lost and GPUs fault."""
    from scheduler.live.holdings import Holdings

    rng = random.Random(13)
    cluster = Cluster(rng, nodes=20, jobs=60)
    planner = _planner("tiresias")
    committed: list[tuple[plan_pb2.AllocationPlan | None, plan_pb2.AllocationPlan, object]] = []

    followed = []

    def changes_from(plan):  # type: ignore[no-untyped-def]  # as PlanStore.changes_from
        base, latest, changes = committed[-1]
        known = changes if plan is base and plan is not None else None
        followed.append(known is not None and known.in_place)
        return known

    holdings = Holdings(changes_from)
    base = None
    previous = None
    for version in range(1, 16):
        jobs = list(cluster.messages.values())
        node_messages = cluster.node_messages()
        if version % 5 == 0:  # a node lost, and a GPU faulted on another
            node_messages = node_messages[1:]
            node_messages[0].gpu_faults.add(index=1)
        usable = UsableGpus(node_messages)
        alive = {n.spec.name: convert.node_info(n) for n in node_messages}
        min_gpus = {j.id: j.spec.min_gpus for j in jobs}
        held = holdings.current(base, min_gpus, alive, usable)
        fresh = Holdings(lambda _: None).current(base, min_gpus, alive, usable)
        assert list(held.allocations.items()) == list(fresh.allocations.items()), f"version {version}"
        if previous is None:
            assert held.changed is None
        else:  # the hint names every job whose allocation is not the last answer's object
            assert held.changed is not None and held.changed.follows(previous.allocations, held.allocations)
            for job_id in previous.allocations.keys() | held.allocations.keys():
                now = held.allocations.get(job_id)
                if job_id in held.changed.entries:
                    assert held.changed.entries[job_id] is now
                else:
                    assert previous.allocations.get(job_id) is now, f"version {version}: {job_id}"
        previous = held
        snap = dataclasses.replace(cluster.snapshot(None, 100.0 * version), nodes=tuple(alive.values()),
                                   current=held)
        plan = planner.plan(snap, jobs, usable, base=base, busy={}, restarting=frozenset(), reason="test")
        whole = _planner("tiresias").plan(snap, jobs, usable, base=base, busy={}, restarting=frozenset(), reason="test")
        assert _by_job(plan) == _by_job(whole), f"version {version}"
        plan.version = version
        convert.remember_placements(plan, planner.placements)
        committed.append((base, plan, planner.changes))
        base = plan
        placed = [e.job_id for e in plan.jobs if e.placements]
        for job_id in rng.sample(placed, min(2, len(placed))):
            cluster.leave(job_id)
        for _ in range(rng.randint(1, 3)):
            cluster.arrive()
    # Plans 2-14 each followed by its changes, those after a node was lost and came back included.
    assert followed == [True] * 13


def test_gpu_metrics_follow_each_plan_by_its_changes() -> None:
    """The GPUs-by-state figures, recounted only on the nodes a plan's changes touch, equal a
    count of the whole plan, plan after plan (also when a node's GPU faults)."""
    from scheduler.live import metrics

    rng = random.Random(17)
    cluster = Cluster(rng, nodes=15, jobs=50)
    planner = _planner("fifo")
    usable = UsableGpus(cluster.node_messages())
    history: list[tuple[plan_pb2.AllocationPlan | None, plan_pb2.AllocationPlan, object]] = []

    def changes_from(plan):  # type: ignore[no-untyped-def]  # as PlanStore.changes_from
        return history[-1][2] if history and plan is history[-1][0] and plan is not None else None

    base = None
    nodes = cluster.snapshot(None, 0.0).nodes  # the same tuple every round, as the snapshot keeps it
    recounted_whole = []
    for version in range(1, 12):
        snap = dataclasses.replace(cluster.snapshot(base, 10.0 * version), nodes=nodes)
        counted_before = metrics._counted
        plan = planner.plan(snap, list(cluster.messages.values()), usable, base=base, busy={},
                            restarting=frozenset(), reason="test")
        plan.version = version
        convert.remember_placements(plan, planner.placements)
        history.append((base, plan, planner.changes))
        faulted = {"node-003": frozenset({1})} if version >= 8 else {}
        metrics.plan_in_force(plan, snap, faulted, changes_from)
        if metrics._counted is not counted_before:
            recounted_whole.append(version)
        whole = metrics._Counted(plan, snap.nodes, dict(faulted))
        whole.recount(metrics._PlanGpus.of(plan), snap.nodes, faulted)
        assert metrics._counted.counts == whole.counts, f"version {version}"
        expected = metrics._PlanGpus.of(plan)
        followed = metrics._in_force[1]
        assert (followed.cache_bytes, followed.io_bytes_per_s) == (expected.cache_bytes, expected.io_bytes_per_s)
        assert {n: set(i) for n, i in followed.training.items() if i} == {n: set(i) for n, i in expected.training.items() if i}
        base = plan
        for job_id in rng.sample([e.job_id for e in plan.jobs if e.placements], 2):
            cluster.leave(job_id)
        cluster.arrive()
    # Every node counted for the first plan and when the faulted GPUs changed; else only the touched ones.
    assert recounted_whole == [1, 8]
