"""Tenant quotas: one rule, around any policy, for the simulator and the live scheduler alike.

A tenant's :class:`TenantQuota` is its *nominal* share of the training GPUs (per GPU type on
a typed cluster, or of any type), in the spirit of a Kueue ClusterQueue's nominal quota in
one cohort (the whole cluster):

- **Guarantee.** Each round a tenant with work gets first call on its nominal GPUs: the
  policy runs on the tenant's jobs alone, on a slice of the cluster as large as its nominal
  quota (capped by what its jobs could use). The policy orders and sizes the tenant's jobs
  inside that slice, by its own rules — so every policy is bounded, not just the rigid ones.
- **Lending.** GPUs a tenant's slice leaves idle, nominal quota of tenants with no work and
  the GPUs no tenant owns (the *unassigned remainder*) form one pool. The policy runs once
  more on that pool, over every job still waiting: tenants without a quota row, and quota
  tenants' jobs beyond their nominal share (they *borrow*). Who gets the pool is the
  policy's own order (FIFO by arrival, Themis by fairness, ...). Elastic jobs placed on their
  tenant's slice may then grow onto what that pass left idle (:func:`_grow`).
- **Reclaim.** The slice is carved from the tenant's own running jobs' GPUs first, then free
  GPUs, then GPUs borrowers hold (the most recently submitted, lowest-priority borrowers of
  other tenants first). So when an owner's demand returns, the borrowers on its share lose
  those GPUs in that same round; the plan's preemption goes through the checkpoint path
  like any other; an elastic borrower the policy sized itself may instead shrink in place to
  its own tenant's share. Non-preemptive policies (FIFO) do not stop a reclaim: a quota outranks
  the policy's own no-preemption rule, as in Kueue.
- **Limits.** ``borrowing_limit_gpus`` caps what a tenant may hold beyond its nominal share;
  ``lending_limit_gpus`` caps how much of its idle nominal share may be lent (the rest stays
  idle, ready for it). Both are GPU counts over all types; None = no limit.
- **Tenants without a quota row** have no guarantee: they run on the lending pool (the
  unassigned remainder, and idle quota of others, which owners may reclaim). With no quota
  rows at all the rule is a no-op: :func:`schedule` returns the policy's own plan.
- **Cache bytes and remote IO share** are ceilings on what the co-design grants a tenant's
  jobs in one plan (:func:`bound_data`, applied by :func:`scheduler.data_grants.grant`):
  cache quotas summed over the tenant's jobs and nodes, and remote IO as a fraction of the
  storage budget. They are not lent.

When the quotas exceed the cluster (nodes lost, or an over-generous admin), slices are
carved in tenant-name order and the last tenants get less. Everything here is a pure
function of the snapshot, like the policies.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from scheduler.policy import UNLIMITED, Allocation, ClusterSnapshot, JobInfo, Plan, Policy, TenantQuota  # noqa: F401 (TenantQuota: its former home)
from scheduler.rank_requests import less_requested, within_reach

Gpu = tuple[str, int]  # (node, physical GPU index)
ANY_TYPE = ""          # key of TenantQuota.gpus: GPUs of any type (the only key an untyped cluster needs)
BORROW_RETRIES = 4     # re-runs of the lending pass without the jobs of tenants over their borrowing limit


@dataclass
class _Slice:
    """GPUs carved for one tenant this round, and what it still may take (working state)."""

    want: dict[str, int]                        # GPU type (or ANY_TYPE) -> GPUs still to carve
    gpus: set[Gpu] = field(default_factory=set)


def schedule(policy: Policy, snapshot: ClusterSnapshot) -> Plan:
    """``policy``'s plan for ``snapshot`` within the tenants' quotas (module docstring), every
    job held to the ranks the cluster could hold for its cores and memory (rank_requests.within_reach)."""
    snapshot = within_reach(snapshot)
    quotas = snapshot.quotas
    if not quotas:
        return policy.schedule(snapshot)
    types = {n.name: n.gpu_type for n in snapshot.nodes if n.pool == "training"}
    by_tenant: dict[str, list[JobInfo]] = {}
    for job in snapshot.jobs:
        by_tenant.setdefault(job.tenant, []).append(job)
    slices = carve(snapshot, types, by_tenant)
    withheld = _withheld(snapshot, types, slices, by_tenant)
    if not any(s.gpus for s in slices.values()) and not withheld and not _limits_bind(quotas, by_tenant):
        return policy.schedule(snapshot)  # nobody with a quota has work: the plan is the policy's own

    allocations: dict[str, Allocation] = {}
    used: set[Gpu] = set()
    for tenant in sorted(slices):
        if not slices[tenant].gpus:
            continue
        plan = _run_on(policy, snapshot, slices[tenant].gpus, by_tenant[tenant], inference=False,
                       io_share=quotas[tenant].remote_io_share, placed=allocations)
        for job_id, alloc in plan.allocations.items():
            if alloc.gpus:
                allocations[job_id] = alloc
                used.update(_gpus_of(alloc))
    # The lending pass: every GPU not used above nor withheld, every job not placed above.
    pool = {gpu for gpu in all_gpus(snapshot, types) if gpu not in used and gpu not in withheld}
    waiting = [job for job in snapshot.jobs if job.job_id not in allocations]
    lent = _lend(policy, snapshot, pool, waiting, allocations)
    idle = pool - {g for a in lent.allocations.values() for g in _gpus_of(a)}
    grown = _grow(policy, snapshot, pool, waiting, allocations, lent) if idle else None
    allocations.update({j: a for j, a in (grown or lent).allocations.items() if a.gpus})
    return Plan(allocations)


def _lend(policy: Policy, snapshot: ClusterSnapshot, pool: set[Gpu], waiting: list[JobInfo],
          placed: Mapping[str, Allocation]) -> Plan:
    """The policy's plan for the ``waiting`` jobs on ``pool`` (and the inference pool), without
    the jobs that would take a tenant over its borrowing limit."""
    quotas = snapshot.quotas
    if not pool or not waiting:  # the shares took every training GPU (policies expect some), or no one waits
        return Plan()
    excluded: set[str] = set()
    for attempt in range(BORROW_RETRIES + 1):
        jobs = [job for job in waiting if job.job_id not in excluded]
        plan = _run_on(policy, snapshot, pool, jobs, inference=True, io_share=1.0, placed=placed) if jobs else Plan()
        over = _over_borrowing(quotas, snapshot.jobs, placed, plan)
        if not over:
            return plan
        if attempt == BORROW_RETRIES:  # the policy keeps choosing them: leave them out of this plan
            return Plan({j: a for j, a in plan.allocations.items() if j not in over})
        excluded |= over
    raise AssertionError("unreachable")


def _grow(policy: Policy, snapshot: ClusterSnapshot, pool: set[Gpu], waiting: list[JobInfo],
          placed: dict[str, Allocation], lent: Plan) -> Plan | None:
    """Elastic jobs placed on their tenant's share may grow onto GPUs the lending pass left
    idle (borrowing, like a queued job): the lending pass once more, with those jobs in it,
    each at least as large as its share gave it (its ``min_gpus`` raised to that) and shown
    holding that allocation. Their GPUs join the pool. Taken only when it keeps every such job
    at least as large and the tenants within their borrowing limits, and allocates more GPUs
    than ``lent``; the jobs it grows leave ``placed``. None otherwise."""
    quotas = snapshot.quotas
    growable = [job for job in snapshot.jobs if job.job_id in placed and not job.rigid
                and placed[job.job_id].gpus < job.max_gpus and job.tenant in quotas
                and quotas[job.tenant].borrowing_limit_gpus is None]
    if not growable:
        return None
    sizes = {job.job_id: placed[job.job_id].gpus for job in growable}
    theirs = {g for job in growable for g in _gpus_of(placed[job.job_id])}
    jobs = sorted([dataclasses.replace(job, min_gpus=sizes[job.job_id]) for job in growable] + list(waiting),
                  key=lambda j: (j.submit_time_s, j.job_id))
    current = dict(snapshot.current.allocations)
    current.update({job.job_id: placed[job.job_id] for job in growable})
    rest = {j: a for j, a in placed.items() if j not in sizes}
    plan = _run_on(policy, snapshot, pool | theirs, jobs, inference=True, io_share=1.0, current=current, placed=rest)
    if any(plan.gpus_of(j) < n for j, n in sizes.items()):
        return None
    if _over_borrowing(quotas, snapshot.jobs, rest, Plan({j: a for j, a in plan.allocations.items() if j not in sizes})):
        return None
    if sum(a.gpus for a in plan.allocations.values()) <= sum(sizes.values()) + sum(a.gpus for a in lent.allocations.values()):
        return None
    for job_id in sizes:
        del placed[job_id]
    return plan


@dataclass(frozen=True)
class QuotaBounded:
    """``policy`` with :func:`schedule`'s quota rule around it (a policy itself)."""

    policy: Policy

    @property
    def name(self) -> str:
        return str(getattr(self.policy, "name", type(self.policy).__name__))

    def schedule(self, snapshot: ClusterSnapshot) -> Plan:
        return schedule(self.policy, snapshot)


