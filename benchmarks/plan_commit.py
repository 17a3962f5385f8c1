"""What the metadata service spends on one CommitPlanChanges at scale, step by step, each way side by
side: making the new plan from the plan in force (apply_changes walks every entry; EntryOrder
copies the plan and sets the changed entries in place) and checking it (the whole check_plan, its
entries' fields skipped as the store skipped them; JobHolders, by what the changes touch). Then whole commits through the store, as the service makes
them (SQLite in a scratch directory).

    .venv/bin/python benchmarks/plan_commit.py [--jobs 20000] [--changes 10] [--rounds 20]

Each figure is the median over --rounds rounds, each round a few entries changed, one removed and
one added, as a steady round of the live scheduler sends them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.metadata.migrate import upgrade  # noqa: E402
from services.metadata.store import MetadataStore  # noqa: E402
from services.metadata.store.plan_order import EntryOrder  # noqa: E402
from services.metadata.store.plans import apply_changes  # noqa: E402
from services.metadata.validation.plan_holders import JobHolders  # noqa: E402
from services.metadata.validation.plans import check_plan  # noqa: E402
from silod.v1 import plan_pb2  # noqa: E402


class _Everything:
    def __contains__(self, item: object) -> bool:
        return True


_EVERY_JOB = _Everything()


def first_plan(jobs: int) -> plan_pb2.AllocationPlan:
    """``jobs`` entries, four of every five placed on 4 GPUs of an 8-GPU node."""
    plan = plan_pb2.AllocationPlan(version=1, policy="fifo")
    for i in range(jobs):
        entry = plan.jobs.add(job_id=f"job-{i:012x}", batch_size=32, generation=1)
        if i % 5:
            slot = i - i // 5 - 1  # the placed ones, numbered from 0
            entry.placements.add(node=f"node-{slot // 2}", gpu_indices=[(slot % 2) * 4 + k for k in range(4)])
    return plan


def round_changes(plan: plan_pb2.AllocationPlan, changes: int, r: int) -> plan_pb2.PlanChanges:
    """``changes`` unplaced entries get a new generation, one entry leaves and a new one arrives."""
    unplaced = [job.job_id for job in plan.jobs if not job.placements]
    out = plan_pb2.PlanChanges(base_version=plan.version)
    for job_id in unplaced[r * changes:(r + 1) * changes]:
        out.jobs.add(job_id=job_id, batch_size=32, generation=2 + r)
    out.removed_job_ids.append(unplaced[-1 - r])
    out.jobs.add(job_id=f"new-{r:08x}", batch_size=32, generation=1)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=20000)
    parser.add_argument("--changes", type=int, default=10, help="entries changed each round (besides one removed, one new)")
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args(argv)
    for flag in ("jobs", "changes", "rounds"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag}: must be >= 1, got {getattr(args, flag)}")
    if (args.changes + 1) * args.rounds > args.jobs // 5:
        parser.error(f"--changes {args.changes} x --rounds {args.rounds}: more than the {args.jobs // 5} unplaced "
                     "entries; use more --jobs or fewer rounds")
    print(f"$ python benchmarks/plan_commit.py --jobs {args.jobs} --changes {args.changes} --rounds {args.rounds}")
    plan = first_plan(args.jobs)
    order, holders = EntryOrder.of(plan), JobHolders.of(plan)
    times: dict[str, list[float]] = {k: [] for k in ("apply_changes", "EntryOrder", "check_plan", "JobHolders")}
    for r in range(args.rounds):
        changes = round_changes(plan, args.changes, r)
        header = plan_pb2.AllocationPlan(version=plan.version + 1, policy="fifo")
        t = time.perf_counter()
        walked = apply_changes(plan, header, changes.jobs, changes.removed_job_ids)
        times["apply_changes"].append(time.perf_counter() - t)
        t = time.perf_counter()
        made, next_order = order.apply(plan, header, changes.jobs, changes.removed_job_ids)
        times["EntryOrder"].append(time.perf_counter() - t)
        assert made == walked, "EntryOrder made another plan than apply_changes"
        t = time.perf_counter()
        check_plan(made, checked=_EVERY_JOB)  # as the store ran it: the entries' fields were checked before
        times["check_plan"].append(time.perf_counter() - t)
        t = time.perf_counter()
        changed = holders.after(header, changes)
        times["JobHolders"].append(time.perf_counter() - t)
        assert changed is not None, "JobHolders sent a sound plan to the whole check"
        holders.apply(changed, header.version)
        plan, order = made, next_order
    ms = {k: statistics.median(v) * 1000 for k, v in times.items()}
    print(f"{args.jobs} entries, {args.changes + 2} changed a round, median of {args.rounds} rounds:")
    print(f"  make the plan:  apply_changes {ms['apply_changes']:.1f} ms, EntryOrder {ms['EntryOrder']:.1f} ms")
    print(f"  check the plan: check_plan {ms['check_plan']:.1f} ms, JobHolders {ms['JobHolders']:.2f} ms")

    with tempfile.TemporaryDirectory(prefix="silod-plan-commit-") as scratch:
        url = f"sqlite:///{scratch}/metadata.db"
        upgrade(url)
        store = MetadataStore.open(url)
        try:
            plan = first_plan(args.jobs)
            store.plans.commit(plan, header_only=True)
            commits = []
            for r in range(args.rounds):
                changes = round_changes(plan, args.changes, r)
                header = plan_pb2.AllocationPlan(version=plan.version + 1, policy="fifo")
                t = time.perf_counter()
                store.plans.commit(header, changes, header_only=True)
                commits.append(time.perf_counter() - t)
                plan = apply_changes(plan, header, changes.jobs, changes.removed_job_ids)
        finally:
            store.close()
    # The first commit of changes after a start makes the holders and the order from the plan.
    steady = commits[1:] or commits
    print(f"  the store's commit (SQLite, every step): first {commits[0] * 1000:.1f} ms, then median "
          f"{statistics.median(steady) * 1000:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
