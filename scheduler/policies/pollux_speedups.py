"""What Pollux's count search prices: a job's speedup at each GPU count it may get
(:class:`SpeedupTable`, built by :meth:`scheduler.policies.pollux.PolluxPolicy.speedup_table`),
the rows of it a job keeps from round to round (:func:`remembered_speedups`), shared with
DeepBoot, and the cache and IO each candidate is priced at (:func:`candidate_grants`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from scheduler import codesign as co
from scheduler.policies.estimates import io_demand
from scheduler.policies.pollux_estimates import JobTable
from scheduler.policy import ClusterSnapshot, JobInfo


@dataclass(frozen=True)
class SpeedupTable:
    """Everything the count search needs, one row per job of the snapshot (in snapshot order).

    ``utility[j, g]`` is job j's term of the objective with g GPUs (-inf where g is not
    allowed); ``speedup[j, g]`` the speedup with the restart penalty applied (0 at g = 0,
    NaN where not allowed), packed on the fewest nodes — except that keeping the current
    count is priced where the job runs now. ``split[j, g]`` is the (penalized) speedup of a
    job that would fit on one node (g <= per_node) but is spread over two or more.
    """

    jobs: tuple[JobInfo, ...]
    capacity: int                 # GPUs the policy may hand out
    per_node: int                 # GPUs per node ("packed" means ceil(g / per_node) nodes)
    current: np.ndarray           # GPUs each job holds now (where it can stay)
    speedup: np.ndarray
    split: np.ndarray
    raw: np.ndarray               # speedup (packed) before the restart penalty
    raw_split: np.ndarray         # split speedup before the restart penalty
    utility: np.ndarray
    factor: np.ndarray            # per job: restart penalty factor
    tie_break: np.ndarray         # per job: utility bonus for being allocated (orders equals)
    estimates: JobTable


# (id of a job model, lowest count, highest count, GPUs per node, with split candidates) ->
# (the model, packed speedups of the counts, split speedups of the counts 2..per_node among
# them). A model is kept in its entry so its id is not reused while the entry lives.
_SPEEDUP_ROWS: dict[tuple[int, int, int, int, bool], tuple[object, np.ndarray, np.ndarray]] = {}
_SPEEDUP_ROWS_LIMIT = 50_000


def remembered_speedups(estimates: JobTable, jobs, low: np.ndarray, high: np.ndarray, sizes: np.ndarray,
                        rows: np.ndarray, spread: np.ndarray | None, nodes: np.ndarray | None, per_node: int) -> np.ndarray:
    """Speedups (one GPU base, no cache, IO unlimited) of every candidate of :meth:`PolluxPolicy.speedup_table`:
    the packed candidates ``rows`` then the split ones ``rows[spread]``, in that order
    (``spread`` None: the packed ones only, as DeepBoot prices).

    Every round prices every active job again though only arrivals are new; a job's row
    depends on its model (fixed while it runs), its count range and the node size only, so
    rows are remembered and only unseen ones predicted (the same numbers: same inputs).
    """
    n = len(jobs)
    with_split = spread is not None
    if spread is None:
        spread = np.zeros(rows.size, dtype=bool)
        nodes = np.zeros(rows.size, dtype=np.int64)
    packed_start = np.cumsum(sizes) - sizes
    split_sizes = np.bincount(rows[spread], minlength=n)
    split_start = rows.size + np.cumsum(split_sizes) - split_sizes
    values = np.empty(rows.size + int(split_sizes.sum()))
    models = [job.model for job in jobs]
    keys = [(id(m), lo, hi, per_node, with_split) for m, lo, hi in zip(models, low.tolist(), high.tolist())]
    missing = []
    for j, key in enumerate(keys):
        if not sizes[j]:
            continue
        found = _SPEEDUP_ROWS.get(key)
        if found is None or found[0] is not models[j]:
            missing.append(j)
            continue
        values[packed_start[j]:packed_start[j] + sizes[j]] = found[1]
        values[split_start[j]:split_start[j] + split_sizes[j]] = found[2]
    if missing:
        wanted = np.zeros(n, dtype=bool)
        wanted[missing] = True
        pick = np.concatenate([wanted[rows], wanted[rows[spread]]])
        every_row = np.concatenate([rows, rows[spread]])
        every_count = np.concatenate([np.arange(rows.size) - np.repeat(packed_start, sizes) + low[rows],
                                      (np.arange(rows.size) - np.repeat(packed_start, sizes) + low[rows])[spread]])
        predicted = estimates.predict(every_row[pick], every_count[pick], nodes[pick], per_node=per_node,
                                      cache_bytes=np.zeros(int(pick.sum())),
                                      remote_io_bytes_per_s=np.full(int(pick.sum()), np.inf)).speedup
        values[pick] = predicted
        if len(_SPEEDUP_ROWS) + len(missing) > _SPEEDUP_ROWS_LIMIT:
            _SPEEDUP_ROWS.clear()
        for j in missing:
            _SPEEDUP_ROWS[keys[j]] = (models[j], values[packed_start[j]:packed_start[j] + sizes[j]].copy(),
                                      values[split_start[j]:split_start[j] + split_sizes[j]].copy())
    return values


def with_model(job: JobInfo, model) -> JobInfo:
    """``job`` priced with ``model``: ``dataclasses.replace(job, model=model)`` without its
    per-call cost (type tables copy every job once per type and round; JobInfo has no
    ``__post_init__`` to run, so a copy of its fields is the same object)."""
    if job.model is model:
        return job
    clone = object.__new__(JobInfo)
    clone.__dict__.update(job.__dict__)
    clone.__dict__["model"] = model
    return clone


def candidate_grants(codesign: bool, snapshot: ClusterSnapshot, rows: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Cache and IO each candidate (job ``rows[k]`` on ``counts[k]`` GPUs) is priced with
    (no cache, unlimited IO unless co-designing)."""
    n = len(snapshot.jobs)
    if not (codesign and co.is_active(snapshot)):
        return np.zeros(len(rows)), np.full(len(rows), np.inf)
    cache, _ = co.expected_grants(snapshot, [snapshot.jobs[r] for r in rows], gpus=counts)
    demand = io_demand(snapshot, snapshot.jobs)
    share = co.max_min_share([demand[job.job_id] for job in snapshot.jobs], [{}] * n, snapshot.storage_bandwidth_bytes_per_s, {})
    # A job that needs no IO at its requested size may need some at a larger one: give it the
    # share an unsatisfied job gets (at least), so its larger candidates are not priced at b = 0.
    unmet = [share[k] for k, job in enumerate(snapshot.jobs) if share[k] < demand[job.job_id] - 1e-9]
    level = max(unmet, default=snapshot.storage_bandwidth_bytes_per_s)
    return cache, np.maximum(share, level)[rows]
