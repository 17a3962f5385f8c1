"""Faulted GPUs in the live scheduler: kept from the policy, taken from the jobs that held them.

A node's faulted GPUs are those the metadata store lists in ``Node.gpu_faults`` (an agent
reported a critical Xid, a lost GPU or new uncorrectable ECC errors), until an operator clears
them. For the scheduler such a GPU is gone the way a lost node's GPUs are:

- the plan in force loses it: a job's placement keeps only its healthy GPUs (``without_faulted``),
  and the job is then handled as after a node loss (it stays on what is left if that is at
  least its ``min_gpus``, else it is placed anew or requeued; either way in a new generation
  whose ranks resume from the job's checkpoint);
- the policy never sees it. Policies and placement know a node's GPUs as indices 0..gpus-1, so
  a node with faulted GPUs is shown with only its usable ones, renumbered (the policy's k-th
  GPU of the node is its k-th usable one), and the policy's plan is mapped back to the real
  indices before anything else reads it (:meth:`UsableGpus.schedule`);
- inference tasks are kept off it too (``LiveInference.place``'s ``unusable``).

A cleared fault reaches the next round: the node watch triggers one when the set of faulted
GPUs changes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping

from scheduler.invariants import check_plan
from scheduler.policy import Allocation, ClusterSnapshot, Plan, Policy
from silod.v1 import common_pb2

# A job's GPUs as (node, GPU indices) pairs; normalized (convert.normalized): nodes by name, indices
# ascending, no empty node.
Placement = tuple[tuple[str, tuple[int, ...]], ...]


def faulted_gpus(nodes: Iterable[common_pb2.Node]) -> dict[str, frozenset[int]]:
    """Node -> its faulted GPU indices, for the nodes that have any."""
    found = {n.spec.name: frozenset(f.index for f in n.gpu_faults if 0 <= f.index < n.spec.gpus)
             for n in nodes if n.gpu_faults}
    return {name: indices for name, indices in found.items() if indices}


class UsableGpus:
    """The usable GPUs of the nodes of one snapshot, and the renumbering the policy sees."""

    def __init__(self, nodes: Iterable[common_pb2.Node]) -> None:
        nodes = list(nodes)
        self.faulted = faulted_gpus(nodes)
        sizes = {n.spec.name: n.spec.gpus for n in nodes}
        # Physical index of the policy's k-th GPU, per node with faults (others are unchanged).
        self._physical = {name: tuple(i for i in range(sizes[name]) if i not in bad) for name, bad in self.faulted.items()}
        self._virtual = {name: {p: k for k, p in enumerate(usable)} for name, usable in self._physical.items()}

    def without_faulted(self, placement: Placement) -> Placement:
        """``placement`` without its faulted GPUs (and without nodes left with none)."""
        if not self.faulted:
            return placement
        kept = ((node, tuple(i for i in idx if i not in self.faulted.get(node, ()))) for node, idx in placement)
        return tuple((node, idx) for node, idx in kept if idx)

    # ---- the policy's view -------------------------------------------------------------------
    def _map(self, placement: Placement, table: Mapping[str, Mapping[int, int]]) -> Placement:
        return tuple((node, tuple(table[node][i] for i in idx) if node in table else idx) for node, idx in placement)

    def _map_plan(self, plan: Plan, table: Mapping[str, Mapping[int, int]]) -> Plan:
        """``plan`` renumbered; allocations on nodes without faults stay the same objects (the
        data grants keep a policy's grants only for allocations it returned untouched)."""
        def touched(allocation: Allocation) -> bool:
            return any(node in table for node, _ in allocation.placement)

        return Plan({job: dataclasses.replace(a, placement=self._map(a.placement, table)) if touched(a) else a
                     for job, a in plan.allocations.items()})

    def policy_view(self, snapshot: ClusterSnapshot) -> ClusterSnapshot:
        """``snapshot`` as the policy sees it: faulted GPUs gone, the others renumbered.
        ``snapshot.current`` must hold no faulted GPU (see :meth:`without_faulted`)."""
        if not self.faulted:
            return snapshot
        nodes = tuple(dataclasses.replace(n, gpus=len(self._physical[n.name])) if n.name in self._physical else n
                      for n in snapshot.nodes)
        busy = {node: tuple(self._virtual[node][i] for i in idx if i in self._virtual[node]) if node in self._virtual
                else idx for node, idx in snapshot.inference_busy.items()}
        return dataclasses.replace(snapshot, nodes=nodes, current=self._map_plan(snapshot.current, self._virtual),
                                   inference_busy=busy)

    def to_physical(self, plan: Plan) -> Plan:
        """A plan of the policy's view with the nodes' real GPU indices."""
        if not self.faulted:
            return plan
        physical = {node: dict(enumerate(usable)) for node, usable in self._physical.items()}
        return self._map_plan(plan, physical)

    def schedule(self, policy: Policy, snapshot: ClusterSnapshot,
                 check: Callable[[ClusterSnapshot, Plan], None] = check_plan) -> Plan:
        """The policy's plan for ``snapshot`` on its usable GPUs, with real indices, passed
        through ``check`` (the plan invariants) on the policy's view."""
        view = self.policy_view(snapshot)
        plan = policy.schedule(view)
        check(view, plan)
        return self.to_physical(plan)
