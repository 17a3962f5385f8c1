"""Estimator access shared by the `pollux` and `gavel` policies: one place that builds candidate arrays.

A policy describes the allocations it wants priced as parallel arrays (job position in the
snapshot, GPUs, nodes, and the cache bytes and remote IO bytes/s granted) and gets back
:class:`estimator.predict.Predictions`. Today the policies are GPU-only and leave the IO
grant at ``inf`` (remote IO not limiting) and cache at 0; when cache and IO become
schedulable resources, a policy passes its per-candidate grants through the same call.

Jobs of one application usually share one :class:`~estimator.job_model.JobModel` value
until their models are refitted, so the models are deduplicated before building the
estimator's column table: a round over thousands of jobs then prices a handful of distinct
(model, shape) groups in the batch-size search instead of one per job.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import fields

import numpy as np
from numpy.typing import ArrayLike

from estimator.predict import ModelTable, Predictions, predict
from scheduler.policy import ClusterSnapshot, JobInfo, Pool


def pool_nodes(snapshot: ClusterSnapshot, pools: Sequence[Pool] = ("training",)):
    """Nodes of the allowed pools."""
    allowed = set(pools)
    return [node for node in snapshot.nodes if node.pool in allowed]


def gpus_per_node(snapshot: ClusterSnapshot, pools: Sequence[Pool] = ("training",)) -> int:
    """GPUs of the largest node of the pools (what "packed" means for a job's node count); at least 1.
    Remembered per node tuple (every round of a simulation, or of a live scheduler between node changes, asks)."""
    key = (id(snapshot.nodes), tuple(pools))
    found = _PER_NODE.get(key)
    if found is not None and found[0] is snapshot.nodes:
        return found[1]
    per_node = max((node.gpus for node in pool_nodes(snapshot, pools)), default=1) or 1
    if len(_PER_NODE) >= 16:
        _PER_NODE.clear()
    _PER_NODE[key] = (snapshot.nodes, per_node)  # the entry holds the tuple: its id stays its own
    return per_node


_PER_NODE: dict[tuple[int, tuple], tuple[tuple, int]] = {}


def packed_nodes(gpus: ArrayLike, per_node: int) -> np.ndarray:
    """Fewest nodes holding ``gpus`` GPUs (0 for 0 GPUs)."""
    gpus = np.asarray(gpus, dtype=np.int64)
    return -(-gpus // max(int(per_node), 1))


class JobTable:
    """The estimator's view of a snapshot's jobs, ready for vectorized prediction."""

    def __init__(self, jobs: Sequence[JobInfo], gpu_types: Sequence[str] | None = None):
        """``gpu_types[k]``: the GPU type ``jobs[k]`` is priced on (default: untyped, the job's own model).

        A job may appear once per type to price it on several types in one call.
        """
        self.jobs = tuple(jobs)
        types = [""] * len(self.jobs) if gpu_types is None else list(gpu_types)
        if len(types) != len(self.jobs):
            raise ValueError("need one GPU type per job")
        unique: dict = {}
        seen: dict[int, int] = {}  # id(model) -> its index: hashing a model is slow, and many jobs share one object

        def index_of(model) -> int:
            found = seen.get(id(model))
            if found is None:
                found = seen[id(model)] = unique.setdefault(model, len(unique))
            return found

        self.model_of = np.fromiter((index_of(job.model_on(t)) for job, t in zip(self.jobs, types)),
                                    dtype=np.int64, count=len(self.jobs))
        self.table = shared_model_table(list(unique)) if unique else None

    def __len__(self) -> int:
        return len(self.jobs)

    def predict(
        self,
        job: ArrayLike,
        gpus: ArrayLike,
        nodes: ArrayLike = 0,
        *,
        per_node: int,
        batch_size: ArrayLike = 0,
        cache_bytes: ArrayLike = 0.0,
        remote_io_bytes_per_s: ArrayLike = np.inf,
    ) -> Predictions:
        """Price candidates: job ``jobs[job[k]]`` on ``gpus[k]`` GPUs over ``nodes[k]`` nodes (0 = packed).

        ``batch_size`` 0 asks for the goodput-optimal batch; ``cache_bytes`` and
        ``remote_io_bytes_per_s`` are the grants of each candidate (defaults: no cache, IO not
        limiting — GPU-only scheduling).
        """
        if self.table is None:
            raise ValueError("no jobs to price")
        index = self.model_of[np.asarray(job, dtype=np.int64)]
        columns = np.broadcast_arrays(
            *(np.asarray(a, dtype=np.float64) for a in (index, gpus, nodes, cache_bytes, remote_io_bytes_per_s, batch_size))
        )
        columns = [np.ravel(c) for c in columns]
        # Identical candidates (same model, shape and grant) are priced once.
        first, inverse = _distinct_rows(columns)
        if first is not None:
            columns = [c[first] for c in columns]
        model, g, n, cache, io, batch = columns
        result = predict(
            self.table, model.astype(np.int64), g.astype(np.int64), n.astype(np.int64), cache, io, batch.astype(np.int64),
            gpus_per_node=max(int(per_node), 1),
        )
        if first is None:
            return result
        return Predictions(*(getattr(result, f.name)[inverse] for f in fields(Predictions)))


_TABLES: OrderedDict[tuple[int, ...], ModelTable] = OrderedDict()
_TABLES_LOCK = threading.Lock()
_TABLES_KEPT = 64


def shared_model_table(models: list) -> ModelTable:
    """``ModelTable(models)``, reused while the same model objects come back (every round of a
    simulation prices the same few shared models; building a table costs a best-batch search).

    Keyed by the models' identities: a cached table holds its models, so no other object can
    take one of their ids while the entry lives.
    """
    key = tuple(map(id, models))
    with _TABLES_LOCK:
        table = _TABLES.get(key)
        if table is not None:
            _TABLES.move_to_end(key)
            return table
    table = ModelTable(models)
    with _TABLES_LOCK:
        _TABLES[key] = table
        while len(_TABLES) > _TABLES_KEPT:
            _TABLES.popitem(last=False)
    return table


_GOODPUT: dict[tuple[int, int, int, int, int], tuple[float, object]] = {}  # (id(model), GPUs, nodes, batch, per node) -> (goodput, model)
_GOODPUT_KEPT = 200_000


def packed_goodput(models: Sequence, gpus: ArrayLike, batch_size: ArrayLike, *, per_node: int) -> np.ndarray:
    """Goodput of ``models[k]`` on ``gpus[k]`` GPUs on the fewest nodes, at global batch
    ``batch_size[k]`` (0: the best), IO not limiting (:func:`goodput_on_nodes`)."""
    return goodput_on_nodes(models, gpus, 0, batch_size, per_node=per_node)


def goodput_on_nodes(models: Sequence, gpus: ArrayLike, nodes: ArrayLike, batch_size: ArrayLike, *,
                     per_node: int) -> np.ndarray:
    """Goodput of ``models[k]`` on ``gpus[k]`` GPUs over ``nodes[k]`` nodes (0: the fewest), at
    global batch ``batch_size[k]`` (0: the best), no cache, IO not limiting — memoized, since
    rounds ask the same few shared models the same questions again and again (an entry holds
    its model, so its id stays its own; the memo is emptied when it grows past a bound)."""
    count = len(models)
    gpus = np.broadcast_to(np.asarray(gpus, dtype=np.int64), (count,)).tolist()
    nodes = np.broadcast_to(np.asarray(nodes, dtype=np.int64), (count,)).tolist()
    batch = np.broadcast_to(np.asarray(batch_size, dtype=np.int64), (count,)).tolist()
    keys = [(id(m), g, n, b, per_node) for m, g, n, b in zip(models, gpus, nodes, batch)]
    known = {key: _GOODPUT.get(key) for key in keys}
    missing = [k for k, key in enumerate(keys) if known[key] is None]
    if missing:
        first = list({keys[k]: k for k in reversed(missing)}.values())  # one row per missing key
        table = JobTable([_Priced(models[k]) for k in first])
        rates = table.predict(np.arange(len(first)), [gpus[k] for k in first], [nodes[k] for k in first],
                              per_node=per_node, batch_size=[batch[k] for k in first]).goodput_samples_per_s.tolist()
        if len(_GOODPUT) > _GOODPUT_KEPT:
            _GOODPUT.clear()
        for k, rate in zip(first, rates):
            known[keys[k]] = _GOODPUT[keys[k]] = (rate, models[k])
    return np.array([known[key][0] for key in keys], dtype=np.float64)


_BEST: dict[tuple[int, int, int, int], tuple[int, object]] = {}  # (id(model), GPUs, nodes, per node) -> (batch, model)


def best_batch_sizes(models: Sequence, gpus: ArrayLike, nodes: ArrayLike, *, per_node: int) -> np.ndarray:
    """The goodput-optimal global batch of ``models[k]`` on ``gpus[k]`` GPUs over ``nodes[k]``
    nodes, no cache, IO not limiting (what ``JobTable.predict(...).batch_size`` answers) —
    memoized like :func:`goodput_on_nodes`: the batch sizes a plan hands out are asked again
    every round for every job that keeps its GPUs."""
    count = len(models)
    gpus = np.broadcast_to(np.asarray(gpus, dtype=np.int64), (count,)).tolist()
    nodes = np.broadcast_to(np.asarray(nodes, dtype=np.int64), (count,)).tolist()
    keys = [(id(m), g, n, per_node) for m, g, n in zip(models, gpus, nodes)]
    known = {key: _BEST.get(key) for key in keys}
    missing = [k for k, key in enumerate(keys) if known[key] is None]
    if missing:
        first = list({keys[k]: k for k in reversed(missing)}.values())  # one row per missing key
        table = JobTable([_Priced(models[k]) for k in first])
        batches = table.predict(np.arange(len(first)), [gpus[k] for k in first], [nodes[k] for k in first],
                                per_node=per_node).batch_size.tolist()
        if len(_BEST) > _GOODPUT_KEPT:
            _BEST.clear()
        for k, batch in zip(first, batches):
            known[keys[k]] = _BEST[keys[k]] = (int(batch), models[k])
    return np.array([known[key][0] for key in keys], dtype=np.int64)


class _Priced:
    """A bare model in the shape :class:`JobTable` reads (``model_on``)."""

    __slots__ = ("model",)

    def __init__(self, model):
        self.model = model

    def model_on(self, gpu_type: str):
        return self.model


def _distinct_rows(columns: list[np.ndarray]) -> tuple[np.ndarray | None, np.ndarray | None]:
    """``(first, inverse)``: an index of one row per distinct row and each row's position among them.

    ``(None, None)`` when every row is distinct or there is nothing to gain.
    """
    size = columns[0].size
    distinct, first, inverse = np.unique(row_codes(columns), return_index=True, return_inverse=True)
    if distinct.size == size:
        return None, None
    return first, inverse.ravel()


def row_codes(columns: list[np.ndarray]) -> np.ndarray:
    """One integer per row of ``columns`` (parallel arrays), equal exactly for equal rows."""
    size = columns[0].size
    key = np.zeros(size, dtype=np.int64)
    for column in columns:
        if size == 0 or column[0] == column[-1] and np.all(column == column[0]):
            continue  # constant: adds nothing
        if 0 <= column.min() and column.max() < 2**20 and np.array_equal(column, np.floor(column)):
            codes, radix = column.astype(np.int64), int(column.max()) + 1  # small whole numbers: their own codes
        else:
            values, codes = np.unique(column, return_inverse=True)
            codes, radix = codes.ravel(), len(values)
        key = key * radix + codes
        if key.max(initial=0) > 2**40:  # keep the mixed-radix key small
            _, key = np.unique(key, return_inverse=True)
            key = key.ravel().astype(np.int64)
    return key


def held_in_place(snapshot: ClusterSnapshot, jobs: Sequence[JobInfo], pools: Sequence[Pool] = ("training",)) -> np.ndarray:
    """GPUs each job holds now, counting only placements that still exist in the pools (else 0).

    A job keeping exactly that many GPUs stays where it is (no restart); a placement on a
    lost node or GPU cannot be kept, so any count restarts the job.
    """
    sizes = {node.name: node.gpus for node in pool_nodes(snapshot, pools)}
    held = np.zeros(len(jobs), dtype=np.int64)
    for k, job in enumerate(jobs):
        allocation = snapshot.current.get(job.job_id)
        if allocation is None or not allocation.placement:
            continue
        if all(name in sizes and all(0 <= i < sizes[name] for i in indices) for name, indices in allocation.placement):
            held[k] = allocation.gpus
    return held
