"""The nodes' parts of the plan in force, cut again only where plans changed them
(scheduler.live.node_views, through scheduler.live.plans.PlanStore): after any sequence of plans
known by their changes, every node's part says what a whole cut of the plan in force says, while
only the first cut goes over every job; a node whose part no plan changed is not sent it again,
and a node that connects is sent its part as of the plan in force."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from benchmarks.plan_cut import StoreCore  # watch_node's view of a bare PlanStore
from scheduler.allocation.follower import _applied
from scheduler.live import convert
from scheduler.live.clients import Clients
from scheduler.live.entries import EntryChanges
from scheduler.live.plans import PlanStore
from scheduler.live.watch import as_of, watch_node
from silod.v1 import allocation_pb2, common_pb2, plan_pb2

NODES = 24
GPUS = 4


class _StoreWithoutSpecs:
    """The metadata service, asked for a spec the scheduler lacks: unreachable (the part is cut
    without it, and again once it is known)."""

    async def GetJob(self, request, **kwargs):  # type: ignore[no-untyped-def]  # noqa: N802
        raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "down")


def _store(rng: random.Random) -> PlanStore:
    store = PlanStore(Clients(md=_StoreWithoutSpecs()))  # type: ignore[arg-type]  # every address is known
    for n in range(NODES):
        store.agent_addresses[f"n{n}"] = f"10.0.0.{n}:7000"
        store.cache_addresses[f"n{n}"] = f"10.0.0.{n}:7001"
    return store


def _said(view: plan_pb2.NodePlan) -> list:
    return [(f.number, value) for f, value in view.ListFields() if f.name != "version"]


def _entry(rng: random.Random, job_id: str, free: list[tuple[str, int]]) -> plan_pb2.JobAllocation | None:
    """A job on 1-3 free GPUs (taken from ``free``), sometimes with a cache grant on another node."""
    want = rng.randint(1, 3)
    if len(free) < want:
        return None
    entry = plan_pb2.JobAllocation(job_id=job_id, generation=1, batch_size=32, master_port=29500 + rng.randrange(500))
    picked = [free.pop(rng.randrange(len(free))) for _ in range(want)]
    by_node: dict[str, list[int]] = {}
    for node, gpu in picked:
        by_node.setdefault(node, []).append(gpu)
    for node, gpus in sorted(by_node.items()):
        entry.placements.add(node=node, gpu_indices=sorted(gpus))
    if rng.random() < 0.3:
        entry.cache_grants.add(node=f"n{rng.randrange(NODES)}", cache_quota_bytes=1 << 20, remote_io_bytes_per_s=1_000_000)
    return entry


def _check(store: PlanStore, views: dict[str, plan_pb2.NodePlan], plan: plan_pb2.AllocationPlan) -> None:
    whole = convert.node_plans(plan, store.specs, store.agent_addresses, store.cache_addresses)
    assert set(views) == set(whole)
    for node, view in whole.items():
        assert _said(views[node]) == _said(view), node


@pytest.mark.parametrize("seed", range(12))
def test_parts_cut_by_changes_say_what_a_whole_cut_says(seed: int) -> None:
    rng = random.Random(seed)

    async def main() -> None:
        store = _store(rng)
        free = [(f"n{n}", g) for n in range(NODES) for g in range(GPUS)]
        plan = plan_pb2.AllocationPlan(version=1, epoch=1)
        for j in range(30):
            entry = _entry(rng, f"j{j}", free)
            if entry is not None:
                plan.jobs.append(entry)
                if rng.random() < 0.9:  # some specs arrive only later
                    store.specs[entry.job_id] = common_pb2.JobSpec(name=entry.job_id, dataset="d")
        plan.replicas.add(node="n0", application="svc", replica_id="r0")
        await store.set_latest(plan)
        _check(store, await store._views_of(plan), plan)
        held, next_job = plan, 100
        for version in range(2, 40):
            changes = plan_pb2.PlanChanges(base_version=held.version)
            for entry in rng.sample(list(held.jobs), min(len(held.jobs), rng.randint(0, 3))):
                if rng.random() < 0.5:  # ended: its GPUs free
                    changes.removed_job_ids.append(entry.job_id)
                    free.extend((p.node, g) for p in entry.placements for g in p.gpu_indices)
                else:  # restarted elsewhere, or the same GPUs at a new generation
                    moved = changes.jobs.add()
                    moved.CopyFrom(entry)
                    moved.generation += 1
            for _ in range(rng.randint(0, 3)):
                entry = _entry(rng, f"j{next_job}", free)
                next_job += 1
                if entry is not None:
                    changes.jobs.append(entry)
                    store.specs[entry.job_id] = common_pb2.JobSpec(name=entry.job_id, dataset="d")
            header = plan_pb2.AllocationPlan(version=version, epoch=1)
            if rng.random() < 0.2:
                header.loans.add(node=f"n{rng.randrange(NODES)}", job_id="borrower", gpu_index=0)
            else:
                header.loans.extend(held.loans)
            header.replicas.extend(held.replicas)
            if rng.random() < 0.15:  # an agent restarted at another address
                store.agent_addresses[f"n{rng.randrange(NODES)}"] = f"10.1.0.{version}:7000"
            if rng.random() < 0.15:  # a late spec arrives
                missing = [e.job_id for e in held.jobs if e.job_id not in store.specs]
                if missing:
                    store.specs[missing[0]] = common_pb2.JobSpec(name=missing[0], dataset="late")
            upserts = {e.job_id: e for e in changes.jobs}
            removals = tuple(changes.removed_job_ids)
            previous = {j: e for j in (*upserts, *removals) if (e := store.allocation(j)) is not None}
            plan = _applied(held, header, changes)
            await store.set_latest(plan, base=held, changes=EntryChanges(upserts, removals, previous, in_place=True))
            if rng.random() < 0.7:  # watchers ask for most plans; those no one asked for are cut with the next
                _check(store, await store._views_of(plan), plan)
            held = plan
        _check(store, await store._views_of(held), held)
        assert store.node_views.whole_cuts == 1

    asyncio.run(main())


def test_a_plan_not_known_by_its_changes_or_of_a_new_epoch_is_cut_whole() -> None:
    async def main() -> None:
        store = _store(random.Random(0))
        free = [(f"n{n}", g) for n in range(NODES) for g in range(GPUS)]
        first = plan_pb2.AllocationPlan(version=1, epoch=1, jobs=[_entry(random.Random(1), "a", free)])
        await store.set_latest(first)
        await store._views_of(first)
        read = plan_pb2.AllocationPlan(version=2, epoch=1, jobs=list(first.jobs))  # read whole from the store
        await store.set_latest(read)
        _check(store, await store._views_of(read), read)
        assert store.node_views.whole_cuts == 2
        changes = EntryChanges({}, (), {}, in_place=True)
        new_epoch = plan_pb2.AllocationPlan(version=3, epoch=2, jobs=list(read.jobs))
        await store.set_latest(new_epoch, base=read, changes=changes)
        _check(store, await store._views_of(new_epoch), new_epoch)
        assert store.node_views.whole_cuts == 3 and all(v.epoch == 2 for v in store._views.values())

    asyncio.run(main())


def _waiting(store: PlanStore, node: str) -> bool:
    return bool(store._node_waiters.get(node))


def test_a_node_is_sent_its_part_when_it_changes_and_as_of_the_plan_in_force() -> None:
    async def until(done, what: str) -> None:  # type: ignore[no-untyped-def]
        for _ in range(1000):
            if done():
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"timed out waiting for {what}")

    async def main() -> None:
        store = _store(random.Random(0))
        plan = plan_pb2.AllocationPlan(version=1, epoch=1)
        plan.jobs.add(job_id="a", generation=1).placements.add(node="n1", gpu_indices=[0])
        plan.jobs.add(job_id="b", generation=1).placements.add(node="n2", gpu_indices=[0])
        await store.set_latest(plan)
        got: list[plan_pb2.NodePlan] = []

        async def watch(node: str) -> None:
            request = allocation_pb2.WatchPlanRequest(node=node)
            async for sent in watch_node(StoreCore(store), request, refresh_s=60.0, node_timeout_s=30.0):
                got.append(sent)

        first = asyncio.ensure_future(watch("n1"))
        await until(lambda: len(got) == 1 and _waiting(store, "n1"), "the first part, then a wait")
        held = plan
        for version in (2, 3):  # b restarts on n2: n1's part stays as it was
            plan = plan_pb2.AllocationPlan(version=version, epoch=1, jobs=list(held.jobs))
            plan.jobs[1].generation = version
            await store.set_latest(plan, base=held, changes=EntryChanges(
                {"b": plan.jobs[1]}, (), {"b": held.jobs[1]}, in_place=True))
            held = plan
            await until(lambda: _waiting(store, "n1") and store._views_version == version,
                        f"plan {version} cut, and the watcher waiting")
        assert [(p.node, p.version) for p in got] == [("n1", 1)]  # nothing sent for plans 2 and 3
        second = asyncio.ensure_future(watch("n1"))  # the node's agent reconnects
        await until(lambda: len(got) == 2, "the reconnected watch's first part")
        assert [(p.node, p.version) for p in got] == [("n1", 1), ("n1", 3)]
        assert store._views["n1"].version == 1  # the kept part is shared, not changed
        for task in (first, second):
            task.cancel()
        await asyncio.gather(first, second, return_exceptions=True)

    asyncio.run(main())


def test_as_of_copies_only_a_part_cut_for_an_earlier_plan() -> None:
    plan = plan_pb2.AllocationPlan(version=5, epoch=2)
    current = plan_pb2.NodePlan(version=5, epoch=2, node="n")
    assert as_of(current, plan) is current
    kept = plan_pb2.NodePlan(version=3, epoch=2, node="n")
    sent = as_of(kept, plan)
    assert (sent.version, sent.epoch, sent.node) == (5, 2, "n") and kept.version == 3


def test_a_plan_known_by_its_changes_wakes_the_watchers_of_the_nodes_it_changes_only() -> None:
    async def main() -> None:
        store = _store(random.Random(0))
        held = plan_pb2.AllocationPlan(version=1, epoch=1)
        held.jobs.add(job_id="a", generation=1).placements.add(node="n1", gpu_indices=[0])
        held.jobs.add(job_id="b", generation=1).placements.add(node="n2", gpu_indices=[0])
        store.specs.update(a=common_pb2.JobSpec(name="a"), b=common_pb2.JobSpec(name="b"))
        await store.set_latest(held)
        await store._views_of(held)

        async def restart_b(version: int) -> None:
            nonlocal held
            plan = plan_pb2.AllocationPlan(version=version, epoch=1, jobs=list(held.jobs))
            plan.jobs[1].generation = version
            await store.set_latest(plan, base=held, changes=EntryChanges(
                {"b": plan.jobs[1]}, (), {"b": held.jobs[1]}, in_place=True))
            held = plan

        on_n1 = asyncio.ensure_future(store.wait_newer(1, 60, node="n1"))
        on_n2 = asyncio.ensure_future(store.wait_newer(1, 60, node="n2"))
        anyone = asyncio.ensure_future(store.wait_newer(1, 60))  # a feed, or a watcher that names no node
        await asyncio.sleep(0)
        await restart_b(2)
        await asyncio.sleep(0)
        assert on_n2.done() and anyone.done() and not on_n1.done()
        store.agent_addresses["n7"] = "10.2.0.7:7000"  # not cut for yet: any part may read it
        await restart_b(3)
        await asyncio.sleep(0)
        assert on_n1.done()
        await store._views_of(held)  # cut for the new address
        # A job whose spec is not known yet makes every plan wake everyone until its part is cut
        # with it; once it ended, it no longer does.
        plan = plan_pb2.AllocationPlan(version=4, epoch=1, jobs=list(held.jobs))
        plan.jobs.add(job_id="c", generation=1).placements.add(node="n3", gpu_indices=[0])
        await store.set_latest(plan, base=held, changes=EntryChanges({"c": plan.jobs[2]}, (), {}, in_place=True))
        held = plan
        await store._views_of(held)
        plan = plan_pb2.AllocationPlan(version=5, epoch=1, jobs=list(held.jobs)[:2])
        await store.set_latest(plan, base=held, changes=EntryChanges({}, ("c",), {"c": held.jobs[2]}, in_place=True))
        held = plan  # not cut: no watcher asked
        on_n1 = asyncio.ensure_future(store.wait_newer(5, 60, node="n1"))
        await asyncio.sleep(0)
        await restart_b(6)
        await asyncio.sleep(0)
        assert not on_n1.done()
        await store.set_latest(plan_pb2.AllocationPlan(version=7, epoch=1, jobs=list(held.jobs)))  # read whole
        await asyncio.sleep(0)
        assert on_n1.done()

    asyncio.run(main())


def test_an_address_changed_during_a_cut_a_newer_plan_overtook_is_cut_for_by_the_next() -> None:
    """A cut reads the addresses of nodes new to it (GetNode) and then takes every address changed
    meanwhile. When a newer plan came during those reads, that cut is thrown away: the changes it
    took must stay for the newer plan's cut, or the parts that read a changed address (here rank
    1's, which names rank 0's agent as its master) keep the old one until their job changes."""

    async def main() -> None:
        store = _store(random.Random(0))
        store.specs.update({name: common_pb2.JobSpec(name=name) for name in "abc"})
        held = plan_pb2.AllocationPlan(version=1, epoch=1)
        two_nodes = held.jobs.add(job_id="a", generation=1)
        two_nodes.placements.add(node="n1", gpu_indices=[0])
        two_nodes.placements.add(node="n2", gpu_indices=[0])
        await store.set_latest(held)
        assert (await store.node_plan(held, "n2")).tasks[0].master_addr == "10.0.0.1"

        joining = plan_pb2.AllocationPlan(version=2, epoch=1, jobs=list(held.jobs))
        joining.jobs.add(job_id="b", generation=1).placements.add(node="new", gpu_indices=[0])
        newer = plan_pb2.AllocationPlan(version=3, epoch=1, jobs=list(joining.jobs))
        newer.jobs.add(job_id="c", generation=1).placements.add(node="n5", gpu_indices=[0])

        class _Store:
            """Asked for the new node's address: meanwhile n1's agent comes back at another
            address, and a newer plan is set in force."""

            async def GetJob(self, request, **kwargs):  # type: ignore[no-untyped-def]  # noqa: N802
                raise AssertionError("every spec is known")

            async def GetNode(self, request, **kwargs):  # type: ignore[no-untyped-def]  # noqa: N802
                assert request.node == "new"
                store.remember_nodes([common_pb2.Node(spec=common_pb2.NodeSpec(
                    name="n1", agent_address="10.9.0.1:7000", cache_address="10.9.0.1:7001"))])
                await store.set_latest(newer, base=joining, changes=EntryChanges(
                    {"c": newer.jobs[2]}, (), {}, in_place=True))
                return common_pb2.Node(spec=common_pb2.NodeSpec(
                    name="new", agent_address="10.0.1.1:7000", cache_address="10.0.1.1:7001"))

        store.clients = Clients(md=_Store())  # type: ignore[arg-type]
        await store.set_latest(joining, base=held, changes=EntryChanges({"b": joining.jobs[1]}, (), {}, in_place=True))
        await store.node_plan(joining, "new")  # the cut overtaken while it reads the new node
        assert store.latest is newer
        views = await store._views_of(newer)
        assert views["n2"].tasks[0].master_addr == "10.9.0.1"
        _check(store, views, newer)
        assert store.node_views.whole_cuts == 1

    asyncio.run(main())
