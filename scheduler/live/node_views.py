"""Every node's part of the plan in force (what its Watch is sent), cut again only where plans
changed it.

Cutting every node's part of a plan of 20,000 jobs on 5,000 nodes takes about a quarter of a
second of CPU, and a plan that moves a handful of jobs changes a handful of nodes' parts. So the
parts are kept between plans, and a plan that follows the last one by known changes (the
scheduler's own commits, an allocation server's feed) marks *dirty* the nodes of the jobs it
changed, in their old entries and their new ones; the next cut redoes those nodes only, from the
entries that concern them, in the plan's order, which is what a whole cut gives them. A plan
known otherwise (read whole from the store, a new epoch) is cut whole.

A kept part keeps the version of the plan it was cut from; the watch sends it as of the plan in
force (scheduler.live.watch). Views that read a node's address (rank 0's agent, a cache peer)
are cut again when that address changes (:class:`Addresses`), as are the parts that lacked a
job's spec once it is known.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from scheduler.live import convert
from scheduler.live.entries import EntryChanges
from silod.v1 import common_pb2, plan_pb2


class Addresses(dict):
    """Node -> address, noting the nodes whose address was set to another value since the last
    :meth:`take_changed` (the node parts that read it must be cut again)."""

    def __init__(self) -> None:
        super().__init__()
        self._changed: set[str] = set()

    def __setitem__(self, node: str, address: str) -> None:
        if self.get(node) != address:
            self._changed.add(node)
        super().__setitem__(node, address)

    def pending(self) -> bool:
        """Whether an address changed that the node parts have not been cut again for."""
        return bool(self._changed)

    def take_changed(self) -> set[str]:
        changed, self._changed = self._changed, set()
        return changed


class NodeViews:
    def __init__(self) -> None:
        self.plan: plan_pb2.AllocationPlan | None = None  # the newest plan followed
        self.views: dict[str, plan_pb2.NodePlan] = {}  # node -> its part, as of self.plan once cut
        # node -> the jobs of self.plan that concern it (GPUs or cache grants there); None: not
        # known (the next cut is whole)
        self._jobs_on: dict[str, set[str]] | None = None
        self._dirty: set[str] = set()  # nodes whose part self.views does not hold as of self.plan
        self._cut_plan: plan_pb2.AllocationPlan | None = None  # the plan self.views were cut for
        self._without_spec: set[str] = set()  # jobs whose ranks were cut before their spec was known
        self.whole_cuts = 0  # (for tests and the curious) cuts that went over every job

    def follow(self, plan: plan_pb2.AllocationPlan, base: plan_pb2.AllocationPlan | None,
               changes: EntryChanges | None) -> set[str] | None:
        """``plan`` is in force; ``changes``: what it changes of ``base``, where known. Returns the
        nodes whose part ``plan`` may change (None: any node's), before what an address or a
        spec learnt since changes (:meth:`parts_wait_on_news`)."""
        jobs_on = self._jobs_on
        if (jobs_on is None or changes is None or base is None or base is not self.plan
                or plan.epoch != base.epoch):
            self._jobs_on = None
            self.plan = plan
            return None
        marked: set[str] = set()
        for job_id in (*changes.removals, *changes.upserts):
            old = changes.previous.get(job_id)
            for node in convert.job_nodes(old) if old is not None else ():
                jobs_on.get(node, set()).discard(job_id)
                marked.add(node)
        for job_id, entry in changes.upserts.items():
            for node in convert.job_nodes(entry):
                jobs_on.setdefault(node, set()).add(job_id)
                marked.add(node)
        for old_list, new_list in ((base.replicas, plan.replicas), (base.loans, plan.loans)):
            if list(old_list) != list(new_list):
                marked.update(item.node for item in (*old_list, *new_list))
        self._without_spec.difference_update(changes.removals)  # ended: no part waits on its spec
        self._dirty |= marked
        self.plan = plan
        return marked

    def parts_wait_on_news(self) -> bool:
        """Whether some part was cut before a job's spec was known (the next cut redoes it)."""
        return bool(self._without_spec)

    def entries_to_cut(self, plan: plan_pb2.AllocationPlan, index: Mapping[str, tuple[int, plan_pb2.JobAllocation]],
                       addresses_changed: Iterable[str], specs: Mapping[str, common_pb2.JobSpec]
                       ) -> list[plan_pb2.JobAllocation] | None:
        """The entries the next cut of ``plan`` goes through, in the plan's order (``index``:
        job -> its position and entry), marking the nodes it redoes; None: a whole cut."""
        if plan is not self.plan or self._jobs_on is None or self._cut_plan is None:
            return None
        jobs_on = self._jobs_on
        for node in addresses_changed:  # the jobs there read it (rank 0's agent, a cache peer)
            for job_id in jobs_on.get(node, ()):
                if job_id in index:
                    self._dirty.update(convert.job_nodes(index[job_id][1]))
        for job_id in [j for j in self._without_spec if j in specs or j not in index]:
            self._without_spec.discard(job_id)
            if job_id in index:
                self._dirty.update(convert.job_nodes(index[job_id][1]))
        wanted = {job_id for node in self._dirty for job_id in jobs_on.get(node, ()) if job_id in index}
        return [index[job_id][1] for job_id in sorted(wanted, key=lambda j: index[j][0])]

    def cut(self, plan: plan_pb2.AllocationPlan, entries: list[plan_pb2.JobAllocation] | None,
            specs: Mapping[str, common_pb2.JobSpec], agent_addresses: Mapping[str, str],
            cache_addresses: Mapping[str, str]) -> dict[str, plan_pb2.NodePlan]:
        """Every node's part of ``plan``: the dirty nodes' cut from ``entries`` (as
        :meth:`entries_to_cut` gave them) and the others kept, or all cut (``entries`` None)."""
        if plan is not self.plan:  # an older plan, cut late: whole, and not kept
            return convert.node_plans(plan, specs, agent_addresses, cache_addresses)
        if entries is None:
            self.whole_cuts += 1
            views = convert.node_plans(plan, specs, agent_addresses, cache_addresses)
            self._jobs_on = jobs_on = {}
            for entry in plan.jobs:
                for node in convert.job_nodes(entry):
                    jobs_on.setdefault(node, set()).add(entry.job_id)
            self._without_spec = {entry.job_id for entry in plan.jobs if entry.job_id not in specs}
        else:
            dirty = self._dirty
            part = convert.node_plans(plan, specs, agent_addresses, cache_addresses, nodes=dirty, jobs=entries)
            views = {node: view for node, view in self.views.items() if node not in dirty}
            views.update(part)
            self._without_spec.update(entry.job_id for entry in entries if entry.job_id not in specs)
        self._dirty = set()
        self.views, self._cut_plan = views, plan
        return views
