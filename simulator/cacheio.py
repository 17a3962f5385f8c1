"""Dataset caches and remote IO in the simulated cluster: the cache-aware rate model.

The world a job runs in (docs/evaluation.md, "Co-design: cache and remote IO"):

- Every node has ``cache_capacity_bytes`` of dataset cache. ``content[(node, dataset)]`` is
  what it holds now; jobs reading the same dataset on a node share it. A job's cache is
  what its dataset occupies on the nodes it runs on (the caches of a multi-node job's nodes
  serve each other over the cluster network, not remote storage), so a job moved to other
  nodes loses its cache there.
- The cache fills as the job reads: every miss is admitted until the dataset's *target* on
  the node is reached, so a cold cache fills during the first epoch at the rate the job's
  IO allows. Content and hit ratios are updated at every scheduling round (rates are
  constant between rounds, like everything else in the engine).
- A sample is a hit only if it was cached before this read, as on the cache server (a miss
  is read from remote storage, then inserted). An epoch reads every sample once, so what a
  job inserted itself during its current epoch is not hit again in that epoch: its hit ratio
  counts only the content others (another job, an earlier epoch) put there. A job's first
  pass over content nobody cached is all misses; from its next epoch on, what it cached is
  hit. The engine counts goodput, not samples read, so the model keeps each job's position
  in its epoch itself (samples read since it started, from its throughput).
- Remote storage serves at most ``storage_bandwidth_bytes_per_s`` in total and each node at
  most its ``nic_bytes_per_s``; a multi-node job reads through each node's NIC in
  proportion to its GPUs there.
- A job runs at ``min(T(g), R_io)`` samples/s with ``R_io = b / (s (1 - h))`` (SiloD model,
  :mod:`estimator.silod_model`), times its statistical efficiency.

Cache modes (how targets, hit ratios and IO are decided):

=========  ==================================================================================
``none``   no cache; remote IO shared max-min fairly
``lru``    one LRU cache per node, shared by the datasets read there; each dataset occupies a
           share of the node proportional to its read rate (bytes/s at compute speed, Che's
           approximation when hits are rare); hit ratio ``k + (1 - k) ln(1 - k)`` with ``k`` =
           occupied / dataset bytes (:func:`estimator.silod_model.lru_hit_ratio`: LRU under a
           fresh random order every epoch, ~``k**2 / 2`` for small ``k``); IO max-min fair
``static`` CoorDL's MinIO: every job on a node gets an equal share of its cache and never
           evicts what it admitted, so the share holds a fixed subset: ``h = c / d``; IO max-min
``quiver`` Quiver's benefit-aware cache: on each node, datasets in decreasing throughput gained
           per cached byte at the job's fair IO share (nothing for a job that is compute-bound
           at that share), whole datasets first; ``h = c / d``; IO max-min fair
``silod``  the plan's cache quotas (``Allocation.cache_bytes``) are the targets and its IO
           rates (``Allocation.remote_io_bytes_per_s``) the grants; ``h = c / d``
=========  ==================================================================================

Content of a dataset no running job reads on a node is kept while the node has room left
after the targets, so a job returning to a node finds it (evicted by name order otherwise).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from estimator import silod_model
from estimator.job_model import JobModel
from estimator.predict import ModelTable, predict
from scheduler.codesign import max_min_share
from scheduler.policy import Allocation, JobInfo, NodeInfo
from simulator.rates import effective_batch_size

CACHE_MODES = ("none", "lru", "static", "quiver", "silod")
INDEPENDENT_MODES = ("none", "lru", "static", "quiver")

Key = tuple[str, str]  # (node, dataset)


class CacheIoRates:
    """A :class:`~simulator.rates.RateModel` with per-node dataset caches and a remote IO budget.

    ``rates`` is called once per round with the running jobs; ``advance`` integrates the
    cache fill between events; ``cached_bytes`` is what a co-designing policy is shown.
    """

    def __init__(self, mode: str, nodes: Sequence[NodeInfo], storage_bandwidth_bytes_per_s: float, *, gpus_per_node: int):
        if mode not in CACHE_MODES:
            raise ValueError(f"cache mode must be one of {', '.join(CACHE_MODES)}, got {mode!r}")
        self.mode = mode
        self.nodes = {n.name: n for n in nodes}
        self.budget = float(storage_bandwidth_bytes_per_s)
        self.gpus_per_node = gpus_per_node
        self.content: dict[Key, float] = {}
        self._tables: dict[tuple[int, ...], tuple[ModelTable, dict[int, int]]] = {}
        # Per running job after ``rates``: its (node, dataset) keys with GPU fractions, and
        # the remote bytes/s it reads (misses, which fill the cache).
        self._fills: dict[str, tuple[list[tuple[Key, float]], float]] = {}  # job id -> (keys and GPU fractions, miss bytes/s)
        self._targets: dict[Key, float] = {}
        # Per job: bytes it inserted per (node, dataset) in its current epoch (not hits for it
        # until the epoch ends), and its position in the epoch (samples read, epoch length,
        # samples/s read until the next round).
        self._own: dict[str, dict[Key, float]] = {}
        self._epoch: dict[str, list[float]] = {}  # job id -> [position, epoch samples, samples/s, epochs done]
        self.bytes_read = 0.0  # remote bytes read so far (IO utilization)

    # --- what the policy sees ----------------------------------------------------------

    def cached_bytes(self) -> dict[Key, float]:
        return {key: value for key, value in self.content.items() if value > 0}

    def epochs_done(self, job_id: str) -> int:
        """Epochs the job has read completely (as its sampler would report them)."""
        epoch = self._epoch.get(job_id)
        return int(epoch[3]) if epoch is not None else 0

    # --- rates -------------------------------------------------------------------------

    def _compute(self, jobs: Sequence[JobInfo], allocations: Sequence[Allocation]) -> tuple[np.ndarray, np.ndarray]:
        """``(T(g) samples/s, statistical efficiency)`` of each job at its placement and batch, IO not limiting."""
        typed = [job.model_on(a.gpu_type) for job, a in zip(jobs, allocations)]
        models: dict[int, JobModel] = {}
        for model in typed:
            models.setdefault(id(model), model)
        key = tuple(sorted(models))
        if key not in self._tables:
            self._tables[key] = (ModelTable([models[k] for k in key]), {k: i for i, k in enumerate(key)})
        table, row = self._tables[key]
        index = np.array([row[id(model)] for model in typed])
        gpus = np.array([a.gpus for a in allocations])
        nodes = np.array([a.nodes for a in allocations])
        batch = np.array([effective_batch_size(j, a) for j, a in zip(jobs, allocations)])
        pred = predict(table, index, gpus, nodes, 0.0, math.inf, batch, gpus_per_node=self.gpus_per_node)
        return pred.compute_samples_per_s, pred.statistical_efficiency

    def rates(self, jobs: Sequence[JobInfo], allocations: Sequence[Allocation]) -> np.ndarray:
        if not jobs:
            self._fills = {}
            return np.zeros(0)
        compute, eff = self._compute(jobs, allocations)
        d = np.array([job.model.dataset_bytes for job in jobs])
        s = np.array([job.model.bytes_per_sample for job in jobs])
        shares = [_node_shares(a) for a in allocations]
        self._targets = self._cache_targets(jobs, allocations, shares, compute)
        self._settle(self._targets)
        held = np.array([self._hittable(job, share) for job, share in zip(jobs, shares)])
        if self.mode == "lru":
            hit = np.asarray(silod_model.lru_hit_ratio(held, d), dtype=float)
        else:
            hit = np.asarray(silod_model.hit_ratio(held, d), dtype=float)
        # A whole dataset held is all hits: rounding in the content's bookkeeping must not leave a
        # sliver of misses that a grant of 0 (b* = 0 for the scheduler) would stall on.
        hit = np.where(hit > 1.0 - 1e-9, 1.0, hit)
        miss_bytes = s * (1.0 - hit)  # remote bytes per sample
        demand = compute * miss_bytes  # b*: IO to run at compute speed
        if self.mode == "silod":
            io = np.array([min(a.remote_io_bytes_per_s, demand[k]) for k, a in enumerate(allocations)])
        else:
            io = max_min_share(demand, shares, self.budget, {n: node.nic_bytes_per_s for n, node in self.nodes.items()})
        with np.errstate(divide="ignore", invalid="ignore"):
            io_rate = np.where(miss_bytes > 0, io / np.where(miss_bytes > 0, miss_bytes, 1.0), np.inf)
        throughput = np.minimum(compute, io_rate)
        reads = np.where(miss_bytes > 0, throughput * miss_bytes, 0.0)  # remote bytes/s actually read
        self._fills = {
            job.job_id: ([((n, job.dataset), f) for n, f in share.items()], float(reads[k]))
            for k, (job, share) in enumerate(zip(jobs, shares))
        }
        for k, job in enumerate(jobs):
            epoch = self._epoch.setdefault(job.job_id, [0.0, d[k] / s[k] if d[k] > 0 and s[k] > 0 else math.inf, 0.0, 0])
            epoch[2] = float(throughput[k])
        return throughput * eff

    def _hittable(self, job: JobInfo, share: Mapping[str, float]) -> float:
        """Bytes of the job's dataset on its nodes that it can hit now: all but what it inserted
        itself in its current epoch (it has read those samples already)."""
        own = self._own.get(job.job_id, {})
        total = 0.0
        for n in share:
            key = (n, job.dataset)
            have = self.content.get(key, 0.0)
            total += max(have - own.get(key, 0.0), 0.0)
        return total

    def isolated_rates(self, jobs: Sequence[JobInfo], allocations: Sequence[Allocation]) -> np.ndarray:
        """Goodput alone on the cluster: the whole budget (and its nodes' NICs), its nodes' cache
        holding a fixed subset (steady state). The same for every cache mode, so the finish-time
        fairness of different modes is comparable."""
        if not jobs:
            return np.zeros(0)
        compute, eff = self._compute(jobs, allocations)
        out = np.zeros(len(jobs))
        for k, (job, a) in enumerate(zip(jobs, allocations)):
            share = _node_shares(a)
            cache = 0.0 if self.mode == "none" else sum(self.nodes[n].cache_capacity_bytes for n in share)
            nic = min((self.nodes[n].nic_bytes_per_s / f for n, f in share.items() if f > 0), default=math.inf)
            io = min(self.budget, nic)
            rate = silod_model.io_bound_samples_per_s(io, cache, job.model.dataset_bytes, job.model.bytes_per_sample)
            out[k] = min(compute[k], rate) * eff[k]
        return out

    # --- cache content -----------------------------------------------------------------

    def advance(self, working_s: Mapping[str, float]) -> None:
        """Fill the caches with the misses each job (by id) read while working ``working_s[id]`` seconds."""
        for job_id, dt in working_s.items():
            if dt <= 0:
                continue
            # Where the job is in its epoch: a new epoch makes what it inserted before hits.
            boundary = 0.0  # seconds into this step of its last epoch start (0: none, keep counting)
            epoch = self._epoch.get(job_id)
            if epoch is not None and epoch[2] > 0:
                end = epoch[0] + epoch[2] * dt
                if end >= epoch[1]:
                    epoch[3] += int(end // epoch[1])
                    end %= epoch[1]
                    self._own.pop(job_id, None)
                    boundary = dt - end / epoch[2]
                epoch[0] = end
            keys, miss_rate = self._fills.get(job_id, ((), 0.0))
            if miss_rate <= 0:
                continue
            self.bytes_read += miss_rate * dt
            for key, fraction in keys:
                target = self._targets.get(key, 0.0)
                have = self.content.get(key, 0.0)
                rate = miss_rate * fraction
                if have < target and rate > 0:
                    filling = min(dt, (target - have) / rate)  # seconds until the target is reached
                    self.content[key] = min(target, have + rate * filling)
                    own = self._own.setdefault(job_id, {})
                    own[key] = min(own.get(key, 0.0) + rate * max(filling - boundary, 0.0), self.content[key])

    def _settle(self, targets: Mapping[Key, float]) -> None:
        """Cut content to its target; keep idle datasets' content only in the room targets leave."""
        by_node: dict[str, list[Key]] = {}
        for key in list(self.content):
            by_node.setdefault(key[0], []).append(key)
        for node, keys in by_node.items():
            capacity = self.nodes[node].cache_capacity_bytes if node in self.nodes else 0.0
            room = capacity - sum(t for (n, _), t in targets.items() if n == node)
            for key in sorted(keys, key=lambda k: k[1]):
                if key in targets:
                    self.content[key] = min(self.content[key], targets[key])
            idle = sorted((k for k in keys if k not in targets), key=lambda k: k[1], reverse=True)
            for key in idle:  # evict idle datasets in name order until the rest fits the room
                keep = min(self.content[key], max(room, 0.0))
                room -= keep
                self.content[key] = keep
            for key in keys:
                if self.content[key] <= 0:
                    del self.content[key]

    def _cache_targets(self, jobs, allocations, shares, compute) -> dict[Key, float]:
        """Bytes each (node, dataset) may hold under the mode (see the module docstring)."""
        targets: dict[Key, float] = {}
        if self.mode == "none":
            return targets
        if self.mode == "silod":
            for job, a in zip(jobs, allocations):
                for node, quota in a.cache_bytes.items():
                    key = (node, job.dataset)
                    targets[key] = min(targets.get(key, 0.0) + quota, job.model.dataset_bytes)
            return targets
        readers: dict[str, list[int]] = {}
        for k, share in enumerate(shares):
            for node in share:
                readers.setdefault(node, []).append(k)
        for node, ks in readers.items():
            capacity = self.nodes[node].cache_capacity_bytes
            if capacity <= 0:
                continue
            if self.mode == "static":
                for k in ks:  # an equal share per job; jobs on one dataset pool their shares
                    key = (node, jobs[k].dataset)
                    targets[key] = min(targets.get(key, 0.0) + capacity / len(ks), jobs[k].model.dataset_bytes)
            elif self.mode == "lru":
                rate: dict[str, float] = {}
                size: dict[str, float] = {}
                for k in ks:
                    ds = jobs[k].dataset
                    rate[ds] = rate.get(ds, 0.0) + compute[k] * jobs[k].model.bytes_per_sample * shares[k][node]
                    size[ds] = jobs[k].model.dataset_bytes
                total = sum(rate.values())
                for ds in rate:
                    part = capacity * rate[ds] / total if total > 0 else capacity / len(rate)
                    targets[(node, ds)] = min(part, size[ds])
            else:  # quiver
                fair = self.budget / max(len(jobs), 1)
                benefit: dict[str, float] = {}
                size = {}
                for k in ks:
                    job = jobs[k]
                    s, d = job.model.bytes_per_sample, job.model.dataset_bytes
                    uncached = compute[k] if s <= 0 else min(compute[k], fair / s)
                    benefit[job.dataset] = benefit.get(job.dataset, 0.0) + (compute[k] - uncached) * shares[k][node]
                    size[job.dataset] = d
                room = capacity
                for ds in sorted(benefit, key=lambda x: (-benefit[x] / max(size[x], 1.0), x)):
                    if benefit[ds] <= 0 or room <= 0:
                        break
                    take = min(size[ds], room)
                    targets[(node, ds)] = take
                    room -= take
        return targets


def _node_shares(allocation: Allocation) -> dict[str, float]:
    """Node -> fraction of the job's GPUs (and of its reads) there."""
    total = allocation.gpus
    return {node: len(ix) / total for node, ix in allocation.placement if ix} if total else {}
