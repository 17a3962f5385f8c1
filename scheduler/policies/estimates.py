"""Shared helpers for policies: GPU-only time estimates and rigid (gang) admission.

Estimates (what sjf, tiresias and themis rank jobs by):

- A job's *progress rate* is its goodput — efficiency-weighted samples/s, the unit of
  ``JobInfo.samples_done`` / ``target_samples`` — predicted by :func:`estimator.predict.predict`
  for ``gpus`` GPUs at the job's own batch size (``JobInfo.initial_batch_size``), with no
  cache and unlimited remote IO (``remote_io_bytes_per_s = inf``): GPU-only scheduling. The
  cache/IO-aware variants come later and will pass real grants here.
- Node count: a job that runs in place keeps its current node count; anything else is
  assumed packed, ``ceil(gpus / gpus_per_node)`` with ``gpus_per_node`` the largest
  training node of the snapshot (clusters are homogeneous in practice).
- *Remaining time* = ``remaining_samples / goodput`` seconds: 0 when nothing remains,
  ``inf`` when the predicted goodput is 0 (or the job gets no GPUs).

With ``codesign=True`` (SiloD, :mod:`scheduler.codesign`) and a snapshot that has cache or a
finite storage budget, the goodput is the estimator's ``T(g, c, b)`` at the grants
:func:`scheduler.codesign.expected_grants` gives the job, and :func:`rigid_plan` grants cache
and IO with the GPUs, passing over jobs the IO grants would starve.

All predictions of a round are one vectorized :func:`~estimator.predict.predict` call;
job models shared by many jobs (every job of an application starts from the same cached
profile model) are evaluated once.

Admission (what rigid policies do with their order): :func:`admit_in_order` walks jobs in
priority order and gives each its whole ``job.requested`` count if that many training GPUs
are still unclaimed, else nothing (gang scheduling; later, smaller jobs may still fit —
backfilling). :func:`rigid_plan` turns the admitted counts into GPU indices with
:func:`scheduler.placement.place`, which keeps running jobs on their GPUs. Because every
placement may span nodes, a set of counts that fits the pool's total always places.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from estimator.predict import ModelTable, predict
from scheduler import codesign as co
from scheduler.placement import TypeRoom, place, plan_from_placements, type_preferences
from scheduler.policies.pollux_estimates import goodput_on_nodes, shared_model_table
from scheduler.policy import ClusterSnapshot, JobInfo, Plan, Pool

TRAINING: tuple[Pool, ...] = ("training",)


def pool_gpus(snapshot: ClusterSnapshot, pools: Iterable[Pool] = TRAINING) -> int:
    """GPUs on the nodes of ``pools`` (what GPU-only policies may hand out)."""
    allowed = set(pools)
    return sum(node.gpus for node in snapshot.nodes if node.pool in allowed)


def gpus_per_node(snapshot: ClusterSnapshot, pools: Iterable[Pool] = TRAINING) -> int:
    """GPUs of the largest node of ``pools`` (at least 1): the packing unit of estimates."""
    allowed = set(pools)
    return max([node.gpus for node in snapshot.nodes if node.pool in allowed] + [1])


def in_place(
    snapshot: ClusterSnapshot,
    jobs: Sequence[JobInfo],
    gpus: Sequence[int] | np.ndarray | None = None,
    pools: Iterable[Pool] = TRAINING,
) -> np.ndarray:
    """Per job: does it hold exactly ``gpus[k]`` (default ``job.requested``) GPUs that still exist in ``pools``?

    Such a job keeps running without a restart if a policy gives it that count again.
    """
    exists = _placement_exists(snapshot, tuple(pools))
    current = snapshot.current.allocations
    result = np.zeros(len(jobs), dtype=bool)
    for k, job in enumerate(jobs):
        allocation = current.get(job.job_id)
        if allocation is None:
            continue
        want = job.requested if gpus is None else int(gpus[k])
        if want <= 0 or allocation.gpus != want:
            continue
        result[k] = exists(allocation.placement)
    return result


def _placement_exists(snapshot: ClusterSnapshot, pools: tuple[Pool, ...]):
    """``exists(placement)``: are all of its GPUs on nodes of ``pools``? Remembered per placement
    for the snapshot's node tuple (placements repeat round after round)."""
    key = (id(snapshot.nodes), pools)
    found = _EXISTS.get(key)
    if found is None or found[0] is not snapshot.nodes:
        allowed = set(pools)
        sizes = {node.name: node.gpus for node in snapshot.nodes if node.pool in allowed}
        if len(_EXISTS) >= 8:
            _EXISTS.clear()
        found = _EXISTS[key] = (snapshot.nodes, sizes, {})  # holds the tuple: its id stays its own
    _, sizes, known = found

    def exists(placement) -> bool:
        answer = known.get(placement)
        if answer is None:
            answer = all(name in sizes and all(0 <= i < sizes[name] for i in indices) for name, indices in placement)
            if len(known) < 200_000:
                known[placement] = answer
        return answer

    return exists


