"""How long a new plan takes to reach every watcher of the scheduler's plan store
(scheduler.live.plans.PlanStore): from the commit until the last of N watchers woke and had its
node's part, on an event loop that has other work in every turn (the task reports, acks and
submissions a scheduler serves meanwhile).

    .venv/bin/python benchmarks/plan_fanout.py [--watchers 1000 4000] [--busy-ms 0 0.2] [--json F]

Beside each figure, in the same run: the same watchers waiting on an asyncio.Condition (what the
store used before; its lock lets the woken waiters through one turn of the loop each). Three
plans per case; the figure is the median.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scheduler.live.clients import Clients  # noqa: E402
from scheduler.live.plans import PlanStore  # noqa: E402
from silod.v1 import common_pb2, plan_pb2  # noqa: E402

PLANS = 3


class ConditionWait:
    """The waiting of the store before: ``async with cond: await wait_for(cond.wait_for(newer))``."""

    def __init__(self, store: PlanStore) -> None:
        self.store = store
        self.cond = asyncio.Condition()

    async def set_latest(self, plan: plan_pb2.AllocationPlan) -> None:
        self.store.latest = plan
        async with self.cond:
            self.cond.notify_all()

    async def wait_newer(self, version: int, timeout: float) -> None:
        async with self.cond:
            try:
                await asyncio.wait_for(self.cond.wait_for(
                    lambda: self.store.latest is not None and self.store.latest.version > version), timeout)
            except asyncio.TimeoutError:
                pass


def _store(watchers: int) -> PlanStore:
    store = PlanStore(Clients(md=None))  # type: ignore[arg-type]  # every spec and address known: no RPC
    for i in range(watchers):
        store.agent_addresses[f"n{i}"] = store.cache_addresses[f"n{i}"] = f"n{i}:7000"
        store.specs[f"j{i}"] = common_pb2.JobSpec(name=f"j{i}", min_gpus=1, max_gpus=1)
    return store


def _plan(version: int, watchers: int) -> plan_pb2.AllocationPlan:
    plan = plan_pb2.AllocationPlan(version=version)
    for i in range(watchers):
        plan.jobs.add(job_id=f"j{i}", generation=version).placements.add(node=f"n{i}", gpu_indices=[0])
    return plan


async def _case(watchers: int, busy_ms: float, condition: bool) -> float:
    store = _store(watchers)
    waits = ConditionWait(store) if condition else store
    await waits.set_latest(_plan(1, watchers))
    got: list[float] = []

    async def watcher(i: int) -> None:  # the Watch servicer's loop, without the stream
        sent = 1
        while True:
            await waits.wait_newer(sent, 60)
            plan = store.latest
            await store.node_plan(plan, f"n{i}")
            got.append(time.perf_counter())
            sent = plan.version

    async def other_work() -> None:
        while True:
            until = time.perf_counter() + busy_ms / 1000
            while time.perf_counter() < until:
                pass
            await asyncio.sleep(0)

    tasks = [asyncio.create_task(watcher(i)) for i in range(watchers)]
    if busy_ms > 0:
        tasks.append(asyncio.create_task(other_work()))
    await asyncio.sleep(0.2)
    spans = []
    for version in range(2, 2 + PLANS):
        plan = _plan(version, watchers)
        got.clear()
        started = time.perf_counter()
        await waits.set_latest(plan)
        while len(got) < watchers:
            await asyncio.sleep(0.001)
        spans.append(max(got) - started)
        await asyncio.sleep(0.05)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return statistics.median(spans)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--watchers", type=int, nargs="+", default=[1000, 4000])
    parser.add_argument("--busy-ms", type=float, nargs="+", default=[0.0, 0.2],
                        help="other work on the event loop per turn, in ms")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if min(args.watchers) < 1:
        parser.error("--watchers: each must be 1 or more")
    if min(args.busy_ms) < 0:
        parser.error("--busy-ms: each must be 0 or more")
    rows = []
    for watchers in args.watchers:
        for busy in args.busy_ms:
            store_s = asyncio.run(_case(watchers, busy, condition=False))
            condition_s = asyncio.run(_case(watchers, busy, condition=True))
            rows.append({"watchers": watchers, "busy_ms_per_turn": busy, "plan_store_s": round(store_s, 4),
                         "condition_s": round(condition_s, 4)})
            print(f"{watchers} watchers, {busy} ms of other work a turn: every watcher had the plan after "
                  f"{store_s * 1000:.0f} ms (with an asyncio.Condition: {condition_s * 1000:.0f} ms)", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
