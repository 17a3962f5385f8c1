"""The data step of every scheduling round: cache quotas and remote IO rates per cache mode.

The policy decides GPUs; :func:`grant` decides what each placed training job gets of the two
data resources. The live scheduler (:mod:`scheduler.live.data`, which turns the result into
the plan's ``cache_grants``) and the simulator (:mod:`simulator.engine`, ``--cache silod``)
both call it after the policy, so the rules below hold in both worlds:

=========  ==================================================================================
``silod``  :func:`scheduler.codesign.co_allocate`: cache quotas by cache efficiency within each
           node's capacity, IO rates up to each job's demand ``b*`` within the storage budget;
           policy ``uniform`` (a quota holds a fixed subset of the dataset, ``h = c / d``); a
           job it would start with no IO stays queued; spare budget is shared by the readers;
           last, each tenant's cache and IO ceilings (:func:`scheduler.quotas.bound_data`)
``static`` every job reading a dataset on a node gets an equal share of the node's cache
           (CoorDL's MinIO), ``uniform``; IO not managed
``lru``    no quotas: the datasets share each node's cache as one LRU; IO not managed
``none``   pass-through (no cache, hit ratio 0); IO not managed
=========  ==================================================================================

Everything here is a pure function of the snapshot and the plans, like the policies.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Iterable, Mapping

from scheduler import codesign as co
from scheduler.node_memo import of_nodes
from scheduler.policy import Allocation, ClusterSnapshot, Plan
from scheduler.quotas import bound_data

CACHE_MODES = ("silod", "lru", "static", "none")
CACHE_POLICY = {"silod": "uniform", "static": "uniform", "lru": "lru", "none": "none"}


def grant(mode: str, snapshot: ClusterSnapshot, plan: Plan, policy_plan: Plan, training: Collection[str],
          policy_co_designs: bool) -> Plan:
    """``plan`` with the data grants of ``mode`` on the training jobs in ``training``.

    ``policy_plan`` is what the policy returned: a co-designing policy's grants are kept when
    every training allocation reached the plan unchanged (release holds and inference
    reclaims leave it alone) and they fit the cluster; otherwise ``co_allocate`` grants again
    for the placements the plan has, in the policy's order.
    """
    if mode == "silod" and not co.is_active(snapshot):
        return plan  # nothing to manage: no cache anywhere, unlimited IO
    allocations = dict(plan.allocations)
    placed = {j: a for j, a in allocations.items() if j in training and a.gpus > 0}
    datasets = {job.job_id: job.dataset for job in snapshot.jobs}
    if mode == "silod":
        unchanged = all(policy_plan.get(j) is a for j, a in placed.items())
        order = [j for j in policy_plan.allocations if j in placed] + [j for j in placed if j not in policy_plan.allocations]
        if not (policy_co_designs and unchanged and not problems(snapshot, Plan(placed))):
            placed = _regrant(snapshot, placed, order)
        idle = _starved_newcomers(snapshot, placed, order, datasets)
        if idle:
            for j in idle:
                del placed[j]
                allocations.pop(j, None)
            placed = _regrant(snapshot, placed, order)
        # With no budget and no NIC limit there is no IO to share out: a rate of b* would only
        # throttle a job whose model underestimates its reads.
        unlimited = not math.isfinite(snapshot.storage_bandwidth_bytes_per_s) and \
            not any(math.isfinite(n.nic_bytes_per_s) for n in snapshot.nodes)
        if unlimited:
            placed = {j: dataclasses.replace(a, remote_io_bytes_per_s=math.inf) for j, a in placed.items()}
        else:
            placed = _share_leftover(snapshot, placed, {j for j in placed if datasets.get(j)})
        # Tenants' cache and remote IO ceilings (scheduler.quotas): the last word on each grant.
        placed = bound_data(snapshot, placed)
        allocations.update(placed)
        return Plan(allocations)
    if mode == "static":
        readers: dict[str, int] = {}
        for j, a in placed.items():
            if datasets.get(j):
                for node, _ in a.placement:
                    readers[node] = readers.get(node, 0) + 1
        capacity = {n.name: n.cache_capacity_bytes for n in snapshot.nodes}
        for j, a in placed.items():
            share = {node: float(int(capacity.get(node, 0.0) // readers[node]))
                     for node, _ in a.placement if datasets.get(j) and readers.get(node)}
            allocations[j] = Allocation(placement=a.placement, batch_size=a.batch_size, cache_bytes=share)
        return Plan(allocations)
    # lru, none: no quotas, IO not managed
    global _BARE
    bare_before, bare = _BARE, {}
    for j, a in placed.items():
        # The same allocation in gives the same object out, round after round: what follows a
        # plan by what changed (scheduler.plan_check, the live plan entries) compares by identity.
        kept = bare_before.get(id(a))
        out = kept[1] if kept is not None and kept[0] is a else Allocation(placement=a.placement, batch_size=a.batch_size)
        bare[id(a)] = (a, out)
        allocations[j] = out
    _BARE = bare
    return Plan(allocations)


# id of an allocation given a bare grant in the last call -> (it, its bare copy); holding the
# allocation keeps its id its own.
_BARE: dict[int, tuple[Allocation, Allocation]] = {}


def _regrant(snapshot: ClusterSnapshot, placed: dict[str, Allocation], order: list[str]) -> dict[str, Allocation]:
    """``placed`` with :func:`co_allocate`'s quotas and IO rates for its placements."""
    granted = co.co_allocate(snapshot, {j: a.placement for j, a in placed.items()}, [j for j in order if j in placed],
                             {j: a.batch_size for j, a in placed.items()})
    return {j: dataclasses.replace(placed[j], cache_bytes=dict(a.cache_bytes), remote_io_bytes_per_s=a.remote_io_bytes_per_s)
            for j, a in granted.allocations.items()}