_EXISTS: dict[tuple[int, tuple], tuple[tuple, dict[str, int], dict]] = {}


def _table(jobs: Sequence[JobInfo]) -> tuple[ModelTable, np.ndarray]:
    """A model table with one row per distinct model object, and each job's row."""
    rows: dict[int, int] = {}
    models = []
    index = np.empty(len(jobs), dtype=np.int64)
    for k, job in enumerate(jobs):
        row = rows.get(id(job.model))
        if row is None:
            row = rows[id(job.model)] = len(models)
            models.append(job.model)
        index[k] = row
    return shared_model_table(models), index


def current_nodes(
    snapshot: ClusterSnapshot,
    jobs: Sequence[JobInfo],
    gpus: Sequence[int] | np.ndarray | None = None,
    pools: Iterable[Pool] = TRAINING,
) -> np.ndarray:
    """Per job: the number of nodes it runs on if it runs in place on ``gpus[k]`` GPUs (see :func:`in_place`), else 0 (= packed)."""
    nodes = np.zeros(len(jobs), dtype=np.int64)
    for k in np.flatnonzero(in_place(snapshot, jobs, gpus, pools)):
        placement = snapshot.current.allocations[jobs[k].job_id].placement
        nodes[k] = sum(1 for _, indices in placement if indices)
    return nodes


def goodput(
    snapshot: ClusterSnapshot,
    jobs: Sequence[JobInfo],
    gpus: Sequence[int] | np.ndarray | None = None,
    *,
    nodes: Sequence[int] | np.ndarray | None = None,
    pools: Iterable[Pool] = TRAINING,
    codesign: bool = False,
) -> np.ndarray:
    """Predicted goodput (efficiency-weighted samples/s) of each job on ``gpus[k]`` GPUs (default: its requested count).

    Batch size: the job's own; no cache, unlimited remote IO; 0 for 0 GPUs. Nodes:
    ``nodes[k]`` (0 = packed) when given, else :func:`current_nodes` (a job running in place
    keeps its node count, anything else is packed). ``jobs`` may repeat a job to evaluate
    several candidates in the one :func:`~estimator.predict.predict` call.
    """
    if not jobs:
        return np.zeros(0)
    pools = tuple(pools)
    counts = np.array([job.requested for job in jobs] if gpus is None else gpus, dtype=np.int64)
    if counts.shape != (len(jobs),):
        raise ValueError("need one GPU count per job")
    spans = current_nodes(snapshot, jobs, counts, pools) if nodes is None else np.asarray(nodes, dtype=np.int64)
    batch = np.array([job.initial_batch_size for job in jobs], dtype=np.int64)
    if not (codesign and co.is_active(snapshot)):  # GPU-only: the same questions every round, remembered
        return goodput_on_nodes([job.model for job in jobs], counts, spans, batch, per_node=gpus_per_node(snapshot, pools))
    table, index = _table(jobs)
    cache, io = co.expected_grants(snapshot, jobs, gpus=counts)
    predictions = predict(
        table, index, counts, spans, cache, io, batch, gpus_per_node=gpus_per_node(snapshot, pools)
    )
    return predictions.goodput_samples_per_s


def remaining_time_s(
    snapshot: ClusterSnapshot,
    jobs: Sequence[JobInfo],
    gpus: Sequence[int] | np.ndarray | None = None,
    *,
    nodes: Sequence[int] | np.ndarray | None = None,
    pools: Iterable[Pool] = TRAINING,
    codesign: bool = False,
) -> np.ndarray:
    """Seconds each job still needs on ``gpus[k]`` GPUs (default: requested): ``remaining_samples / goodput``.

    0 when nothing remains, ``inf`` when the goodput is 0. ``nodes``: as :func:`goodput`'s.
    """
    return remaining_time(jobs, goodput(snapshot, jobs, gpus, nodes=nodes, pools=pools, codesign=codesign))


def remaining_time(jobs: Sequence[JobInfo], rate: np.ndarray) -> np.ndarray:
    """Seconds each job still needs at ``rate`` goodput (0 when nothing remains, inf at rate 0)."""
    remaining = np.array([job.remaining_samples for job in jobs], dtype=np.float64)
    return _divide(remaining, rate)


def _divide(work: np.ndarray, rate: np.ndarray) -> np.ndarray:
    """``work / rate`` with 0 for no work and inf for work at rate 0."""
    with np.errstate(all="ignore"):
        time = np.where(rate > 0, work / np.where(rate > 0, rate, 1.0), np.inf)
    return np.where(work > 0, time, 0.0)


def isolated_time_s(jobs: Sequence[JobInfo], rate: np.ndarray) -> np.ndarray:
    """Seconds each whole job (``target_samples``) takes at ``rate`` goodput: its dedicated running time."""
    target = np.array([job.target_samples for job in jobs], dtype=np.float64)
    return _divide(target, rate)


