"""The release hold passes the jobs that keep their allocation without looking at each GPU
(releases.BusyGpus, hold_releases' fast path), and gives exactly the plan that looking at each GPU
gives: the same allocations held, kept or dropped, in the same order."""

from __future__ import annotations

import dataclasses
import random

from scheduler.live.releases import BusyGpus, ReleaseHolds, hold_releases
from scheduler.policy import Allocation, ChangedSince, Plan

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


def _diff(before: dict, after: dict) -> dict:
    return {k: after.get(k) for k in before.keys() | after.keys() if before.get(k) is not after.get(k)}


def _same_objects(last: Plan, now: dict) -> dict:
    """``now`` with last round's object for each allocation equal to it (as the policies hand on)."""
    return {job: last.allocations[job] if last.allocations.get(job) == a else a for job, a in now.items()}


def test_release_holds_follow_the_hints_to_the_plan_hold_releases_gives() -> None:
    """ReleaseHolds decides again only the jobs the hints and the pending releases name, and gets
    what hold_releases gets looking at every job; its plan's hint is right by identity."""
    rng = random.Random(7)
    holds = ReleaseHolds()
    last = None
    last_held: Plan | None = None
    followed = 0
    for step in range(2000):
        if last is None or rng.random() < 0.3:
            proposal, current, held, pending = _round(rng)
        else:  # the next round of a running cluster: a release acked or added, a job leaves the plan
            proposal, current, held, pending = last
            proposed, pending = dict(proposal.allocations), dict(pending)
            roll = rng.random()
            if roll < 0.3 and pending:
                del pending[rng.choice(sorted(pending))]
            elif roll < 0.6:
                pending[rng.choice(GPUS)] = (f"job-{rng.randrange(10)}", 3)
            elif roll < 0.8 and proposed:
                del proposed[rng.choice(sorted(proposed))]
            proposal, current = Plan(proposed), Plan(dict(current.allocations))
        if last is not None:
            proposed, currently = _same_objects(last[0], dict(proposal.allocations)), _same_objects(last[1], dict(current.allocations))
            proposal = Plan(proposed, changed=ChangedSince(last[0].allocations, proposed, _diff(dict(last[0].allocations), proposed)))
            current = Plan(currently, changed=ChangedSince(last[1].allocations, currently, _diff(dict(last[1].allocations), currently)))
        busy = BusyGpus(held, pending, current_follows_held=True)
        got = holds.hold(proposal, current, busy, overlap_free=True)
        assert dict(got.allocations) == dict(hold_releases(proposal, current, dict(busy.items())).allocations), step
        if holds.last_looked is not None:
            followed += 1
            assert last_held is not None and got.changed is not None and got.changed.follows(last_held.allocations, got.allocations)
            for job in last_held.allocations.keys() | got.allocations.keys():
                if job not in got.changed.entries:
                    assert last_held.allocations.get(job) is got.allocations.get(job), (step, job)
        last, last_held = (proposal, current, held, pending), got
    assert followed > 600, followed
