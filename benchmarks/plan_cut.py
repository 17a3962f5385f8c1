"""What one plan costs the process that serves the nodes' watches (scheduler or allocation
service) when it changes a few jobs of a big plan: cutting every node's part of it, waking the
watchers, and sending the parts that changed.

    .venv/bin/python benchmarks/plan_cut.py [--nodes 5000] [--jobs 20000] [--changed 8] [--plans 5] [--json F]

Two ways side by side, in one run, over the same plans, each watched by one real ``watch_node``
stream per node (scheduler.live.watch, the Watch RPC's loop without gRPC):

* ``by changes``: each plan is set in force with what it changes of the one before (as the
  scheduler's commits and the allocation service's feed do): only the nodes it changed are cut
  again, and only their watchers woken (scheduler.live.node_views).
* ``whole``: each plan is set in force as read whole from the store: every node's part is cut, and
  every watcher woken to compare its part with the one it sent.

Each plan restarts ``--changed`` jobs (a new generation), half of them spanning two nodes, and
ends one job and starts another on its GPUs; the figure per plan is from setting it in force until every woken watcher has sent its part and waits
again: CPU seconds of this process and wall seconds, the median over ``--plans``. Both ways must
send the same parts to the same nodes; the benchmark fails if they do not.

Before the watches, the allocation service makes each plan from its scheduler's feed (the plan's
changes): that step is measured too, patched in place against rebuilt entry by entry, both
checked to give the plan.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scheduler.live.clients import Clients  # noqa: E402
from scheduler.allocation.follower import _applied  # noqa: E402
from scheduler.live.entries import EntryChanges  # noqa: E402
from scheduler.live.plan_index import PlanIndex, applied_in_place  # noqa: E402
from scheduler.live.plans import PlanStore  # noqa: E402
from scheduler.live.watch import watch_node  # noqa: E402
from silod.v1 import allocation_pb2, common_pb2, plan_pb2  # noqa: E402

GPUS = 8


class StoreCore:
    """What watch_node reads of its server (a scheduler, an allocation service), here a bare
    PlanStore's plan and parts, counting the watchers waiting for a newer plan."""

    def __init__(self, store: PlanStore) -> None:
        self.store = store
        self.waiting = 0

    @property
    def latest(self) -> plan_pb2.AllocationPlan | None:
        return self.store.latest

    async def refresh_latest(self, max_age_s: float = 0.0) -> plan_pb2.AllocationPlan | None:
        return self.store.latest

    async def node_plan(self, plan: plan_pb2.AllocationPlan, node: str) -> plan_pb2.NodePlan:
        return await self.store.node_plan(plan, node)

    async def wait_newer(self, version: int, timeout: float, node: str | None = None) -> None:
        self.waiting += 1
        try:
            await self.store.wait_newer(version, timeout, node)
        finally:
            self.waiting -= 1


def first_plan(nodes: int, jobs: int, rng: random.Random) -> plan_pb2.AllocationPlan:
    """``jobs`` jobs of 1 or 2 GPUs on ``nodes`` nodes of GPUS GPUs, packed in order (a few span two nodes)."""
    if jobs > nodes * GPUS // 2:
        raise ValueError(f"--jobs: at most {nodes * GPUS // 2} on {nodes} nodes (2 GPUs a job at most)")
    plan = plan_pb2.AllocationPlan(version=1, epoch=1)
    free = [(f"n{n}", g) for n in range(nodes) for g in range(GPUS)]
    for j in range(jobs):
        entry = plan.jobs.add(job_id=f"j{j}", generation=1, batch_size=32, master_port=29500 + j % 1000)
        size = 2 if rng.random() < 0.5 else 1
        taken, free = free[:size], free[size:]
        by_node: dict[str, list[int]] = {}
        for node, gpu in taken:
            by_node.setdefault(node, []).append(gpu)
        for node, gpus in by_node.items():
            entry.placements.add(node=node, gpu_indices=gpus)
    return plan


