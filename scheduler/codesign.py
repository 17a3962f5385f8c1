"""SiloD co-design: grant cache quotas and remote IO with the GPUs a policy chose.

A policy decides GPUs (and batch sizes) with its own objective; :func:`co_allocate` then
hands out the two data resources the same way for every policy (DESIGN.md, "The SiloD
model"):

1. **Cache**, per ``(node, dataset)``, in decreasing *cache efficiency* ``T(g) s / d`` — the
   remote bytes/s one cached byte saves at compute speed — within each node's
   ``cache_capacity_bytes``. A (node, dataset) pair serves every placed job reading that
   dataset with GPUs on the node, so its efficiency is the sum over those jobs, weighted
   by the share of the job's GPUs there. A job never gets more than ``d`` in total over its
   nodes, spread first over them in proportion to its GPUs there (each rank reads through its
   own node's cache). The quota is written on the reader still missing the most (so per-node
   quotas add up to what the node holds, never more).
2. **Remote IO** up to each job's demand ``b* = T(g) s (1 - h)``, within the storage budget
   and each node's NIC (a job reads through its nodes' NICs in proportion to its GPUs).
   ``h`` is the hit ratio the job has *now* — the cached bytes the snapshot reports, up to
   its quota, less what was cached there since the job's current epoch began
   (``snapshot.fresh_bytes``: it has read those samples in this epoch) — so a cold cache gets
   the IO to fill it. ``io="srpt"`` (default) serves jobs
   with the fewest remote bytes still to read first (the rest of their epochs' misses plus
   the cache fill), the policy's order breaking ties: storage is the shared bottleneck, and
   shortest-remaining-work-first is what minimizes the average time jobs spend waiting on
   it (a cold cifar10 needs 0.16 GB to become compute-bound, a 1-GPU imagenet 13 TB).
   ``io="priority"`` serves jobs in the policy's order; ``io="max_min"`` is water-filling
   (progressive filling) over the demands.

A job granted less than ``STARVED`` of its demand cannot use its GPUs; unless it is already
running there, :func:`without_starved` leaves it out so the policy can give its GPUs to
others (re-admitting without it, up to ``REDRAWS`` times).

Policies that estimate time or speed price jobs through the estimator's ``T(g, c, b)`` with
:func:`expected_grants`: the cache the job could get (a fixed subset, capped by its
dataset and what one node holds, or what it holds now) and the IO it would need, capped
by the budget.

Everything here is a pure function of the snapshot, like the policies.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import numpy as np

from estimator.predict import ModelTable, predict
from scheduler.node_memo import of_nodes
from scheduler.policy import Allocation, ClusterSnapshot, JobInfo, Plan
from scheduler.rank_requests import NodeRoom

Placement = tuple[tuple[str, tuple[int, ...]], ...]
IoOrder = Literal["srpt", "priority", "max_min"]
STARVED = 0.05   # a grant below this share of the demand leaves the job's GPUs (nearly) idle
REDRAWS = 3      # re-admissions without starved jobs per round


def is_active(snapshot: ClusterSnapshot) -> bool:
    """Whether the snapshot has data resources to manage (cache somewhere or a finite IO budget)."""
    return math.isfinite(snapshot.storage_bandwidth_bytes_per_s) or of_nodes(
        snapshot.nodes, "any_cache", lambda nodes: any(n.cache_capacity_bytes > 0 for n in nodes))


def node_shares(placement: Placement) -> dict[str, float]:
    """Node -> fraction of the job's GPUs there (also the fraction of its reads)."""
    total = sum(len(ix) for _, ix in placement)
    return {node: len(ix) / total for node, ix in placement if ix} if total else {}


