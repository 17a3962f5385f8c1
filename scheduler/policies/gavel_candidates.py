"""gavel's candidates as arrays: each job's bounds and candidate counts (:func:`count_matrix`),
its candidates on each GPU type, priced and remembered per kind of job (:func:`priced_candidates`),
which candidates the LP needs (those on the upper concave hull of their (job, type) pair,
:func:`undominated`), which counts the storage budget allows (:func:`growth_allowed`), and codes
that group jobs alike so that work is done once per kind of job (:func:`row_classes`,
:func:`shapes`)."""

from __future__ import annotations

import numpy as np

from scheduler.policies.gavel_max_min import job_classes
from scheduler.policies.pollux_estimates import JobTable, row_codes


def bounds_of(jobs) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(min_gpus, max_gpus, requested)`` of every job."""
    bounds = np.array([(job.min_gpus, job.max_gpus, job.requested) for job in jobs], dtype=np.int64).reshape(-1, 3)
    return bounds[:, 0], bounds[:, 1], bounds[:, 2]


def count_matrix(low: np.ndarray, top: np.ndarray, asked: np.ndarray, capacity: int, elastic: bool,
                 max_gpus_per_job: int) -> np.ndarray:
    """Row ``k``: the candidate counts of the job with bounds ``low[k]..top[k]`` that asked for
    ``asked[k]`` GPUs, on ``capacity`` GPUs, ascending, 0-padded.

    A rigid job (or any job when not ``elastic``) has its requested count; an elastic job
    also its minimum, its maximum (capped by ``max_gpus_per_job`` and the capacity) and the
    powers of two strictly between them. None if its minimum exceeds the capacity.
    """
    high = np.minimum(np.maximum(np.minimum(top, max_gpus_per_job), low), capacity)
    requested = np.minimum(np.maximum(asked, low), high)
    elastic = (low != top) & elastic
    powers = 2 ** np.arange(max(int(high.max(initial=1)) - 1, 1).bit_length() + 1)
    options = np.concatenate([requested[:, None], np.stack([low, high], axis=1),
                              np.broadcast_to(powers, (low.size, powers.size))], axis=1)
    offered = np.ones(options.shape, dtype=bool)
    offered[:, 1:] = elastic[:, None]
    offered[:, 3:] &= (options[:, 3:] > low[:, None]) & (options[:, 3:] < high[:, None])
    offered[low > capacity] = False
    sentinel = np.iinfo(np.int64).max
    options = np.sort(np.where(offered, options, sentinel), axis=1)
    repeated = np.zeros(options.shape, dtype=bool)
    repeated[:, 1:] = options[:, 1:] == options[:, :-1]
    return np.where(repeated | (options == sentinel), 0, options)


def candidates(jobs, types: tuple[str, ...], type_capacity: np.ndarray, widest: int, elastic: bool, max_gpus_per_job: int):
    """``(job, gpus, type)`` of every candidate, by job, then type, then count: a count must fit
    its type's GPUs (type-blind: the largest type's, since a job still runs on one type) and
    the job must allow the type."""
    by_type = []
    bounds = bounds_of(jobs)
    constrained = [k for k, job in enumerate(jobs) if job.gpu_types]  # most jobs allow every type
    for t, gpu_type in enumerate(types):
        counts = count_matrix(*bounds, min(int(type_capacity[t]), widest), elastic, max_gpus_per_job)
        if gpu_type and constrained:
            counts[[k for k in constrained if not jobs[k].allows(gpu_type)]] = 0
        by_type.append(counts)
    width = max(counts.shape[1] for counts in by_type)  # types of different sizes offer different powers of two
    by_type = [np.pad(counts, ((0, 0), (0, width - counts.shape[1]))) for counts in by_type]
    stacked = np.stack(by_type, axis=1)  # job x type x option
    job, kind, _ = np.nonzero(stacked)
    return job.astype(np.int64), stacked[stacked > 0].astype(np.int64), kind.astype(np.int64)


# A kind of job's candidates and their throughputs (:func:`priced_candidates`): (gpus, types,
# throughputs, the models the key names by id, kept so their ids stay their own).
_KINDS: dict[tuple, tuple] = {}
_KINDS_KEPT = 20_000


def priced_candidates(jobs, types: tuple[str, ...], type_capacity: np.ndarray, widest: int, per_node: int,
                      elastic: bool, max_gpus_per_job: int, adapt_batch: bool):
    """``(job, gpus, type, throughput)`` of every candidate (:func:`candidates`, each priced on
    the fewest nodes, no cache, IO not limiting), and per job its kind (0, 1, ...). A job's
    candidates and their prices depend on its bounds, batch, allowed types and models only,
    which jobs of one kind share and keep for life: each kind is worked out once and remembered
    (the same numbers, row for row)."""
    context = (elastic, max_gpus_per_job, adapt_batch, types, type_capacity.tobytes(), widest, per_node)
    keys = [(context, j.min_gpus, j.max_gpus, j.requested, j.initial_batch_size, j.gpu_types, id(j.model),
             id(j.type_models) if j.type_models else 0) for j in jobs]
    missing = {key: k for k, key in zip(range(len(jobs) - 1, -1, -1), reversed(keys)) if key not in _KINDS}
    if missing:
        firsts = sorted(missing.values())
        reps = [jobs[k] for k in firsts]
        job, gpus, kind = candidates(reps, types, type_capacity, widest, elastic, max_gpus_per_job)
        throughput = np.zeros(0)
        if gpus.size:
            batch = 0 if adapt_batch else np.array([j.initial_batch_size for j in reps], dtype=np.int64)[job]
            pair, pair_of = np.unique(job * len(types) + kind, return_inverse=True)
            table = JobTable([reps[p // len(types)] for p in pair], gpu_types=[types[p % len(types)] for p in pair])
            throughput = table.predict(pair_of.ravel(), gpus, 0, per_node=per_node, batch_size=batch).goodput_samples_per_s
        counts = np.bincount(job, minlength=len(reps))
        ends = np.cumsum(counts)
        if len(_KINDS) > _KINDS_KEPT:
            _KINDS.clear()
        for r, (k, end, count) in enumerate(zip(firsts, ends.tolist(), counts.tolist())):
            begin = end - count
            _KINDS[keys[k]] = (gpus[begin:end], kind[begin:end], throughput[begin:end], (reps[r].model, reps[r].type_models))
    found, index = [], {}
    shape = np.empty(len(jobs), dtype=np.int64)
    for k, key in enumerate(keys):
        found.append(_KINDS[key])
        shape[k] = index.setdefault(key, len(index))
    sizes = np.array([f[0].size for f in found], dtype=np.int64)
    if not sizes.sum():
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty, np.zeros(0), shape
    return (np.repeat(np.arange(len(jobs), dtype=np.int64), sizes), np.concatenate([f[0] for f in found]),
            np.concatenate([f[1] for f in found]), np.concatenate([f[2] for f in found]), shape)


def by_job(candidates: np.ndarray, job: np.ndarray, n_jobs: int) -> list[list[int]]:
    """Per job: its entries of ``candidates`` (ordered by job, then as the caller wants them)."""
    ends = np.cumsum(np.bincount(job[candidates], minlength=n_jobs)).tolist()
    flat = candidates.tolist()
    return [flat[begin:end] for begin, end in zip([0] + ends[:-1], ends)]


def growth_allowed(job: np.ndarray, gpus: np.ndarray, io: np.ndarray, jobs, budget: float) -> np.ndarray:
    """All candidates while the storage budget has slack; only counts up to each job's
    requested one once the jobs' IO demands at their requested counts exceed it.

    The LP prices every candidate with the whole budget, so when storage is the bottleneck a
    larger count looks faster than it can be once the budget is shared. Offered anyway, the
    max-min solution moved jobs between counts (and so nodes and caches) round after round:
    on the storage-bound Philly scenario (docs/evaluation.md) gavel with co-design restarted
    each job hundreds of times and ran 2.9x slower than without co-design; offering growth
    only to jobs whose demand fits an equal share of the budget still churned (2,729
    restarts, 58,798 s), without growth it ran 31,598 s. When storage is not the bottleneck
    the extra GPUs can be fed and elastic Gavel is unchanged.
    """
    requested = np.array([max(j.requested, j.min_gpus) for j in jobs], dtype=np.int64)
    at_request = gpus == requested[job]
    if float(io[at_request].sum()) <= budget:
        return np.ones(job.size, dtype=bool)
    return gpus <= requested[job]


def row_classes(columns: list[np.ndarray]) -> np.ndarray:
    """Per row of the parallel per-job ``columns``: a code (0, 1, ...), equal exactly for equal rows."""
    _, code = np.unique(row_codes(columns), return_inverse=True)
    return code.ravel()


def shapes(group: np.ndarray, job: np.ndarray, gpus: np.ndarray, kind: np.ndarray, rate: np.ndarray,
            n_jobs: int) -> np.ndarray:
    """Per job: a code, equal for jobs with the same candidates and rates (:func:`scheduler.policies.gavel_max_min.job_classes`, by
    value), worked out on one job of each ``group`` (jobs of a group are alike: one kind of job)."""
    _, first, of_job = np.unique(group, return_index=True, return_inverse=True)
    index = np.full(n_jobs, -1, dtype=np.int64)
    index[first] = np.arange(first.size)
    mine = index[job] >= 0
    codes = job_classes(index[job[mine]], gpus[mine], kind[mine], rate[mine], np.zeros(first.size), None, first.size)
    return np.asarray(codes)[of_job.ravel()]


def count_distinct(columns: list[np.ndarray]) -> int:
    return int(np.unique(row_codes(columns)).size)


def undominated_by(group: np.ndarray, job: np.ndarray, kind: np.ndarray, gpus: np.ndarray, values: np.ndarray,
                    n_types: int) -> np.ndarray:
    """:func:`undominated` over every ``(job, type)`` pair's ``(gpus, values)``, worked out for one job
    of each ``group`` (per job; jobs of a group have the same candidates and values, in the same
    order) and copied to the others: the same answer, row for row."""
    n_jobs = group.size
    _, first, rep_of = np.unique(group, return_index=True, return_inverse=True)
    representative = first[rep_of.ravel()]
    counts = np.bincount(job, minlength=n_jobs)
    start = np.cumsum(counts) - counts
    ordered = job.size < 2 or bool(np.all(job[1:] >= job[:-1]))
    order = np.arange(job.size) if ordered else np.argsort(job, kind="stable")
    position = np.empty(job.size, dtype=np.int64)
    position[order] = np.arange(job.size) - start[job[order]]
    mine = np.flatnonzero(representative[job] == job)
    pair_code = job[mine] * n_types + kind[mine]
    if ordered and np.all(np.diff(kind[mine])[np.diff(job[mine]) == 0] >= 0):  # by job, then type: no sort
        fresh = np.ones(mine.size, dtype=bool)
        fresh[1:] = pair_code[1:] != pair_code[:-1]
        pair_of = np.cumsum(fresh) - 1
    else:
        _, pair_of = np.unique(pair_code, return_inverse=True)
        pair_of = pair_of.ravel()
    kept = np.zeros(job.size, dtype=bool)
    kept[mine] = undominated(pair_of, gpus[mine], values[mine], int(pair_of.max(initial=-1)) + 1)
    return kept[order[start[representative[job]] + position]]


def undominated(pair: np.ndarray, gpus: np.ndarray, normalized: np.ndarray, n_pairs: int) -> np.ndarray:
    """Candidates on their (job, type) pair's upper concave hull of ``(gpus, normalized)`` from ``(0, 0)``.

    Any other candidate is matched or beaten, in the same time and with no more GPUs, by
    mixing two hull candidates (or a hull candidate and idling), so the LP never needs it.
    The hull is walked for every pair at once on a pair x candidate table (a few columns).
    """
    order = np.lexsort((gpus, pair))
    counts = np.bincount(pair, minlength=n_pairs)
    start = np.cumsum(counts) - counts
    column = np.empty(pair.size, dtype=np.int64)
    column[order] = np.arange(pair.size) - start[pair[order]] + 1
    width = int(counts.max(initial=0)) + 1
    x = np.full((n_pairs, width), np.inf)
    y = np.full((n_pairs, width), -np.inf)
    x[:, 0] = y[:, 0] = 0.0  # the origin: idling
    x[pair, column] = gpus
    y[pair, column] = normalized
    on_hull = np.zeros((n_pairs, width), dtype=bool)
    at = np.zeros(n_pairs, dtype=np.int64)
    rows = np.arange(n_pairs)
    later = np.arange(width)[None, :]
    with np.errstate(invalid="ignore", divide="ignore"):
        while rows.size:
            here = at[rows]
            slope = (y[rows] - y[rows, here][:, None]) / (x[rows] - x[rows, here][:, None])
            slope = np.where((later > here[:, None]) & np.isfinite(slope), slope, -np.inf)
            end = width - 1 - np.argmax(slope[:, ::-1], axis=1)  # the farthest among equal slopes
            rises = slope[np.arange(rows.size), end] > 0
            rows, end = rows[rises], end[rises]
            on_hull[rows, end] = True
            at[rows] = end
    return on_hull[pair, column]