# ---- the slices ------------------------------------------------------------------------------

def all_gpus(snapshot: ClusterSnapshot, types: Mapping[str, str]) -> list[Gpu]:
    """Every training-pool GPU, by node name then index."""
    return [(n.name, i) for n in sorted(snapshot.nodes, key=lambda n: n.name) if n.name in types for i in range(n.gpus)]


def carve(snapshot: ClusterSnapshot, types: Mapping[str, str], by_tenant: Mapping[str, list[JobInfo]]) -> dict[str, _Slice]:
    """Each quota tenant's slice: up to its nominal GPUs (per type), no more than its jobs could
    use; from its running jobs' GPUs first, then free GPUs, then borrowers' GPUs."""
    quotas = snapshot.quotas
    slices: dict[str, _Slice] = {}
    for tenant in sorted(quotas):
        jobs = by_tenant.get(tenant, [])
        want: dict[str, int] = {}
        for kind, nominal in quotas[tenant].gpus.items():
            demand = sum(j.max_gpus for j in jobs if kind == ANY_TYPE or j.allows(kind))
            if min(nominal, demand) > 0:
                want[kind] = min(nominal, demand)
        slices[tenant] = _Slice(want)
    exists = set(all_gpus(snapshot, types))  # a stale plan in force may name lost nodes or GPUs
    holder = {gpu: job_id for job_id, alloc in snapshot.current.allocations.items() for gpu in _gpus_of(alloc)
              if gpu in exists}
    tenant_of = {job.job_id: job.tenant for job in snapshot.jobs}
    # 1. Each tenant keeps its running jobs, whole, up to its nominal share.
    keeps: set[str] = set()
    for tenant in sorted(slices):
        for job in sorted(by_tenant.get(tenant, []), key=lambda j: (j.submit_time_s, j.job_id)):
            alloc = snapshot.current.get(job.job_id)
            gpus = [g for g in _gpus_of(alloc) if g in exists] if alloc is not None else []
            # A job running at the size its owner asked for (what the queue policies give) whole or
            # not at all; one the policy sized otherwise (elastic) shrinks to what the share holds.
            if gpus and (len(gpus) == job.requested or _room(slices[tenant], gpus, types) < job.min_gpus):
                if _take(slices[tenant], gpus, types, whole=True):
                    keeps.add(job.job_id)
            elif gpus and _take(slices[tenant], gpus, types, whole=False):
                keeps.add(job.job_id)
    # 2. Free GPUs, on the nodes where the tenant already has some, then the emptiest.
    taken = {g for s in slices.values() for g in s.gpus}
    free = [g for g in all_gpus(snapshot, types) if g not in holder and g not in taken]
    for tenant in sorted(slices):
        mine = {node for node, _ in slices[tenant].gpus}
        empty: dict[str, int] = {}
        for node, _ in free:
            empty[node] = empty.get(node, 0) + 1
        ranked = sorted(free, key=lambda g: (g[0] not in mine, -empty[g[0]], g))
        _take(slices[tenant], ranked, types, whole=False)
        free = [g for g in free if g not in slices[tenant].gpus]
    # 3. Reclaim: borrowers' GPUs (jobs not kept above), other tenants' first, the lowest
    # priority and most recently submitted first, a victim's GPUs together.
    jobs = {job.job_id: job for job in snapshot.jobs}
    victims = sorted((j for j in snapshot.current.allocations if j not in keeps and j in jobs),
                     key=lambda j: (jobs[j].priority, -jobs[j].submit_time_s, j))
    for tenant in sorted(slices):
        if not any(slices[tenant].want.values()):
            continue
        order = [j for j in victims if tenant_of[j] != tenant] + [j for j in victims if tenant_of[j] == tenant]
        taken = {g for s in slices.values() for g in s.gpus}
        candidates = [g for j in order for g in _gpus_of(snapshot.current.allocations[j]) if g in exists and g not in taken]
        _take(slices[tenant], candidates, types, whole=False)
    return slices