def _starved_newcomers(snapshot: ClusterSnapshot, placed: dict[str, Allocation], order: list[str],
                       datasets: dict[str, str]) -> set[str]:
    """Jobs ``placed`` would start (not holding these GPUs now) with an IO grant of 0 although
    they have data to read, while other jobs get IO: they are left queued.

    The policy's ``without_starved`` keeps a plan in which every placed job is starved (a
    budget far below every job's demand: excluding them all would leave the GPUs idle), so
    when several jobs arrive in one round all of them are placed and the srpt grants go to
    one; the others would sit on their GPUs reading nothing (the cache servers give a job
    granted 0 no remote IO). Leaving them queued also makes the plan the same whichever way
    the arrivals fall into rounds: a job arriving alone among running jobs is starved and
    passed over by ``without_starved`` itself. A job that already runs keeps its GPUs (a
    restart costs, and IO returns to it as shorter jobs finish), as in ``without_starved``."""
    if not any(a.remote_io_bytes_per_s > 0 for a in placed.values()):
        return set()
    readers = {j: a for j, a in placed.items() if datasets.get(j)}
    _, demand = co._grant(snapshot, {j: a.placement for j, a in readers.items()}, [j for j in order if j in readers],
                          {j: a.batch_size for j, a in readers.items()}, "srpt")
    return {j for j, a in readers.items()
            if a.remote_io_bytes_per_s <= 0 and demand.get(j, 0.0) > 0 and not a.same_gpus(snapshot.current.get(j))}


