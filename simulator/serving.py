"""Inference tasks on the inference pool (DeepBoot): arrivals, ATS-I placement with reclaims
of lent GPUs, task finishes, the GPU checks, and the per-task records.

:class:`InferenceMixin` is part of :class:`simulator.engine.Simulator`; it owns the pool of
replicas (``_pool``), the tasks and their queue, and what training held on inference nodes
(``_lent_gpu_s``, ``_reclaims``).
"""

from __future__ import annotations

import dataclasses
import math

from scheduler.deepboot.ats_i import place_inference_tasks
from scheduler.deepboot.state import ReplicaState, busy_gpus
from scheduler.invariants import PlanViolation
from scheduler.placement import placement_type
from simulator.errors import SimulatorInputError
from simulator.inference import InferencePool, InferenceTask, LifecycleConfig, ProtectSchedule
from simulator.records import InferenceRecord

_EPS = 1e-9


class InferenceMixin:
    def _init_inference(self, tasks: tuple[InferenceTask, ...], lifecycle: LifecycleConfig | None, protect_scale: float) -> None:
        if not (math.isfinite(protect_scale) and protect_scale >= 0):
            raise SimulatorInputError(f"--inference-protect-scale: expected a number >= 0, got {protect_scale!r}")
        self._protect_scale = protect_scale
        self._tasks = tuple(sorted(tasks, key=lambda task: task.arrival_s))
        self._inference_nodes = {n.name for n in self.cluster.nodes if n.pool == "inference"}
        if self._tasks and not self._inference_nodes:
            raise SimulatorInputError(
                f"workload {self.workload.name}: {len(self._tasks)} inference tasks but the cluster has no inference-pool "
                "nodes (a node list entry with 'pool: inference')"
            )
        if lifecycle is None:
            p = ProtectSchedule()
            lifecycle = LifecycleConfig(protect=ProtectSchedule(p.base_s * protect_scale, p.per_reuse_s * protect_scale,
                                                                p.max_s * protect_scale))
        self._pool = InferencePool(lifecycle)
        self._costs = getattr(self.policy, "costs", None)   # ResizeCosts of a DeepBoot-style policy
        self._task_next = 0                                  # index of the next task to arrive
        self._queue: list[int] = []                          # arrived, not placed (task indices, FIFO)
        self._serving: dict[str, tuple[float, int]] = {}     # replica id -> (task finish time, task index)
        self._placed: dict[int, tuple[float, float, bool, str]] = {}  # task -> (start, ready, cold, kind)
        self._task_finish: dict[int, float] = {}
        self._lent_gpu_s = 0.0
        self._reclaims = 0
        self._pool_version = 0                               # bumped whenever the engine changes the pool
        self._seen_views: tuple = (None, (), {})              # ((t, version), views, busy) of the last look
        self._charges: dict[str, list] = {}

    def _pool_changed(self) -> None:
        self._pool_version += 1

    def _views(self, t: float):
        """The pool's live replicas at ``t`` (asked several times an event: remembered until the pool changes)."""
        key = (t, self._pool_version)
        if self._seen_views[0] != key:
            views = self._pool.views(t)
            self._seen_views = (key, views, busy_gpus(views))
        return self._seen_views[1]

    def _busy(self, t: float) -> dict[str, tuple[int, ...]]:
        """``ClusterSnapshot.inference_busy`` at ``t``: GPUs of RUNNING and PROTECT replicas."""
        self._views(t)
        return self._seen_views[2]

    def _inference_done(self) -> bool:
        return self._task_next == len(self._tasks) and not self._queue and not self._serving

    def _inference_events(self) -> list[float]:
        events = []
        if self._task_next < len(self._tasks):
            events.append(self.start_s + self._tasks[self._task_next].arrival_s)
        events.extend(finish for finish, _ in self._serving.values())
        if self._queue:  # PROTECT -> SLEEP frees a GPU for a queued task
            events.append(self._pool.next_change_s())
        return events

    def _arrive_tasks(self, t: float) -> bool:
        first = self._task_next
        while self._task_next < len(self._tasks) and self.start_s + self._tasks[self._task_next].arrival_s <= t + _EPS:
            self._queue.append(self._task_next)
            self._task_next += 1
        return self._task_next > first

    def _finish_tasks(self, t: float) -> bool:
        done = [rid for rid, (finish, _) in self._serving.items() if finish <= t + _EPS * max(1.0, abs(t))]
        for replica_id in sorted(done, key=lambda rid: self._serving[rid]):
            _, index = self._serving.pop(replica_id)
            self._task_finish[index] = t
            self._pool.finish(replica_id, t)
            self._pool_changed()
        return bool(done)

    def _place_inference(self, t: float) -> bool:
        """ATS-I for the queued tasks; applies reclaims to the training plan. True if training allocations changed."""
        snapshot = self._snapshot(t)
        tasks = [self._tasks[i] for i in self._queue]
        applications = [task.application for task in tasks]
        place = getattr(self.policy, "place_inference", None)
        if place is not None:
            result = place(snapshot, applications, self._views(t))
        else:  # a non-lending policy: ATS-I on the inference pool, nothing lent so nothing to reclaim
            result = place_inference_tasks(snapshot, applications, self._views(t))
        jobs = {job.spec.name: (job, info) for job, info in zip(self._active, snapshot.jobs)}
        waiting, resized, moved = [], False, []
        for index, task, decision in zip(self._queue, tasks, result.decisions):
            if decision.kind == "wait":
                waiting.append(index)
                continue
            if decision.kind == "reclaim":
                job, info = jobs[decision.job_id]
                self._reclaims += 1
                resized = True
                new = decision.job_allocation
                if new is None or not new.placement:  # below its minimum: the job stops (checkpointed)
                    self._assign(job, None, t)
                else:
                    cost = self._charge("afe" if self._costs.afe else "full",
                                        self._costs.cost_s(info, starting=False, default_s=self.cluster.restart_cost_s)) \
                        if self._costs is not None else self._resize_cost(job, info, new)
                    self._settle(job, t)
                    job.restart_until = max(job.restart_until, t + cost)
                    self._assign(job, dataclasses.replace(
                        new, gpu_type=placement_type(new.placement, self._node_types, info)), t)
                    moved.append(job)
                    job.restarts += 1  # a stopped job counts when it is placed again
            replica_id, finish = self._pool.start(decision, task, t)
            self._pool_changed()
            self._serving[replica_id] = (finish, index)
            cold = self._pool.config.cold_start(task.application) if decision.cold_start else 0.0
            self._placed[index] = (t, t + cold, decision.cold_start, decision.kind)
        self._queue = waiting
        if resized:
            self._set_rates(t, moved)
        return resized

    def _check_gpus(self, t: float) -> None:
        """No GPU has two holders (training jobs and live replicas), and a queued task sees no lendable GPU."""
        holders: dict[tuple[str, int], str] = {}
        replicas = self._views(t)
        claims = [(f"replica {v.replica_id}", ((v.node, (v.gpu,)),)) for v in replicas]
        claims += [(f"job {j.spec.name}", j.allocation.placement) for j in self._active if j.allocation is not None]
        for who, placement in claims:
            for node, indices in placement:
                for i in indices:
                    if (node, i) in holders:
                        raise PlanViolation(f"policy {self.policy_name} at t={t:.0f}s: GPU {node}/{i} held by both "
                                            f"{holders[(node, i)]} and {who}")
                    holders[(node, i)] = who
        if self._queue:  # ATS-I ends another application's idle PROTECT replica before a task waits
            busy = {(v.node, v.gpu) for v in replicas if v.state is ReplicaState.RUNNING}
            idle = [(n.name, i) for n in self.cluster.nodes if n.pool == "inference" for i in range(n.gpus) if (n.name, i) not in busy]
            if idle:
                raise PlanViolation(f"policy {self.policy_name} at t={t:.0f}s: {len(self._queue)} inference tasks wait "
                                    f"while inference GPU {idle[0][0]}/{idle[0][1]} is not RUNNING")

    def _inference_records(self) -> tuple[InferenceRecord, ...]:
        records = []
        for index, task in enumerate(self._tasks):
            start, ready, cold, kind = self._placed[index]
            arrival = self.start_s + task.arrival_s
            records.append(InferenceRecord(task.name, task.application, arrival, start, ready, self._task_finish[index],
                                           start - arrival, cold, kind))
        return tuple(records)