def admit_in_order(
    snapshot: ClusterSnapshot,
    order: Sequence[JobInfo],
    *,
    pools: Iterable[Pool] = TRAINING,
    capacity: int | None = None,
) -> dict[str, int]:
    """Gang admission: each job in ``order`` gets ``job.requested`` GPUs if that many are unclaimed, else none.

    Jobs that do not fit are skipped, so later (smaller) jobs may use the room (backfill).
    ``capacity`` defaults to the GPUs of ``pools``.
    """
    return {job_id: count for job_id, (count, _) in admit_typed(snapshot, order, pools=pools, capacity=capacity).items()}


def admit_typed(
    snapshot: ClusterSnapshot,
    order: Sequence[JobInfo],
    *,
    pools: Iterable[Pool] = TRAINING,
    capacity: int | None = None,
) -> dict[str, tuple[int, str]]:
    """:func:`admit_in_order` with each admitted job's GPU type: job id -> (count, type).

    A job is admitted on the first type of its :func:`scheduler.placement.type_preferences`
    (its current type if it runs, else the type it is fastest on) with room for its whole count.
    """
    pools = tuple(pools)
    room = TypeRoom(snapshot, pools, capacity)
    preferences = type_preferences(snapshot, {job.job_id: job.requested for job in order}, pools)
    admitted: dict[str, tuple[int, str]] = {}
    for job in order:
        want = job.requested
        if job.job_id in admitted or want <= 0:
            continue
        gpu_type = room.claim(want, preferences.get(job.job_id, ()))
        if gpu_type is None:
            continue
        admitted[job.job_id] = (want, gpu_type)
        if room.total == 0:
            break
    return admitted


def place_admitted(snapshot: ClusterSnapshot, admitted: Mapping[str, tuple[int, str]], order: Sequence[str],
                   pools: Iterable[Pool] = TRAINING):
    """Place :func:`admit_typed`'s jobs, each on the type it was admitted on."""
    return place(snapshot, {j: n for j, (n, _) in admitted.items()}, order, pools=pools,
                 preferences={j: (t,) for j, (_, t) in admitted.items()})


def rigid_plan(
    snapshot: ClusterSnapshot,
    order: Sequence[JobInfo],
    *,
    pools: Iterable[Pool] = TRAINING,
    codesign: bool = False,
) -> Plan:
    """The plan giving the jobs :func:`admit_in_order` admits their requested GPUs, at their own batch size.

    With ``codesign`` (and data resources in the snapshot) :func:`scheduler.codesign.co_allocate`
    grants cache and IO, and jobs the IO grants would starve are left out so their GPUs go to
    the next jobs in ``order`` (:func:`scheduler.codesign.without_starved`).
    """
    pools = tuple(pools)
    if codesign and co.is_active(snapshot):
        def admit(excluded: frozenset[str]):
            kept = [job for job in order if job.job_id not in excluded]
            admitted = admit_typed(snapshot, kept, pools=pools)
            ranked = [job.job_id for job in kept if job.job_id in admitted]
            return place_admitted(snapshot, admitted, ranked, pools).placements, ranked

        return co.without_starved(snapshot, admit)
    admitted = admit_typed(snapshot, order, pools=pools)
    result = place_admitted(snapshot, admitted, [job.job_id for job in order if job.job_id in admitted], pools)
    return plan_from_placements(result.placements, snapshot=snapshot)


def io_demand(snapshot: ClusterSnapshot, jobs: Sequence[JobInfo], pools: Iterable[Pool] = TRAINING) -> dict[str, float]:
    """Remote bytes/s each job needs to run at compute speed on its requested GPUs, with the
    cache :func:`scheduler.codesign.expected_grants` expects for it."""
    if not jobs:
        return {}
    jobs = list(jobs)
    table, index = _table(jobs)
    counts = np.array([job.requested for job in jobs], dtype=np.int64)
    batch = np.array([job.initial_batch_size for job in jobs], dtype=np.int64)
    cache, _ = co.expected_grants(snapshot, jobs)
    pred = predict(table, index, counts, 0, cache, math.inf, batch, gpus_per_node=gpus_per_node(snapshot, pools))
    return {job.job_id: float(b) for job, b in zip(jobs, pred.io_demand_bytes_per_s)}


def by_priority_then_arrival(job: JobInfo) -> tuple:
    """Tie-break shared by the policies: larger ``priority`` first, then arrival, then id."""
    return (-job.priority, job.submit_time_s, job.job_id)


def sorted_by(jobs: Sequence[JobInfo], primary: Mapping[str, float] | Sequence[float]) -> list[JobInfo]:
    """``jobs`` by ascending ``primary`` (per job id or per position), ties by :func:`by_priority_then_arrival`."""
    if isinstance(primary, Mapping):
        keys = [float(primary[job.job_id]) for job in jobs]
    else:
        keys = [float(v) for v in primary]
    keys = [math.inf if math.isnan(v) else v for v in keys]  # NaN would break the sort
    ranked = sorted(range(len(jobs)), key=lambda k: (keys[k], *by_priority_then_arrival(jobs[k])))
    return [jobs[k] for k in ranked]
