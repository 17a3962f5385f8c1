"""Pollux's count search: the GPU count of each job that maximizes the summed utility
``sum_j utility[j, g_j]`` within a capacity (:func:`solve_counts`). The exact group-knapsack
DP, over only the counts a Lagrangian bound leaves when they are few, or the upper-hull greedy
with local search on large clusters (the module docstring of :mod:`scheduler.policies.pollux`
says when each runs)."""

from __future__ import annotations

import numpy as np

# Local search moves at most this many GPUs between two jobs at once.
_MAX_STEP = 16
# Improvements below this (relative to the total utility scale) end the local search.
_TOLERANCE = 1e-12


def solve_counts(utility: np.ndarray, capacity: int, solver: str = "auto", dp_limit: int = 5_000_000,
                 moves: int = 200) -> np.ndarray:
    """Counts maximizing ``sum_j utility[j, g_j]`` with ``sum g <= capacity``: the exact DP when
    ``jobs x (capacity + 1) x width`` is within ``dp_limit`` (``solver="auto"``), else the hull
    greedy and local search."""
    n, width = utility.shape
    if n == 0 or capacity == 0 or width == 1:
        return np.zeros(n, dtype=np.int64)
    wanted = np.argmax(utility, axis=1)  # each job's best count, the fewest GPUs among equals
    if int(wanted.sum()) <= capacity:
        return wanted.astype(np.int64)  # room for every job's best: that is the optimum
    if solver == "auto":
        solver = "dp" if n * (capacity + 1) * width <= dp_limit else "greedy"
    if solver == "dp":
        return solve_dp(utility, capacity)
    return local_search(utility, capacity, _solve_hull_greedy(utility, capacity), moves)


def solve_dp(utility: np.ndarray, capacity: int) -> np.ndarray:
    """Exact: maximize ``sum_j utility[j, g_j]`` subject to ``sum_j g_j <= capacity`` (group knapsack).

    Counts that no optimal answer can use are dropped first (:func:`_lagrangian_candidates`);
    when that leaves few per job, the DP runs over those only (:func:`_solve_sparse_dp`), else
    over every count (:func:`_solve_dense_dp`). Both return what the DP over every count
    returns: among equal totals, the same answer (tested against a brute-force DP).
    """
    candidates = _lagrangian_candidates(utility, capacity)
    if candidates is not None:
        return _solve_sparse_dp(utility, capacity, *candidates)
    return _solve_dense_dp(utility, capacity)


# The sparse DP pays off while the counts left per job are few (the 5,000-job typed simulation:
# ~6 of ~55 on average); past this many per job the dense DP is cheaper.
_SPARSE_PER_JOB = 16


def _lagrangian_candidates(utility: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray] | None:
    """``(job, count)`` pairs that some optimal answer may use (sorted by job, then count), or
    None when too many are left for the sparse DP to pay.

    Lagrangian bound: for a price ``lam >= 0`` per GPU, ``UB = sum_j m_j + lam * capacity`` with
    ``m_j = max_g utility[j, g] - lam * g`` bounds every feasible total from above, and any
    feasible answer's total ``LB`` from below. An optimal answer ``x`` has
    ``sum_j (m_j - utility[j, x_j] + lam * x_j) <= UB - sum_j utility[j, x_j] <= UB - LB`` with
    every term non-negative, so a count whose slack ``m_j - utility[j, g] + lam * g`` exceeds
    ``UB - LB`` is in no optimal answer. ``lam`` is found by bisection on the GPUs the jobs want
    at that price (the dual's minimum is where that demand crosses ``capacity``); ``LB`` is the
    answer at the price just above it, its spare GPUs given to the jobs that want more just
    below it (best gain per GPU first).
    """
    n, width = utility.shape
    g = np.arange(width, dtype=np.float64)

    def demand(lam: float) -> np.ndarray:
        return np.argmax(utility - lam * g, axis=1)

    low, high = 0.0, 1.0
    for _ in range(64):  # raise the price until the demand fits
        if int(demand(high).sum()) <= capacity:
            break
        low, high = high, high * 16.0
    else:
        return None
    if low == 0.0:  # lower it until it does not (or to 0, where everything wanted fits)
        low = high
        while low > 1e-12 and int(demand(low).sum()) <= capacity:
            high, low = low, low / 16.0
        if int(demand(low).sum()) <= capacity:
            high = low = 0.0
    if high > 0.0:
        down, up = np.log(low), np.log(high)
        for _ in range(12):
            middle = 0.5 * (down + up)
            if int(demand(float(np.exp(middle))).sum()) > capacity:
                down = middle
            else:
                up = middle
        low, high = float(np.exp(down)), float(np.exp(up))
    counts = demand(high)
    more = demand(low)
    spare = capacity - int(counts.sum())
    wanting = np.flatnonzero(more > counts)
    if spare > 0 and wanting.size:
        gain = (utility[wanting, more[wanting]] - utility[wanting, counts[wanting]]) / (more[wanting] - counts[wanting])
        for j in wanting[np.argsort(-gain, kind="stable")].tolist():
            need = int(more[j] - counts[j])
            if need <= spare:
                counts[j] = more[j]
                spare -= need
    lower = float(utility[np.arange(n), counts].sum())
    reduced = utility - high * g
    best = reduced.max(axis=1)
    upper = float(best.sum()) + high * capacity
    # Slack for rounding: totals are sums of n terms of the utilities' magnitude.
    alive = (best[:, None] - reduced) <= (upper - lower) + 1e-9 * (abs(upper) + abs(lower) + 1.0)
    job, count = np.nonzero(alive)
    if job.size > _SPARSE_PER_JOB * n:
        return None
    return job, count