def _room(slice_: _Slice, gpus: list[Gpu], types: Mapping[str, str]) -> int:
    """How many of ``gpus`` the slice still wants."""
    kinds = {types[g[0]] for g in gpus}
    typed = sum(min(slice_.want.get(k, 0), sum(1 for g in gpus if types[g[0]] == k)) for k in kinds if k != ANY_TYPE)
    return min(len(gpus), typed + slice_.want.get(ANY_TYPE, 0))


def _take(slice_: _Slice, gpus: Iterable[Gpu], types: Mapping[str, str], *, whole: bool) -> bool:
    """Add ``gpus`` to the slice while it wants their type (its own, then ANY_TYPE); with
    ``whole`` all of them or none. Whether any were taken."""
    gpus = list(gpus)
    if whole:
        need: dict[str, int] = {}
        for g in gpus:
            need[types[g[0]]] = need.get(types[g[0]], 0) + 1
        typed = {k: min(n, slice_.want.get(k, 0)) if k != ANY_TYPE else 0 for k, n in need.items()}
        if sum(need.values()) - sum(typed.values()) > slice_.want.get(ANY_TYPE, 0):
            return False
    took = False
    for g in gpus:
        kind = types[g[0]]
        key = kind if kind != ANY_TYPE and slice_.want.get(kind, 0) > 0 else ANY_TYPE
        if slice_.want.get(key, 0) > 0 and g not in slice_.gpus:
            slice_.want[key] -= 1
            slice_.gpus.add(g)
            took = True
    return took


