"""scheduler.plan_changes: the changes between two plans, applied to the first, give the second."""

from __future__ import annotations

import random

from scheduler.plan_changes import PlanChanges, changes_between
from scheduler.policy import Allocation


def test_changes_applied_give_the_new_plan_in_order() -> None:
    rng = random.Random(3)
    for _ in range(200):
        old = {f"j{i}": rng.randrange(4) for i in rng.sample(range(30), rng.randrange(0, 20))}
        new = {k: (v if rng.random() < 0.7 else v + 1) for k, v in old.items() if rng.random() < 0.8}
        new.update({f"j{i}": 0 for i in range(30, 30 + rng.randrange(3))})
        changes = changes_between(old, new)
        applied = changes.apply(old)
        assert applied == new
        # The base's order is kept, new entries come last, in their order in the new plan.
        assert list(applied) == [k for k in old if k in new] + [k for k in new if k not in old]
        assert len(changes) == sum(1 for k in new if old.get(k) != new[k]) + sum(1 for k in old if k not in new)


def test_unchanged_allocations_make_no_changes() -> None:
    a = Allocation(placement=(("n1", (0, 1)),), batch_size=64)
    same = Allocation(placement=(("n1", (0, 1)),), batch_size=64)
    moved = Allocation(placement=(("n2", (0, 1)),), batch_size=64)
    assert not changes_between({"j": a}, {"j": same})
    assert changes_between({"j": a}, {"j": moved}) == PlanChanges(upserts={"j": moved})
    assert changes_between({"j": a}, {}) == PlanChanges(removals=("j",))