def max_min_share(
    demand: Sequence[float] | np.ndarray,
    shares: Sequence[Mapping[str, float]],
    budget: float,
    nic: Mapping[str, float],
) -> np.ndarray:
    """Max-min fair IO rates (progressive filling): every unsatisfied job's rate rises equally
    until it reaches its ``demand`` or a resource it uses — the ``budget`` (all jobs) or a
    NIC (job k uses ``shares[k][node]`` of its rate on ``node``) — is full."""
    demand = np.asarray(demand, dtype=float)
    rate = np.zeros(demand.size)
    active = demand > 0
    left_budget = float(budget)
    left_nic = {n: float(v) for n, v in nic.items()}
    for _ in range(demand.size + len(left_nic) + 1):  # each pass freezes a job or fills a resource
        if not active.any():
            break
        ks = np.flatnonzero(active)
        step = np.min(demand[ks] - rate[ks])
        if math.isfinite(left_budget):
            step = min(step, left_budget / ks.size)
        load: dict[str, float] = {}
        for k in ks:
            for node, f in shares[k].items():
                load[node] = load.get(node, 0.0) + f
        for node, weight in load.items():
            cap = left_nic.get(node, math.inf)
            if math.isfinite(cap) and weight > 0:
                step = min(step, cap / weight)
        step = max(step, 0.0)
        rate[ks] += step
        left_budget -= step * ks.size
        full = set()
        for node, weight in load.items():
            if math.isfinite(left_nic.get(node, math.inf)):
                left_nic[node] -= step * weight
                if left_nic[node] <= 1e-9 * max(1.0, nic[node]):
                    full.add(node)
        budget_full = math.isfinite(budget) and left_budget <= 1e-9 * max(1.0, budget)
        for k in ks:
            if rate[k] >= demand[k] * (1 - 1e-12) or budget_full or any(n in full for n in shares[k]):
                active[k] = False
    return np.minimum(rate, demand)


def _compute_rates(jobs: Sequence[JobInfo], gpus, nodes, batch, per_node: int) -> np.ndarray:
    models: dict[int, object] = {}
    for job in jobs:
        models.setdefault(id(job.model), job.model)
    row = {key: i for i, key in enumerate(models)}
    table = ModelTable(list(models.values()))
    index = np.array([row[id(job.model)] for job in jobs])
    return predict(table, index, gpus, nodes, 0.0, math.inf, batch, gpus_per_node=per_node).compute_samples_per_s


def _per_node(snapshot: ClusterSnapshot) -> int:
    return max([n.gpus for n in snapshot.nodes if n.pool == "training"] + [1])


def co_allocate(
    snapshot: ClusterSnapshot,
    placements: Mapping[str, Placement],
    order: Sequence[str] | None = None,
    batch_sizes: Mapping[str, int] | None = None,
    *,
    io: IoOrder = "srpt",
) -> Plan:
    """The plan giving each placed job its GPUs plus cache quotas and an IO rate (module docstring)."""
    return _grant(snapshot, placements, order, batch_sizes, io)[0]