def _withheld(snapshot: ClusterSnapshot, types: Mapping[str, str], slices: Mapping[str, _Slice],
              by_tenant: Mapping[str, list[JobInfo]]) -> set[Gpu]:
    """Idle nominal GPUs a lending limit keeps out of the lending pool (free ones, per type)."""
    out: set[Gpu] = set()
    limited = {t: q for t, q in snapshot.quotas.items() if q.lending_limit_gpus is not None}
    if not limited:
        return out
    holder = {g for alloc in snapshot.current.allocations.values() for g in _gpus_of(alloc)}
    taken = {g for s in slices.values() for g in s.gpus}
    free = [g for g in all_gpus(snapshot, types) if g not in holder and g not in taken]
    for tenant in sorted(limited):
        quota = limited[tenant]
        # Idle nominal GPUs (not in its slice) beyond the lending limit stay unlent. Slice GPUs
        # the tenant's policy leaves idle are lent: its jobs could not use them this round.
        for kind, nominal in sorted(quota.gpus.items()):
            carved = sum(1 for g in slices[tenant].gpus if kind in (ANY_TYPE, types[g[0]]))
            keep = max(0, nominal - carved - quota.lending_limit_gpus)
            pick = [g for g in free if g not in out and kind in (ANY_TYPE, types[g[0]])][:keep]
            out.update(pick)
    return out