def _share_leftover(snapshot: ClusterSnapshot, placed: dict[str, Allocation], readers: set[str]) -> dict[str, Allocation]:
    """Budget co_allocate left over (every job got its demand ``b*``), shared equally by the jobs
    reading a dataset: rates that are ceilings must not idle the storage link.

    The demand is a prediction: a live job's fitted model is measured under the IO it was
    granted (an IO-bound job looks slow, its ``b*`` shrinks to what it got, and exact grants
    would keep it there; seen live: 0.5 of 4 MB/s granted to four cold jobs). Spare budget
    lets it go faster. Skipped when a NIC is limited (rates would have to respect each node's
    NIC too)."""
    budget = snapshot.storage_bandwidth_bytes_per_s
    if not readers or not math.isfinite(budget) or any(math.isfinite(n.nic_bytes_per_s) for n in snapshot.nodes):
        return placed
    # A job reading no dataset gets no grant on the plan: whatever co_allocate priced for it
    # (its model's dataset) goes to the readers.
    placed = {j: a if j in readers else dataclasses.replace(a, remote_io_bytes_per_s=0.0) for j, a in placed.items()}
    used = sum(placed[j].remote_io_bytes_per_s for j in readers if math.isfinite(placed[j].remote_io_bytes_per_s))
    spare = budget - used
    if spare <= 0 or any(not math.isfinite(placed[j].remote_io_bytes_per_s) for j in readers):
        return placed
    extra = spare / len(readers)
    return {j: dataclasses.replace(a, remote_io_bytes_per_s=a.remote_io_bytes_per_s + extra) if j in readers else a
            for j, a in placed.items()}


class EpochStarts:
    """What each job's nodes held of its dataset when its current epoch began, to tell the bytes
    it can hit from those it cannot (``ClusterSnapshot.fresh_bytes``).

    An epoch reads every sample once: a sample cached during the job's current epoch (its own
    misses, mostly) was read by the job before it was cached, so it is not a hit for the job
    before its next epoch. Content there when the epoch began is. The live scheduler and the
    simulator both call :meth:`fresh` every round with the cached bytes they see and each
    running job's completed epochs, so both grant IO by the same rule.

    Rounds do not fall on epoch boundaries: when a job's epoch changed since the last round,
    its epoch began somewhere in between, and the content seen at the last round stands for
    the content at its start (content only grows while the job reads). Likewise a job new on a
    node (or new altogether) may have read there since the last round: it counts from what the
    node held at the last round. Every error is on the side of more fresh bytes — so more IO
    than needed, a ceiling the job does not use — never fewer: a job granted no IO because its
    misses were taken for hits would stall on its first miss (live the cache server holds a
    miss until a plan grants IO; in the simulator the job's rate is 0). Growth from another
    reader of the dataset on the node counts as fresh too, for the same reason.
    """

    def __init__(self) -> None:
        # job -> (epoch, node -> bytes at its start, node -> bytes at the last round)
        self._seen: dict[str, tuple[int, dict[str, float], dict[str, float]]] = {}
        self._before: Mapping[tuple[str, str], float] = {}  # the cached bytes of the last round

    def fresh(self, cached: Mapping[tuple[str, str], float],
              jobs: Iterable[tuple[str, str, int, Iterable[str]]]) -> dict[tuple[str, str], float]:
        """``(job, node) -> bytes`` cached since the job's epoch began, for the active ``jobs``:
        ``(job id, dataset, completed epochs, nodes it runs on)``, no nodes for a job waiting
        (it keeps its epoch's start: paused mid-epoch, it resumes in the same epoch). Jobs not
        passed (finished) are forgotten."""
        out: dict[tuple[str, str], float] = {}
        kept: dict[str, tuple[int, dict[str, float], dict[str, float]]] = {}
        for job_id, dataset, epoch, nodes in jobs:
            if not dataset:
                continue
            seen_epoch, start, last = self._seen.get(job_id, (epoch, {}, {}))
            if seen_epoch != epoch:
                start = dict(last)
            now_by_node = dict(last) if not nodes else {}
            for node in nodes:
                now = cached.get((node, dataset), 0.0)
                begin = start.get(node, self._before.get((node, dataset), 0.0))
                begin = min(begin, now)  # evicted meanwhile: what is left counts from here
                start[node] = begin
                now_by_node[node] = now
                if now > begin:
                    out[(job_id, node)] = now - begin
            kept[job_id] = (epoch, start, now_by_node)
        self._seen = kept
        self._before = dict(cached)
        return out