def _solve_sparse_dp(utility: np.ndarray, capacity: int, job: np.ndarray, count: np.ndarray) -> np.ndarray:
    """The DP of :func:`solve_dp` over the counts ``(job, count)`` only: per job, the best total
    with at most ``c`` GPUs for every ``c``, the smallest count among equals."""
    n, width = utility.shape
    padded = np.full(width + capacity + 1, -np.inf)  # padded[width + c]: best total over the jobs so far with <= c GPUs
    padded[width:] = 0.0
    # Row ``width - k`` of the windows is ``best[c - k]`` for every c (-inf for k > c).
    windows = np.lib.stride_tricks.sliding_window_view(padded, capacity + 1)
    choice = np.zeros((n, capacity + 1), dtype=np.int16 if width < 2**15 else np.int32)
    columns = np.arange(capacity + 1)
    starts = np.searchsorted(job, np.arange(n + 1)).tolist()
    for j in range(n):
        mine = count[starts[j]:starts[j + 1]]  # never empty: a job's best count has no slack
        options = windows[width - mine] + utility[j, mine][:, None]
        if mine.size == 1:
            padded[width:] = options[0]
            choice[j] = mine[0]
        else:
            pick = np.argmax(options, axis=0)  # the smallest count among equals (counts ascend)
            padded[width:] = options[pick, columns]
            choice[j] = mine[pick]
    return _walk_back(choice, capacity)


def _walk_back(choice: np.ndarray, capacity: int) -> np.ndarray:
    """The counts a DP's ``choice[j, c]`` table (job j's count with at most c GPUs for jobs
    0..j) picks, walked back from the last job at the full capacity."""
    counts = np.zeros(choice.shape[0], dtype=np.int64)
    c = capacity
    for j in range(choice.shape[0] - 1, -1, -1):
        counts[j] = choice[j, c]
        c -= counts[j]
    return counts


def _solve_dense_dp(utility: np.ndarray, capacity: int) -> np.ndarray:
    """:func:`solve_dp` over every count of every job."""
    n, width = utility.shape
    # A count no better than some smaller count of its job is never chosen (the table ``best``
    # never falls with more GPUs and ties go to the smaller count): drop the columns past the
    # last count that beats every smaller one, of any job. The answer is the same.
    rises = utility[:, 1:] > np.maximum.accumulate(utility, axis=1)[:, :-1]
    last = np.where(rises.any(axis=1), width - 1 - np.argmax(rises[:, ::-1], axis=1), 0)  # per job
    own = np.minimum(last + 1, capacity + 1).tolist()  # each job's columns worth reading
    width = min(width, capacity + 1, max(own))
    utility = utility[:, :width]
    # value[c] of the new row = max_k best[c - k] + utility[j, k]; ``before[c, k]`` is
    # ``best[c - k]`` (-inf for k > c), a strided view of ``padded`` (no copy).
    padded = np.full(capacity + width, -np.inf)
    best = padded[width - 1:]  # best total using at most c GPUs over the jobs so far
    best[:] = 0.0
    before = np.lib.stride_tricks.sliding_window_view(padded, width)[:, ::-1]
    columns = np.arange(capacity + 1)
    choice = np.zeros((n, capacity + 1), dtype=np.int16 if width < 2**15 else np.int32)
    # Rows of job j worth computing: from ``floor[j]`` (the answer's capacity minus what the
    # later jobs can take: the walk back from ``capacity`` never goes lower, and job j + 1 reads
    # no row below it) up to ``reach`` (what the jobs so far can use: past it ``best`` is flat,
    # so those rows repeat row ``reach``). Rows outside keep stale values nobody reads.
    later = np.cumsum(np.array(own[::-1], dtype=np.int64) - 1)[::-1]  # jobs j.. together
    floor = np.maximum(0, capacity - (later - (np.array(own, dtype=np.int64) - 1))).tolist()
    reach = 0
    for j in range(n):
        reach = min(capacity, reach + own[j] - 1)
        low = min(floor[j], reach)
        options = before[low:reach + 1, :own[j]] + utility[j, :own[j]]
        pick = np.argmax(options, axis=1)  # the smallest count among equals
        choice[j, low:reach + 1] = pick
        best[low:reach + 1] = options[columns[:reach + 1 - low], pick]
        if reach < capacity:
            choice[j, reach + 1:] = pick[-1]
            best[reach + 1:] = best[reach]
    return _walk_back(choice, capacity)