def _limits_bind(quotas: Mapping[str, TenantQuota], by_tenant: Mapping[str, list[JobInfo]]) -> bool:
    """Whether a borrowing limit could bound a tenant with work this round."""
    return any(q.borrowing_limit_gpus is not None and by_tenant.get(t) for t, q in quotas.items())


def _over_borrowing(quotas: Mapping[str, TenantQuota], jobs: Iterable[JobInfo], first: Mapping[str, Allocation],
                    plan: Plan) -> set[str]:
    """Jobs of the lending pass to leave out: per tenant over ``nominal + borrowing limit`` in
    all, its most recently submitted placed jobs until it is within."""
    out: set[str] = set()
    mine: dict[str, list[JobInfo]] = {}
    for job in jobs:
        mine.setdefault(job.tenant, []).append(job)
    for tenant, quota in quotas.items():
        if quota.borrowing_limit_gpus is None:
            continue
        held = sum(first[j.job_id].gpus for j in mine.get(tenant, []) if j.job_id in first)
        cap = quota.nominal_gpus + quota.borrowing_limit_gpus
        placed = sorted((j for j in mine.get(tenant, []) if plan.gpus_of(j.job_id)),
                        key=lambda j: (j.submit_time_s, j.job_id))
        total = held + sum(plan.gpus_of(j.job_id) for j in placed)
        while total > cap and placed:
            job = placed.pop()
            total -= plan.gpus_of(job.job_id)
            out.add(job.job_id)
    return out


# ---- running the policy on part of the cluster -------------------------------------------------

def _gpus_of(alloc: Allocation | None) -> list[Gpu]:
    return [(node, i) for node, idx in alloc.placement for i in idx] if alloc is not None else []


def _run_on(policy: Policy, snapshot: ClusterSnapshot, gpus: set[Gpu], jobs: list[JobInfo], *, inference: bool,
            io_share: float, current: Mapping[str, Allocation] | None = None, placed: Mapping[str, Allocation] = {}) -> Plan:
    """``policy``'s plan for ``jobs`` on the training GPUs ``gpus`` (and, with ``inference``,
    the inference pool), mapped back to the real GPU indices.

    Policies know a node's GPUs as indices 0..gpus-1, so a node is shown with only the GPUs
    of ``gpus``, renumbered, and without the cores and memory the ranks of ``placed`` (this
    round's earlier runs) request there; a job's current allocation (``current``: the
    snapshot's) is kept when all its GPUs are there, an elastic job's also when at least
    ``min_gpus`` of them are (it then shrinks in place)."""
    physical: dict[str, list[int]] = {}
    for node, index in sorted(gpus):
        physical.setdefault(node, []).append(index)
    nodes = []
    for node in snapshot.nodes:
        if node.pool == "training" and node.name in physical:
            nodes.append(node if len(physical[node.name]) == node.gpus else dataclasses.replace(node, gpus=len(physical[node.name])))
        elif node.pool != "training" and inference:
            nodes.append(node)
    virtual = {node: {p: k for k, p in enumerate(indices)} for node, indices in physical.items()}
    passthrough = {n.name for n in nodes if n.pool != "training"}
    by_id = {job.job_id: job for job in jobs}
    held: dict[str, Allocation] = {}
    for job_id, alloc in (snapshot.current.allocations if current is None else current).items():
        job = by_id.get(job_id)
        if job is None:
            continue
        mapped = _remap(alloc, virtual, passthrough)
        if mapped is None and not job.rigid:
            inside = tuple((node, tuple(i for i in idx if i in virtual.get(node, ()) or node in passthrough))
                           for node, idx in alloc.placement)
            inside = tuple((node, idx) for node, idx in inside if idx)
            if sum(len(idx) for _, idx in inside) >= max(1, job.min_gpus):
                kept = {node for node, _ in inside}
                mapped = _remap(dataclasses.replace(alloc, placement=inside, cache_bytes={
                    n: b for n, b in alloc.cache_bytes.items() if n in kept}), virtual, passthrough)
        if mapped is not None:
            held[job_id] = mapped
    budget = snapshot.storage_bandwidth_bytes_per_s
    view = dataclasses.replace(
        snapshot, nodes=less_requested(tuple(nodes), placed, snapshot.jobs), jobs=tuple(jobs), current=Plan(held),
        storage_bandwidth_bytes_per_s=budget * io_share if math.isfinite(budget) else budget,
        inference_busy=snapshot.inference_busy if inference else {}, quotas={},
    )
    plan = policy.schedule(view)
    back = {node: dict(enumerate(indices)) for node, indices in physical.items()}
    out: dict[str, Allocation] = {}
    for job_id, alloc in plan.allocations.items():
        mapped = _remap(alloc, back, passthrough)
        if mapped is None:  # a policy placing outside its view is a bug, not a plan to commit
            raise AssertionError(f"{job_id}: placed outside the GPUs the policy was shown: {alloc.placement}")
        out[job_id] = mapped
    return Plan(out)