def _grant(snapshot, placements, order, batch_sizes, io) -> tuple[Plan, dict[str, float]]:
    """:func:`co_allocate`'s plan and each job's IO demand ``b*`` at its current hit ratio."""
    if io not in ("srpt", "priority", "max_min"):
        raise ValueError(f"io must be 'srpt', 'priority' or 'max_min', got {io!r}")
    batch_sizes = batch_sizes or {}
    jobs_by_id = {job.job_id: job for job in snapshot.jobs}
    sequence = [j for j in dict.fromkeys(list(order or []) + list(placements)) if j in placements and placements[j]]
    if not sequence:
        return Plan({}), {}
    jobs = [jobs_by_id[j] for j in sequence]
    shares = [node_shares(placements[j]) for j in sequence]
    gpus = np.array([sum(len(ix) for _, ix in placements[j]) for j in sequence])
    nodes = np.array([len(placements[j]) for j in sequence])
    batch = np.array([batch_sizes.get(j, 0) or jobs_by_id[j].batch_size for j in sequence])
    compute = _compute_rates(jobs, gpus, nodes, batch, _per_node(snapshot))
    d = np.array([job.model.dataset_bytes for job in jobs])
    s = np.array([job.model.bytes_per_sample for job in jobs])

    # 1. cache, in decreasing efficiency per (node, dataset)
    efficiency: dict[tuple[str, str], float] = {}
    readers: dict[tuple[str, str], list[int]] = {}
    for k, job in enumerate(jobs):
        if not job.dataset or d[k] <= 0 or s[k] <= 0:
            continue
        for node, f in shares[k].items():
            key = (node, job.dataset)
            efficiency[key] = efficiency.get(key, 0.0) + compute[k] * s[k] / d[k] * f
            readers.setdefault(key, []).append(k)
    room = {n.name: n.cache_capacity_bytes for n in snapshot.nodes}
    covered = np.zeros(len(jobs))
    quotas: list[dict[str, float]] = [{} for _ in jobs]
    ranked = sorted(efficiency, key=lambda key: (-efficiency[key], key))
    # Each rank reads through its own node's cache server, and a synchronous job runs at the
    # pace of its slowest rank: a multi-node job's quota goes first to each of its nodes in
    # proportion to its ranks there (pass 1); what a full node could not take goes to its
    # other nodes after (pass 2). A one-node job gets all of it in pass 1.
    for spread in (True, False):
        for key in ranked:
            node = key[0]
            neediest = max(readers[key], key=lambda k: (d[k] - covered[k], -k))  # the quota is written on it
            want = d[neediest] - covered[neediest]
            if spread:
                want = min(want, shares[neediest][node] * d[neediest])
            grant = min(want, room.get(node, 0.0))
            if grant <= 0:
                continue
            room[node] -= grant
            quotas[neediest][node] = quotas[neediest].get(node, 0.0) + grant
            for k in readers[key]:
                covered[k] += grant

    # 2. remote IO up to b* at the hit ratio the job has now. A sample is a hit only if it was
    # cached before this read: what the job's nodes cached since its current epoch began
    # (snapshot.fresh_bytes, mostly its own misses) it has read already in this epoch.
    cached = snapshot.cached_bytes
    fresh = snapshot.fresh_bytes
    room_of = [{n: sum(quotas[r].get(n, 0.0) for r in readers.get((n, job.dataset), [k])) for n in shares[k]}
               for k, job in enumerate(jobs)]
    filled = np.array([sum(min(cached.get((n, job.dataset), 0.0), room_of[k][n]) for n in shares[k])
                       for k, job in enumerate(jobs)])
    held = np.array([
        sum(min(max(cached.get((n, job.dataset), 0.0) - fresh.get((job.job_id, n), 0.0), 0.0), room_of[k][n])
            for n in shares[k])
        for k, job in enumerate(jobs)
    ])
    with np.errstate(divide="ignore", invalid="ignore"):
        miss = np.where(d > 0, 1.0 - np.clip(held / np.where(d > 0, d, 1.0), 0.0, 1.0), 0.0)
    demand = compute * s * miss
    nic = {n.name: n.nic_bytes_per_s for n in snapshot.nodes}
    budget = snapshot.storage_bandwidth_bytes_per_s
    if io == "max_min":
        rates = max_min_share(demand, shares, budget, nic)
    else:
        rates = np.zeros(len(jobs))
        left = budget
        left_nic = dict(nic)
        ranked = range(len(jobs))
        if io == "srpt":
            steady = np.where(d > 0, 1.0 - np.clip(covered / np.where(d > 0, d, 1.0), 0.0, 1.0), 0.0)
            # The fill is what the job's cache still lacks, whoever's reads fill it: co-readers of
            # a (node, dataset) see the same fill (fresh bytes are in the cache, only not hits yet).
            fill = np.maximum(np.minimum(covered, d) - filled, 0.0)
            work = np.array([job.remaining_samples for job in jobs]) * s * steady + fill
            ranked = sorted(range(len(jobs)), key=lambda k: (work[k], k))
        for k in ranked:
            cap = min([left] + [left_nic.get(n, math.inf) / f for n, f in shares[k].items() if f > 0])
            rates[k] = max(0.0, min(demand[k], cap))
            left -= rates[k]
            for n, f in shares[k].items():
                left_nic[n] = left_nic.get(n, math.inf) - rates[k] * f
    plan = Plan({
        j: Allocation(
            placement=placements[j], batch_size=batch_sizes.get(j, 0), cache_bytes=quotas[k],
            remote_io_bytes_per_s=float(rates[k]) if math.isfinite(rates[k]) else math.inf,
        )
        for k, j in enumerate(sequence)
    })
    return plan, {j: float(demand[k]) for k, j in enumerate(sequence)}


