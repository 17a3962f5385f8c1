"""Handing a new plan to a thousand watchers (scheduler.live.plans.PlanStore): every watcher wakes,
and gets its node's part, within a few turns of the event loop, however busy the loop is.

Counted in turns of the loop, not seconds: an asyncio.Condition, which these replaced, let its
waiters through one turn each, so behind a loop with other work in every turn (task reports, acks)
the last of 1,000 watchers got the plan most of a second after the first.
"""

from __future__ import annotations

import asyncio

from scheduler.live import convert
from scheduler.live.clients import Clients
from scheduler.live.plans import PlanStore
from silod.v1 import common_pb2, plan_pb2

WATCHERS = 1000
FEW_TURNS = 10


def _store() -> PlanStore:
    store = PlanStore(Clients(md=None))  # type: ignore[arg-type]  # every spec and address is known: no RPC
    for i in range(WATCHERS):
        store.agent_addresses[f"n{i}"] = store.cache_addresses[f"n{i}"] = f"n{i}:7000"
        store.specs[f"j{i}"] = common_pb2.JobSpec(name=f"j{i}", min_gpus=1, max_gpus=1)
    return store


def _plan(version: int) -> plan_pb2.AllocationPlan:
    plan = plan_pb2.AllocationPlan(version=version)
    for i in range(WATCHERS):
        plan.jobs.add(job_id=f"j{i}", generation=1, master_port=29500).placements.add(node=f"n{i}", gpu_indices=[0])
    return plan


def _before_learning(store: PlanStore, monkeypatch, wait) -> None:  # type: ignore[no-untyped-def]
    """The cut of a plan awaits ``wait(plan)`` first, as it would a GetJob of a spec new to the
    scheduler (the cut then takes turns of the loop)."""
    real_learn = store._learn

    async def learn(plan: plan_pb2.AllocationPlan, entries) -> None:  # type: ignore[no-untyped-def]
        await wait(plan)
        await real_learn(plan, entries)

    monkeypatch.setattr(store, "_learn", learn)


async def _turns_until(done) -> int:  # type: ignore[no-untyped-def]
    turns = 0
    while not done():
        await asyncio.sleep(0)
        turns += 1
        assert turns < 5 * WATCHERS, "the watchers never all woke"
    return turns


def test_a_new_plan_wakes_every_watcher_within_a_few_turns() -> None:
    async def main() -> int:
        store = _store()
        await store.set_latest(plan_pb2.AllocationPlan(version=1))
        woke: list[int] = []

        async def watcher(i: int) -> None:
            await store.wait_newer(1, timeout=60)
            woke.append(i)

        tasks = [asyncio.create_task(watcher(i)) for i in range(WATCHERS)]
        await asyncio.sleep(0.05)  # every watcher waiting
        assert not woke
        await store.set_latest(plan_pb2.AllocationPlan(version=2))
        turns = await _turns_until(lambda: len(woke) == WATCHERS)
        await asyncio.gather(*tasks)
        return turns

    assert asyncio.run(main()) <= FEW_TURNS