def next_plan(held: plan_pb2.AllocationPlan, changed: int, rng: random.Random, serial: int
              ) -> tuple[plan_pb2.AllocationPlan, EntryChanges]:
    """``held`` with ``changed`` jobs restarted (half of them, where there are, on two nodes), and
    one job on one node ended and a new one (``serial``) started on its GPUs, placed last."""
    plan = plan_pb2.AllocationPlan()
    plan.CopyFrom(held)
    plan.version = held.version + 1
    spanning = [i for i, e in enumerate(plan.jobs) if len(e.placements) > 1]
    single = [i for i, e in enumerate(plan.jobs) if len(e.placements) == 1]
    picked = rng.sample(spanning, min(len(spanning), changed // 2))
    picked += rng.sample(single, min(len(single), changed - len(picked) + 1))
    ended = picked.pop()
    upserts, previous = {}, {}
    for i in picked:
        entry = plan.jobs[i]
        entry.generation += 1
        upserts[entry.job_id] = entry
        previous[entry.job_id] = held.jobs[i]
    gone = held.jobs[ended]
    del plan.jobs[ended]
    new = plan.jobs.add(job_id=f"new{serial}", generation=1, batch_size=32, master_port=29500)
    new.placements.extend(gone.placements)
    upserts[new.job_id] = new
    previous[gone.job_id] = gone
    return plan, EntryChanges(upserts, (gone.job_id,), previous, in_place=True)


async def run(plans: list[tuple[plan_pb2.AllocationPlan, EntryChanges | None]], nodes: int, by_changes: bool
              ) -> tuple[list[float], list[float], list[list[tuple[str, int]]]]:
    """CPU and wall seconds per plan after the first, and the parts each plan had sent."""
    store = PlanStore(Clients(md=None))  # type: ignore[arg-type]  # every spec and address known: no RPC
    for n in range(nodes):
        store.agent_addresses[f"n{n}"] = f"198.18.{n // 250}.{n % 250}:7000"
        store.cache_addresses[f"n{n}"] = f"198.18.{n // 250}.{n % 250}:7001"
    for plan, changes in plans:
        for entry in plan.jobs if changes is None else changes.upserts.values():
            store.specs[entry.job_id] = common_pb2.JobSpec(name=entry.job_id, min_gpus=1, max_gpus=2)
    core = StoreCore(store)
    sent: list[tuple[str, int]] = []

    async def watcher(node: str) -> None:
        request = allocation_pb2.WatchPlanRequest(node=node)
        async for part in watch_node(core, request, refresh_s=3600.0, node_timeout_s=60.0):
            sent.append((part.node, part.version))

    await store.set_latest(plans[0][0])
    tasks = [asyncio.create_task(watcher(f"n{n}")) for n in range(nodes)]
    ended: list[asyncio.Task[None]] = []
    for task in tasks:
        task.add_done_callback(ended.append)
    while core.waiting < nodes:
        await asyncio.sleep(0.01)
        if ended:
            await ended[0]
    cpu, wall, per_plan = [], [], []
    base = plans[0][0]
    for plan, changes in plans[1:]:
        sent.clear()
        gc.collect()
        started_cpu, started = time.process_time(), time.perf_counter()
        if by_changes:
            await store.set_latest(plan, base=base, changes=changes)
        else:
            await store.set_latest(plan)
        await asyncio.sleep(0)  # the woken watchers run their first step
        while core.waiting < nodes:
            await asyncio.sleep(0)
            if ended:
                await ended[0]  # a watcher that died: its error, not a wait forever
        cpu.append(time.process_time() - started_cpu)
        wall.append(time.perf_counter() - started)
        per_plan.append(sorted(sent))
        base = plan
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return cpu, wall, per_plan


def feed_costs(plans: list[tuple[plan_pb2.AllocationPlan, EntryChanges | None]]) -> tuple[list[float], list[float]]:
    """CPU seconds per plan for the allocation service to make it from the feed's changes: patched
    in place from the plan it holds (applied_in_place), and rebuilt entry by entry (_applied)."""
    index = PlanIndex()
    index.index_whole(plans[0][0])
    patched_s, rebuilt_s = [], []
    held = plans[0][0]
    for plan, changes in plans[1:]:
        assert changes is not None
        header = plan_pb2.AllocationPlan()
        header.CopyFrom(plan)
        del header.jobs[:]
        fed = plan_pb2.PlanChanges(base_version=held.version, jobs=list(changes.upserts.values()),
                                   removed_job_ids=list(changes.removals))
        gc.collect()
        started = time.process_time()
        patched = applied_in_place(index, header, fed.jobs, fed.removed_job_ids)
        patched_s.append(time.process_time() - started)
        started = time.process_time()
        rebuilt = _applied(held, header, fed)
        rebuilt_s.append(time.process_time() - started)
        if patched != rebuilt or patched != plan:
            print("error: the plan patched from the feed's changes is not the plan", file=sys.stderr)
            sys.exit(1)
        index.follow(held, patched, changes)
        held = patched
    return patched_s, rebuilt_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=5000, help="nodes, each watching (default 5000)")
    parser.add_argument("--jobs", type=int, default=20000, help="jobs in the plan (default 20000)")
    parser.add_argument("--changed", type=int, default=8, help="jobs each plan restarts (default 8); one more ends")
    parser.add_argument("--plans", type=int, default=5, help="plans measured (default 5)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args()
    for name in ("nodes", "jobs", "changed", "plans"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}: must be 1 or more")
    if args.changed >= args.jobs:
        parser.error(f"--changed: fewer than --jobs ({args.jobs}): one more job ends each plan")
    rng = random.Random(args.seed)
    try:
        held = first_plan(args.nodes, args.jobs, rng)
    except ValueError as exc:
        parser.error(str(exc))
    plans: list[tuple[plan_pb2.AllocationPlan, EntryChanges | None]] = [(held, None)]
    for serial in range(args.plans):
        plan, changes = next_plan(held, args.changed, rng, serial)
        plans.append((plan, changes))
        held = plan
    print(f"{args.nodes} nodes watching, {args.jobs} jobs, {args.plans} plans restarting {args.changed} jobs and "
          "replacing one each",
          flush=True)
    figures = {}
    sent = {}
    for name, by_changes in (("by_changes", True), ("whole", False)):
        cpu, wall, sent[name] = asyncio.run(run(plans, args.nodes, by_changes))
        figures[name] = {"cpu_s": round(statistics.median(cpu), 4), "wall_s": round(statistics.median(wall), 4),
                         "parts_sent": statistics.median(len(s) for s in sent[name])}
        print(f"  {name.replace('_', ' '):10}: {figures[name]['cpu_s'] * 1000:7.1f} ms of CPU a plan, "
              f"{figures[name]['wall_s'] * 1000:7.1f} ms until every woken watcher sent its part "
              f"({figures[name]['parts_sent']:g} parts sent)", flush=True)
    if sent["by_changes"] != sent["whole"]:
        print("error: the two ways sent different parts", file=sys.stderr)
        sys.exit(1)
    ratio = figures["whole"]["cpu_s"] / max(figures["by_changes"]["cpu_s"], 1e-9)
    print(f"  by changes costs 1/{ratio:.0f} of the whole cut's CPU; both sent the same parts", flush=True)
    patched, rebuilt = feed_costs(plans)
    figures["feed"] = {"patched_cpu_s": round(statistics.median(patched), 4),
                       "rebuilt_cpu_s": round(statistics.median(rebuilt), 4)}
    print(f"  the allocation service making each plan from the feed's changes: "
          f"{figures['feed']['patched_cpu_s'] * 1000:.1f} ms patched in place, "
          f"{figures['feed']['rebuilt_cpu_s'] * 1000:.1f} ms rebuilt entry by entry (the same plan)", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"command": " ".join(sys.argv), "nodes": args.nodes, "jobs": args.jobs,
                                         "changed": args.changed, "plans": args.plans, **figures}, indent=1) + "\n")


if __name__ == "__main__":
    main()