def without_starved(
    snapshot: ClusterSnapshot,
    admit: Callable[[frozenset[str]], tuple[Mapping[str, Placement], Sequence[str]]],
    batch_sizes: Mapping[str, int] | None = None,
    *,
    io: IoOrder = "srpt",
    spread: bool = True,
) -> Plan:
    """Co-allocate what ``admit(excluded)`` places (placements, order), re-admitting without the
    jobs the IO grants starve (below ``STARVED`` of their demand), at most ``REDRAWS`` times:
    a job that cannot read its data should not hold GPUs another job could use. With
    ``spread`` newly placed jobs first go through :func:`spread_for_cache`."""
    excluded: frozenset[str] = frozenset()
    for attempt in range(REDRAWS + 1):
        placements, order = admit(excluded)
        if spread:
            placements = spread_for_cache(snapshot, placements, order)
        plan, demand = _grant(snapshot, placements, order, batch_sizes, io)
        # A job that keeps running where it is stays even when starved this round: taking its
        # GPUs would cost a restart, and IO returns to it as shorter jobs finish.
        hungry = {
            j for j, a in plan.allocations.items()
            if demand[j] > 0 and a.remote_io_bytes_per_s < STARVED * demand[j] and not a.same_gpus(snapshot.current.get(j))
        }
        # When every placed job is starved, excluding them all would leave the GPUs idle and
        # stall the cluster (a cold start with a tight budget): run them, storage-bound.
        if not hungry or attempt == REDRAWS or hungry >= set(plan.allocations):
            return plan
        excluded = excluded | hungry
    raise AssertionError("unreachable")