def upper_hull_segments(utility: np.ndarray):
    """Edges of each job's upper concave hull of ``(g, utility[j, g])`` from g = 0, with rising utility.

    Returns arrays ``(job, start, end, slope)``; per job the slopes decrease.
    """
    n, width = utility.shape
    columns = np.arange(width)
    at = np.zeros(n, dtype=np.int64)
    active = np.isfinite(utility[:, 0])
    parts = []
    with np.errstate(invalid="ignore"):
        while active.any():
            rows = np.flatnonzero(active)
            step = columns[None, :] - at[rows, None]
            slope = (utility[rows] - utility[rows, at[rows]][:, None]) / np.where(step > 0, step, 1)
            slope = np.where((step > 0) & np.isfinite(slope), slope, -np.inf)
            # Farthest point among equal slopes: fewer, longer segments.
            end = width - 1 - np.argmax(slope[:, ::-1], axis=1)
            rise = slope[np.arange(rows.size), end]
            good = rise > 0
            parts.append((rows[good], at[rows[good]], end[good], rise[good]))
            at[rows[good]] = end[good]
            active[rows[~good]] = False
    if not parts:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty, np.zeros(0)
    return tuple(np.concatenate(field) for field in zip(*parts))


def _solve_hull_greedy(utility: np.ndarray, capacity: int) -> np.ndarray:
    """Take hull segments in decreasing gain per GPU while they fit."""
    n = utility.shape[0]
    job, start, end, slope = upper_hull_segments(utility)
    counts = np.zeros(n, dtype=np.int64)
    blocked = np.zeros(n, dtype=bool)
    free = capacity
    for k in np.lexsort((job, -slope)):  # by slope, then job order
        j = job[k]
        if blocked[j] or counts[j] != start[k]:
            continue
        need = end[k] - start[k]
        if need <= free:
            counts[j] = end[k]
            free -= need
        else:
            blocked[j] = True  # its later segments start where this one ends
        if free == 0:
            break
    return counts


def local_search(utility: np.ndarray, capacity: int, counts: np.ndarray, moves: int) -> np.ndarray:
    """Improve ``counts``: spend spare GPUs, or move GPUs from the cheapest donor to the best receiver."""
    n, width = utility.shape
    counts = counts.copy()
    # best_upto[j, c] = best utility with at most c GPUs, reached at best_at[j, c] GPUs.
    best_upto = np.maximum.accumulate(utility, axis=1)
    best_at = np.zeros((n, width), dtype=np.int64)
    improved = utility >= best_upto
    best_at[improved] = np.broadcast_to(np.arange(width), (n, width))[improved]
    best_at = np.maximum.accumulate(best_at, axis=1)
    scale = float(np.sum(np.abs(utility[np.arange(n), counts]))) or 1.0
    rows = np.arange(n)
    steps = np.arange(1, min(width, _MAX_STEP + 1))  # larger moves are the hull greedy's business
    for _ in range(moves):
        free = capacity - int(counts.sum())
        now = utility[rows, counts]
        # Receivers may use the spare GPUs plus `step` given up by a donor.
        up_at = np.minimum(counts[:, None] + steps[None, :] + free, width - 1)
        gain = best_upto[rows[:, None], up_at] - now[:, None]
        if free > 0:
            spend = best_upto[rows, np.minimum(counts + free, width - 1)] - now
            j = int(np.argmax(spend))
            if spend[j] > _TOLERANCE * scale:
                counts[j] = best_at[j, min(counts[j] + free, width - 1)]
                continue
        down_at = counts[:, None] - steps[None, :]
        loss = np.where(down_at >= 0, now[:, None] - best_upto[rows[:, None], np.maximum(down_at, 0)], np.inf)
        # Best receiver and donor per step size, with runners-up for when they are the same job.
        cols = np.arange(steps.size)
        r1, d1 = np.argmax(gain, axis=0), np.argmin(loss, axis=0)
        if n > 1:
            g1, l1 = gain[r1, cols], loss[d1, cols]
            gain[r1, cols], loss[d1, cols] = -np.inf, np.inf
            r2, d2 = np.argmax(gain, axis=0), np.argmin(loss, axis=0)
            gain[r1, cols], loss[d1, cols] = g1, l1
        else:
            r2, d2 = r1, d1
        same = r1 == d1
        alt_a = gain[r1, cols] - loss[d2, cols]
        alt_b = gain[r2, cols] - loss[d1, cols]
        value = np.where(same, np.maximum(alt_a, alt_b), gain[r1, cols] - loss[d1, cols])
        receiver = np.where(same & (alt_b > alt_a), r2, r1)
        donor = np.where(same & ~(alt_b > alt_a), d2, d1)
        value = np.where(receiver == donor, -np.inf, value)
        s = int(np.argmax(value))
        if not value[s] > _TOLERANCE * scale:
            break
        r, d = int(receiver[s]), int(donor[s])
        counts[d] = best_at[d, counts[d] - steps[s]]
        counts[r] = best_at[r, min(counts[r] + steps[s] + free, width - 1)]
    return counts
