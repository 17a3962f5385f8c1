"""The release hold passes the jobs that keep their allocation without looking at each GPU
(releases.BusyGpus, hold_releases' fast path), and gives exactly the plan that looking at each GPU
gives: the same allocations held, kept or dropped, in the same order."""

from __future__ import annotations

import dataclasses
import random

from scheduler.live.releases import BusyGpus, hold_releases
from scheduler.policy import Allocation, Plan

NODES = [f"n{i}" for i in range(6)]
GPUS = [(node, index) for node in NODES for index in range(4)]


def _allocation(gpus: list[tuple[str, int]]) -> Allocation:
    by_node: dict[str, list[int]] = {}
    for node, index in sorted(gpus):
        by_node.setdefault(node, []).append(index)
    return Allocation(placement=tuple((node, tuple(idx)) for node, idx in by_node.items()), batch_size=32)


def _round(rng: random.Random) -> tuple[Plan, Plan, dict, dict]:
    """The plan in force's holders, the snapshot's current plan read off it (some GPUs lost), the
    GPUs pending release, and a policy plan (no GPU twice) where most jobs keep what they hold."""
    free = GPUS[:]
    rng.shuffle(free)
    held: dict[tuple[str, int], str] = {}
    current: dict[str, Allocation] = {}
    for j in range(8):
        job = f"job-{j}"
        if rng.random() < 0.7 and len(free) >= 2:
            gpus = [free.pop() for _ in range(rng.choice((1, 2)))]
            held.update((gpu, job) for gpu in gpus)
            kept = [gpu for gpu in gpus if rng.random() < 0.9]  # a lost node's GPUs drop out of current
            if kept:
                current[job] = _allocation(kept)
    pending = {gpu: (rng.choice([f"job-{j}" for j in range(10)]), 3) for gpu in rng.sample(GPUS, rng.randrange(0, 5))}
    taken: set[tuple[str, int]] = set()
    proposal: dict[str, Allocation] = {}
    for j in range(10):
        job = f"job-{j}"
        roll = rng.random()
        if job in current and roll < 0.6:
            # The same object, or one made again on the same GPUs (the policies do both), its
            # batch size the policy's own.
            same = current[job] if rng.random() < 0.5 else dataclasses.replace(_allocation(
                [(node, i) for node, idx in current[job].placement for i in idx]), batch_size=rng.choice((0, 32, 64)))
            if not taken & {(node, i) for node, idx in same.placement for i in idx}:
                proposal[job] = same
                taken.update((node, i) for node, idx in same.placement for i in idx)
        elif roll < 0.9:
            gpus = [gpu for gpu in rng.sample(GPUS, rng.choice((1, 2))) if gpu not in taken]
            if gpus:
                proposal[job] = _allocation(gpus)
                taken.update(gpus)
    return Plan(proposal), Plan(current), held, pending


def test_passing_kept_allocations_by_comparison_gives_the_plan_each_gpu_gives() -> None:
    rng = random.Random(45)
    seen = {"kept old": 0, "held back": 0, "passed": 0}
    for _ in range(3000):
        proposal, current, held, pending = _round(rng)
        busy = BusyGpus(held, pending, current_follows_held=True)
        fast = hold_releases(proposal, current, busy, overlap_free=True)
        each_gpu = hold_releases(proposal, current, dict(busy.items()))
        assert list(fast.allocations.items()) == list(each_gpu.allocations.items())
        for job, alloc in proposal.allocations.items():
            got = fast.allocations.get(job)
            seen["passed" if got is alloc else "kept old" if got is not None else "held back"] += 1
    assert min(seen.values()) > 100, seen


def test_busy_gpus_read_as_the_pending_owner_first() -> None:
    busy = BusyGpus({("n0", 0): "a", ("n0", 1): "b"}, {("n0", 1): ("c", 4), ("n1", 0): ("d", 4)})
    assert dict(busy) == {("n0", 0): "a", ("n0", 1): "c", ("n1", 0): "d"} and len(busy) == 3
    assert busy.get(("n9", 0)) is None
    # b holds n0:1 under the plan in force, and c still has to release it.
    assert busy.holders_of_released() == {"b"}