def problems(snapshot: ClusterSnapshot, plan: Plan) -> list[str]:
    """Where ``plan``'s data grants exceed the cluster: a node's cache, or the IO budget."""
    found = []
    held: dict[str, float] = {}
    for a in plan.allocations.values():
        for node, quota in a.cache_bytes.items():
            held[node] = held.get(node, 0.0) + quota
    for node in snapshot.nodes:
        if held.get(node.name, 0.0) > node.cache_capacity_bytes * (1 + 1e-9):
            found.append(f"node {node.name}: cache quotas {held[node.name]:.0f} > capacity {node.cache_capacity_bytes:.0f}")
    unknown = set(held) - {n.name for n in snapshot.nodes}
    found += [f"node {n}: cache quota on a node not in the snapshot" for n in sorted(unknown)]
    io = sum(a.remote_io_bytes_per_s for a in plan.allocations.values())
    if math.isfinite(snapshot.storage_bandwidth_bytes_per_s) and io > snapshot.storage_bandwidth_bytes_per_s * (1 + 1e-9):
        found.append(f"remote IO {io:.0f} > storage budget {snapshot.storage_bandwidth_bytes_per_s:.0f}")
    return found


class GrantCheck:
    """:func:`problems` plan after plan, following each plan's hint (Plan.changed): the cache
    quotas per node and the remote IO are kept summed, and a plan moves them by the allocations
    it changed; only the nodes those touch are looked at. Anything found, a plan without a hint
    that follows the last one checked, other nodes, or every REBUILD_EVERY checks (float sums
    drift), and :func:`problems` runs whole: the same list, message for message."""

    REBUILD_EVERY = 256

    def __init__(self) -> None:
        # (allocations checked last, node tuple, node -> cache quotas, finite IO, infinite/NaN IO counts, checks)
        self._sums: tuple | None = None
        self.last_check = "whole"  # or "changes" (tests)

    def problems(self, snapshot: ClusterSnapshot, plan: Plan) -> list[str]:
        sums, self._sums = self._sums, None
        hint = plan.changed
        if sums is None or hint is None or not hint.follows(sums[0], plan.allocations) or sums[1] is not snapshot.nodes \
                or sums[5] >= self.REBUILD_EVERY:
            self.last_check = "whole"
            found = problems(snapshot, plan)
            if not found and type(snapshot.nodes) is tuple:  # kept for nodes that cannot change in place
                self._sums = (plan.allocations, snapshot.nodes, *_summed(plan.allocations.values()), 0)
            return found
        self.last_check = "changes"
        _, nodes, held, io, odd, checks = sums
        touched: set[str] = set()
        before: Mapping[str, Allocation] = sums[0]
        for job_id, now in hint.entries.items():
            for sign, allocation in ((-1.0, before.get(job_id)), (1.0, now)):
                if allocation is None:
                    continue
                for node, quota in allocation.cache_bytes.items():
                    held[node] = held.get(node, 0.0) + sign * quota
                    touched.add(node)
                rate = allocation.remote_io_bytes_per_s
                if math.isfinite(rate):
                    io += sign * rate
                else:
                    odd[math.isnan(rate)] += int(sign)
        by_name = of_nodes(nodes, "by_name", lambda nodes: {n.name: n for n in nodes})
        total = math.nan if odd[True] else math.inf if odd[False] else io
        budget = snapshot.storage_bandwidth_bytes_per_s
        if any(name not in by_name or held[name] > by_name[name].cache_capacity_bytes * (1 + 1e-9) for name in touched) \
                or (math.isfinite(budget) and total > budget * (1 + 1e-9)):
            return problems(snapshot, plan)  # the whole check names them (or finds none after all)
        self._sums = (plan.allocations, nodes, held, io, odd, checks + 1)
        return []


def _summed(allocations: Iterable[Allocation]) -> tuple[dict[str, float], float, dict[bool, int]]:
    held: dict[str, float] = {}
    io, odd = 0.0, {False: 0, True: 0}  # rates infinite (False) or NaN (True)
    for a in allocations:
        for node, quota in a.cache_bytes.items():
            held[node] = held.get(node, 0.0) + quota
        rate = a.remote_io_bytes_per_s
        if math.isfinite(rate):
            io += rate
        else:
            odd[math.isnan(rate)] += 1
    return held, io, odd