def _remap(alloc: Allocation, table: Mapping[str, Mapping[int, int]], passthrough: set[str]) -> Allocation | None:
    """``alloc`` renumbered by ``table`` (node -> old index -> new), nodes in ``passthrough``
    (the inference pool) as they are; None when one of its GPUs is in neither."""
    placement = []
    changed = False
    for node, idx in alloc.placement:
        if node not in table:
            if node not in passthrough:
                return None
            placement.append((node, idx))
            continue
        try:
            new = tuple(table[node][i] for i in idx)
        except KeyError:
            return None
        changed |= new != idx
        placement.append((node, new))
    return dataclasses.replace(alloc, placement=tuple(placement)) if changed else alloc


# ---- cache and IO ceilings -----------------------------------------------------------------------

def bound_data(snapshot: ClusterSnapshot, allocations: Mapping[str, Allocation]) -> dict[str, Allocation]:
    """``allocations`` with each quota tenant's cache quotas and remote IO scaled down to its
    ceilings (``cache_bytes``; ``remote_io_share`` of the storage budget) where they exceed them."""
    out = dict(allocations)
    if not snapshot.quotas:
        return out
    tenant_of = {job.job_id: job.tenant for job in snapshot.jobs}
    budget = snapshot.storage_bandwidth_bytes_per_s
    for tenant, quota in snapshot.quotas.items():
        mine = [j for j in out if tenant_of.get(j) == tenant]
        cache = sum(out[j].total_cache_bytes for j in mine)
        if math.isfinite(quota.cache_bytes) and cache > quota.cache_bytes:
            f = quota.cache_bytes / cache
            for j in mine:
                out[j] = dataclasses.replace(out[j], cache_bytes={n: float(math.floor(b * f)) for n, b in out[j].cache_bytes.items()})
        if quota.remote_io_share < 1.0 and math.isfinite(budget):
            cap = quota.remote_io_share * budget
            rates = {j: out[j].remote_io_bytes_per_s for j in mine}
            if any(not math.isfinite(r) for r in rates.values()):
                share = cap / max(1, len(rates))
                for j in mine:
                    out[j] = dataclasses.replace(out[j], remote_io_bytes_per_s=share)
            elif sum(rates.values()) > cap:
                f = cap / sum(rates.values())
                for j in mine:
                    out[j] = dataclasses.replace(out[j], remote_io_bytes_per_s=rates[j] * f)
    return out


def usage(snapshot: ClusterSnapshot, plan: Plan) -> dict[str, int]:
    """Training GPUs each tenant holds under ``plan``."""
    tenant_of = {job.job_id: job.tenant for job in snapshot.jobs}
    out: dict[str, int] = {}
    for job_id, alloc in plan.allocations.items():
        if job_id in tenant_of:
            out[tenant_of[job_id]] = out.get(tenant_of[job_id], 0) + alloc.gpus
    return out
