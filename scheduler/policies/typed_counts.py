"""Choosing a GPU type *and* a count per job for the count-search policies (pollux, deepboot).

Those policies maximize a sum of per-job utilities ``u_j(g)`` over GPU counts under one
capacity. With several GPU types each job runs on one type (:mod:`scheduler.placement`), so
the problem becomes: pick a type ``t_j`` per job and counts with ``sum_{j on t} g_j <= G_t``
for every type, maximizing ``sum_j u_{j,t_j}(g_j)``. The utilities are the policy's own,
priced per type with the job's model on that type and a speedup base common to all types
(one GPU of the reference type), so a job is worth more where it runs faster.

The search is a price (dual decomposition) heuristic, Sia's "who benefits most from which
type" without an ILP solver:

1. every job starts on its current type if it runs, else the type where its utility at its
   requested count is highest;
2. each type's jobs get counts from the policy's own single-capacity solver;
3. each type gets a *price* per GPU: 0 if GPUs are left over, else the best gain per GPU a
   job of the type was denied (the clearing bid);
4. a job's value on a type is ``max_g u(g) - price x g``; jobs that gain by moving move,
   the better half of them each iteration (moving every job at once oscillates);
5. repeat a few times and keep the assignment with the best total utility.

It costs ``types`` solves per iteration (4 iterations by default) instead of one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

Solver = Callable[[np.ndarray, int], np.ndarray]


def assign_types(
    utilities: Sequence[np.ndarray],
    capacities: Sequence[int],
    solve: Solver,
    start: np.ndarray,
    iterations: int = 4,
) -> tuple[np.ndarray, np.ndarray]:
    """``(type index, count)`` per job maximizing the summed utility (see the module docstring).

    ``utilities[t][j, g]``: job j's utility with g GPUs of type t (-inf where not allowed;
    column 0 finite); ``capacities[t]``: GPUs of type t; ``solve(utility_rows, capacity)``:
    the policy's count solver for one type; ``start``: the initial type of each job.
    """
    n = start.size
    if n == 0:
        return start.copy(), np.zeros(0, dtype=np.int64)
    rows = np.arange(n)

    solved: dict[tuple[int, bytes], np.ndarray] = {}  # (type, its jobs) -> their counts: movers change few types

    def solve_all(assign: np.ndarray) -> tuple[np.ndarray, float]:
        counts = np.zeros(n, dtype=np.int64)
        for t, utility in enumerate(utilities):
            mine = np.flatnonzero(assign == t)
            if mine.size:
                key = (t, mine.tobytes())
                if key not in solved:
                    solved[key] = solve(utility[mine], int(capacities[t]))
                counts[mine] = solved[key]
        return counts, _total(utilities, assign, counts)

    assign = start.copy()
    counts, total = solve_all(assign)
    best = (assign, counts, total)
    for _ in range(iterations):
        prices = [_price(utilities[t][assign == t], counts[assign == t], int(capacities[t])) for t in range(len(utilities))]
        value = np.stack([_value(u, p) for u, p in zip(utilities, prices)], axis=1)  # n x T
        here = value[rows, assign]
        target = np.argmax(value, axis=1)
        gain = value[rows, target] - here
        movers = np.flatnonzero(gain > 1e-12 * (1.0 + np.abs(here)))
        if movers.size == 0:
            break
        movers = movers[np.argsort(-gain[movers], kind="stable")][: max(1, (movers.size + 1) // 2)]
        assign = assign.copy()
        assign[movers] = target[movers]
        counts, total = solve_all(assign)
        if total > best[2]:
            best = (assign, counts, total)
    return best[0], best[1]


def best_start(utilities: Sequence[np.ndarray], requested: np.ndarray, current: np.ndarray) -> np.ndarray:
    """Per job: its current type (``current >= 0``), else the type with the highest utility at
    its requested count (or the largest allowed count below it)."""
    scores = []
    for utility in utilities:
        width = utility.shape[1]
        upto = np.minimum(requested, width - 1)
        capped = np.where(np.arange(width)[None, :] <= upto[:, None], utility, -np.inf)
        scores.append(capped.max(axis=1))
    start = np.argmax(np.stack(scores, axis=1), axis=1)
    return np.where(current >= 0, current, start)


def _total(utilities: Sequence[np.ndarray], assign: np.ndarray, counts: np.ndarray) -> float:
    total = 0.0
    for t, utility in enumerate(utilities):
        mine = np.flatnonzero(assign == t)
        if mine.size:
            total += float(utility[mine, np.minimum(counts[mine], utility.shape[1] - 1)].sum())
    return total


def _price(utility: np.ndarray, counts: np.ndarray, capacity: int) -> float:
    """Gain per GPU at the margin of one type: 0 with GPUs to spare, else the best denied bid."""
    if utility.shape[0] == 0 or int(counts.sum()) < capacity:
        return 0.0
    width = utility.shape[1]
    g = np.arange(width)[None, :]
    now = utility[np.arange(utility.shape[0]), counts][:, None]
    with np.errstate(invalid="ignore", divide="ignore"):
        slope = np.where((g > counts[:, None]) & np.isfinite(utility), (utility - now) / (g - counts[:, None]), -np.inf)
    bid = float(slope.max(initial=-np.inf))
    return max(bid, 0.0) if np.isfinite(bid) else 0.0


def _value(utility: np.ndarray, price: float) -> np.ndarray:
    """Per job: ``max_g u(g) - price x g`` (what the job is worth on the type at that price)."""
    g = np.arange(utility.shape[1])[None, :]
    return np.where(np.isfinite(utility), utility - price * g, -np.inf).max(axis=1)
