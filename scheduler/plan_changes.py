"""What one plan changes of the plan before it: the entries that are new or different, and the
jobs that drop out. One mechanism for every kind of plan keyed by job: the simulator's
``Plan.allocations`` (which jobs a round restarts) and the live scheduler's plan entries (what
a commit sends and the metadata store keeps, see CommitPlanRequest.changes).

A round at a thousand nodes changes a few dozen of five thousand entries; sending, checking and
storing the whole plan every round cost more than the policy itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

V = TypeVar("V")


@dataclass(frozen=True)
class PlanChanges(Generic[V]):
    upserts: Mapping[str, V] = field(default_factory=dict)  # job -> its entry, new or different
    removals: tuple[str, ...] = ()  # jobs the base has and the new plan does not

    def __bool__(self) -> bool:
        return bool(self.upserts) or bool(self.removals)

    def __len__(self) -> int:
        return len(self.upserts) + len(self.removals)

    def apply(self, base: Mapping[str, V]) -> dict[str, V]:
        """The new plan's entries: the base's in their order, changed ones in place, removed ones
        dropped, new ones after them in the order of ``upserts``."""
        gone = set(self.removals)
        out = {k: self.upserts.get(k, v) for k, v in base.items() if k not in gone}
        for k, v in self.upserts.items():
            out.setdefault(k, v)
        return out


def changes_between(old: Mapping[str, V], new: Mapping[str, V],
                    same: Callable[[V, V], bool] = lambda a, b: a == b) -> PlanChanges[V]:
    """The changes that turn ``old`` into ``new`` (``apply`` on ``old`` gives ``new``'s entries)."""
    upserts = {k: v for k, v in new.items() if k not in old or not same(old[k], v)}
    return PlanChanges(upserts=upserts, removals=tuple(k for k in old if k not in new))