def test_every_watcher_gets_its_part_from_one_cut_within_a_few_turns(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    cuts = []
    real = convert.node_plans

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        cuts.append(args[0].version)
        return real(*args, **kwargs)

    monkeypatch.setattr(convert, "node_plans", counted)

    async def main() -> int:
        store = _store()
        _before_learning(store, monkeypatch, lambda plan: asyncio.sleep(0))
        plan = _plan(7)
        await store.set_latest(plan)
        parts: dict[str, plan_pb2.NodePlan] = {}

        async def watcher(i: int) -> None:
            parts[f"n{i}"] = await store.node_plan(plan, f"n{i}")

        tasks = [asyncio.create_task(watcher(i)) for i in range(WATCHERS)]
        turns = await _turns_until(lambda: len(parts) == WATCHERS)
        await asyncio.gather(*tasks)
        assert all(p.version == 7 and [t.job_id for t in p.tasks] == [f"j{i}"] for i, p in
                   ((int(n[1:]), p) for n, p in parts.items()))
        return turns

    assert asyncio.run(main()) <= FEW_TURNS
    assert cuts == [7]


def test_a_watcher_that_times_out_leaves_the_others_waiting() -> None:
    async def main() -> None:
        store = _store()
        await store.set_latest(plan_pb2.AllocationPlan(version=1))
        patient = asyncio.create_task(store.wait_newer(1, timeout=60))
        await store.wait_newer(1, timeout=0.01)  # gives up first: nothing newer yet
        assert not patient.done()
        await store.set_latest(plan_pb2.AllocationPlan(version=2))
        await asyncio.wait_for(patient, 5)
        await store.wait_newer(1, timeout=60)  # already newer: returns at once
        for _ in range(100):  # watchers time out every few seconds while no plan comes: nothing piles up
            await store.wait_newer(2, timeout=0)
        cancelled = asyncio.create_task(store.wait_newer(2, timeout=60))
        await asyncio.sleep(0)
        cancelled.cancel()
        await asyncio.gather(cancelled, return_exceptions=True)
        assert not store._waiters

    asyncio.run(main())


def test_a_watcher_cancelled_during_the_cut_leaves_it_to_the_others(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        store = _store()
        go = asyncio.Event()
        _before_learning(store, monkeypatch, lambda plan: go.wait())
        plan = _plan(5)
        first = asyncio.create_task(store.node_plan(plan, "n0"))  # starts the cut
        second = asyncio.create_task(store.node_plan(plan, "n1"))
        await asyncio.sleep(0)
        first.cancel()  # its stream closed mid-cut
        await asyncio.gather(first, return_exceptions=True)
        go.set()
        assert [t.job_id for t in (await asyncio.wait_for(second, 5)).tasks] == ["j1"]

    asyncio.run(main())


def test_an_older_plans_cut_that_ends_late_does_not_replace_the_newer_one(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        store = _store()
        release_old = asyncio.Event()

        async def slow_for_the_old_plan(plan: plan_pb2.AllocationPlan) -> None:
            if plan.version == 3:
                await release_old.wait()  # the old plan's cut waits on the store (a slow GetJob)

        _before_learning(store, monkeypatch, slow_for_the_old_plan)
        old, new = _plan(3), _plan(4)
        del new.jobs[0]  # the newer plan no longer runs j0 on n0
        await store.set_latest(new)
        slow = asyncio.create_task(store.node_plan(old, "n0"))
        await asyncio.sleep(0)
        assert not (await store.node_plan(new, "n0")).tasks
        release_old.set()
        assert [t.job_id for t in (await slow).tasks] == ["j0"]  # the caller of the old plan gets its part
        assert not (await store.node_plan(new, "n0")).tasks  # and the newer cut is still the one kept

    asyncio.run(main())


def test_the_fanout_benchmark_runs_small_and_names_a_bad_flag(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "plan_fanout.py"
    out = tmp_path / "fanout.json"
    run = subprocess.run([sys.executable, str(script), "--watchers", "20", "--busy-ms", "0", "--json", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    [row] = json.loads(out.read_text())["rows"]
    assert row["watchers"] == 20 and row["plan_store_s"] >= 0 and row["condition_s"] >= 0
    bad = subprocess.run([sys.executable, str(script), "--watchers", "0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--watchers" in bad.stderr and "Traceback" not in bad.stderr


def test_the_cut_benchmark_sends_the_same_parts_both_ways_and_names_a_bad_flag(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "plan_cut.py"
    out = tmp_path / "cut.json"
    run = subprocess.run([sys.executable, str(script), "--nodes", "40", "--jobs", "120", "--changed", "4", "--plans", "2",
                          "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    figures = json.loads(out.read_text())
    # 4 restarts a plan, 2 of them on two nodes where there are such jobs, and a job replaced on
    # one node: 1 to 7 nodes' parts sent.
    assert figures["by_changes"]["parts_sent"] == figures["whole"]["parts_sent"]
    assert 1 <= figures["by_changes"]["parts_sent"] <= 7
    assert figures["feed"]["patched_cpu_s"] >= 0 and figures["feed"]["rebuilt_cpu_s"] >= 0
    assert figures["by_changes"]["cpu_s"] > 0 and figures["whole"]["cpu_s"] > 0
    for flags, named in ((["--nodes", "0"], "--nodes"), (["--nodes", "2", "--jobs", "9"], "--jobs"),
                         (["--jobs", "4", "--changed", "4"], "--changed")):
        bad = subprocess.run([sys.executable, str(script), *flags], capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and named in bad.stderr and "Traceback" not in bad.stderr, (flags, bad.stderr)