def expected_grants(
    snapshot: ClusterSnapshot, jobs: Sequence[JobInfo], compute: np.ndarray | None = None, gpus: Sequence[int] | np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Per job, the ``(cache bytes, remote IO bytes/s)`` to price it with in ``T(g, c, b)``.

    Cache: what the job's dataset holds now on any one node (placement prefers such nodes),
    or what the nodes it would span could hold for it (``ceil(gpus / GPUs per node)`` nodes,
    ``gpus`` defaulting to the job's requested count), whichever is larger, capped at ``d``. The cache split
    among jobs is decided later (:func:`co_allocate`); this is the job's prospect, used to
    tell IO-bound jobs from compute-bound ones. IO: the storage budget (the job may be
    served first); with ``compute`` (T(g) per job) capped at its demand ``b*``.
    """
    best_node = max((n.cache_capacity_bytes for n in snapshot.nodes), default=0.0)
    held: dict[str, float] = {}
    for (node, dataset), value in snapshot.cached_bytes.items():
        held[dataset] = max(held.get(dataset, 0.0), value)
    counts = np.array([job.requested for job in jobs] if gpus is None else gpus, dtype=np.int64)
    spans = np.maximum(-(-counts // _per_node(snapshot)), 1)
    cache = np.array(
        [min(job.model.dataset_bytes, max(best_node * spans[k], held.get(job.dataset, 0.0))) for k, job in enumerate(jobs)],
        dtype=float,
    )
    io = np.full(len(jobs), float(snapshot.storage_bandwidth_bytes_per_s))
    if compute is not None:
        d = np.array([job.model.dataset_bytes for job in jobs])
        s = np.array([job.model.bytes_per_sample for job in jobs])
        with np.errstate(divide="ignore", invalid="ignore"):
            miss = np.where(d > 0, 1.0 - np.clip(cache / np.where(d > 0, d, 1.0), 0.0, 1.0), 0.0)
        io = np.minimum(io, compute * s * miss)
    return cache, io


def spread_for_cache(snapshot: ClusterSnapshot, placements: Mapping[str, Placement], order: Sequence[str] = ()) -> dict[str, Placement]:
    """``placements`` with each newly placed job whose dataset exceeds one node's cache spread
    over more nodes, so that its nodes' caches can hold more of it.

    A job's cache is what its dataset holds on the nodes it runs on, so a packed placement caps
    it at a few nodes' cache: an 8-GPU ImageNet job (146 GB) packed on 2 nodes of 32 GB can hit
    at most 44 %, spread over 4 nodes 88 %. Only when remote IO is limited (a finite storage
    budget) and only for jobs not keeping their current GPUs (a move would cost a restart):
    such a job is re-placed, in ``order``, over up to ``ceil(d / node cache)`` nodes (at most
    one per GPU) among the free GPUs and its own, most free GPUs first, GPUs dealt round-robin;
    it keeps its placement unless that gives it more nodes. The slower all-reduce over more
    nodes is what the estimator's ``T(g, n)`` charges for it; for an IO-bound job it is
    outweighed by the remote bytes the larger cache saves. A job whose ranks request cores or
    memory is spread only where the nodes have room for them (:mod:`scheduler.rank_requests`).
    """
    budget = snapshot.storage_bandwidth_bytes_per_s
    nodes = {n.name: n for n in snapshot.nodes if n.pool == "training"}
    if not math.isfinite(budget) or not any(n.cache_capacity_bytes > 0 for n in nodes.values()):
        return dict(placements)
    out = dict(placements)
    used: dict[str, set[int]] = {}
    for placement in out.values():
        for node, ix in placement:
            used.setdefault(node, set()).update(ix)
    free = {name: [i for i in range(n.gpus) if i not in used.get(name, set())] for name, n in nodes.items()}
    jobs = {job.job_id: job for job in snapshot.jobs}
    room = NodeRoom.of_plan(snapshot.nodes, out, jobs) if any(j.has_requests for j in jobs.values()) else None
    for job_id in dict.fromkeys(list(order) + list(out)):
        placement = out.get(job_id)
        job = jobs.get(job_id)
        if not placement or job is None:
            continue
        current = snapshot.current.get(job_id)
        if current is not None and current.placement and {(n, i) for n, ix in current.placement for i in ix} & {(n, i) for n, ix in placement for i in ix}:
            continue  # keeps (some of) its GPUs: moving it would cost a restart
        if any(node not in nodes for node, _ in placement):
            continue
        count = sum(len(ix) for _, ix in placement)
        capacity = min(nodes[node].cache_capacity_bytes for node, _ in placement)
        d = job.model.dataset_bytes
        if capacity <= 0 or d <= capacity or count < 2:
            continue
        want = min(count, math.ceil(d / capacity))
        if len(placement) >= want:
            continue
        avail = {name: list(ix) for name, ix in free.items()}
        for node, ix in placement:
            avail[node] = sorted(avail[node] + list(ix))
        # Spreading stays on the job's GPU type (a job never spans types, scheduler.placement).
        kinds = {nodes[node].gpu_type for node, _ in placement}
        candidates = sorted((n for n, ix in avail.items()
                             if ix and nodes[n].cache_capacity_bytes > 0 and nodes[n].gpu_type in kinds),
                            key=lambda n: (-len(avail[n]), -snapshot.cached_bytes.get((n, job.dataset), 0.0), n))[:want]
        if len(candidates) <= len(placement):
            continue
        take = {n: 0 for n in candidates}
        left = count
        while left:
            moved = False
            for n in candidates:
                if left and take[n] < len(avail[n]):
                    take[n] += 1
                    left -= 1
                    moved = True
            if not moved:
                break
        if left:
            continue
        spread = tuple(sorted((n, tuple(avail[n][:c])) for n, c in take.items() if c))
        if room is not None and job.has_requests:
            room.give_back(job, placement)
            if not room.fits(job, spread):
                room.take(job, placement)
                continue
            room.take(job, spread)
        for n, ix in spread:
            avail[n] = [i for i in avail[n] if i not in ix]
        free = avail
        out[job_id] = spread
    return out
