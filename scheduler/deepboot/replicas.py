"""Inference replicas over time: the DeepBoot lifecycle, shared by the simulator and the live scheduler.

A :class:`Replica` goes RUNNING -> PROTECT -> SLEEP -> END (:mod:`scheduler.deepboot.state`):
when its task finishes it is kept warm and protected for ``30 s + 15 s x reuses`` (at most
120 s; :class:`ProtectSchedule`), then sleeps — still warm, but its GPU is lendable — until its
GPU is lent to training or given to another application's task (or ``sleep_s`` passes,
unlimited by default). A task of its application reuses a PROTECT or SLEEP replica with no
start-up cost; any other start pays the application's cold start (DeepBoot artifact: 4-8 s
per model). Time is injected: every method takes ``now`` (simulated seconds, or wall-clock
seconds in the live scheduler). :class:`InferencePool` keeps a cluster's replicas and applies
ATS-I decisions.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from scheduler.deepboot.ats_i import InferenceDecision
from scheduler.deepboot.costs import INFERENCE_COLD_START_S
from scheduler.deepboot.state import ReplicaState, ReplicaView, busy_gpus
from scheduler.policy import Plan

_NOT_ID = re.compile(r"[^A-Za-z0-9._-]")


def replica_id_for(application: str, number: int) -> str:
    """``<application>#<number>``, the application's name made a valid replica id
    (silod/rpc/identifiers.py): other characters become "_", at most 128 of them are kept."""
    name = _NOT_ID.sub("_", application)[:128] or "replica"
    if name[0] in ".-":
        name = "_" + name[1:]
    return f"{name}#{number}"

PREFIX = "infer-"
_APPLICATION = re.compile(r"^infer-(?P<model>[A-Za-z0-9_.]+(?:-[A-Za-z0-9_.]+)*?)-(?P<k>\d+)$")


def is_inference(application: str) -> bool:
    """Rows whose application starts with ``infer-`` are inference tasks."""
    return application.strip().startswith(PREFIX)


def model_of(application: str) -> str:
    """``infer-bert-2`` -> ``bert``; ``ValueError`` if it is not ``infer-<model>-<k>``."""
    match = _APPLICATION.match(application)
    if not match:
        raise ValueError(f"not an inference application (infer-<model>-<k>): {application!r}")
    return match["model"]



class Task(Protocol):
    """What starting a replica needs to know of a task."""

    name: str
    application: str
    duration_s: float           # GPU seconds once the replica is up (0 when unknown, as live)




@dataclass(frozen=True)
class ProtectSchedule:
    """Protect time after a task: ``base_s + per_reuse_s x reuses``, at most ``max_s`` (30/45/60/.../120 s)."""

    base_s: float = 30.0
    per_reuse_s: float = 15.0
    max_s: float = 120.0

    def __post_init__(self):
        if not (0 <= self.base_s <= self.max_s and self.per_reuse_s >= 0):
            raise ValueError("need 0 <= base_s <= max_s and per_reuse_s >= 0")

    def protect_s(self, reuses: int) -> float:
        return min(self.base_s + self.per_reuse_s * reuses, self.max_s)


@dataclass(frozen=True)
class LifecycleConfig:
    protect: ProtectSchedule = ProtectSchedule()
    sleep_s: float = math.inf                            # a sleeper ends after this long (unless lent or evicted first)
    cold_start_s: Mapping[str, float] = field(default_factory=lambda: dict(INFERENCE_COLD_START_S))  # model -> s
    default_cold_start_s: float = 6.0                    # models the table lacks

    def cold_start(self, application: str) -> float:
        return float(self.cold_start_s.get(model_of(application), self.default_cold_start_s))


class ReplicaError(RuntimeError):
    """A transition the lifecycle does not allow (a bug in the caller)."""


class Replica:
    """One replica's state machine; timed transitions (PROTECT -> SLEEP -> END) happen when observed."""

    def __init__(self, replica_id: str, application: str, node: str, gpu: int, *, now: float, config: LifecycleConfig):
        model_of(application)  # validates the name
        self.replica_id, self.application, self.node, self.gpu = replica_id, application, node, gpu
        self.config = config
        self.reuses = 0                  # tasks served after the first
        self._state = ReplicaState.RUNNING
        self._since = now
        self._until = math.inf           # end of the current timed state
        self._seen = now
        self._view: ReplicaView | None = None  # the last view, while the state it shows lasts

    def state(self, now: float) -> ReplicaState:
        if now < self._seen:
            raise ReplicaError(f"{self.replica_id}: time went backwards ({now} < {self._seen})")
        self._seen = now
        while now >= self._until:        # PROTECT ran out -> SLEEP; SLEEP ran out -> END
            if self._state is ReplicaState.PROTECT:
                self._enter(ReplicaState.SLEEP, self._until, self._until + self.config.sleep_s)
            else:
                self._enter(ReplicaState.END, self._until, math.inf)
        return self._state

    def next_change_s(self) -> float:
        """When the state will change by itself (inf: only a call changes it)."""
        return self._until

    def finish(self, now: float) -> float:
        """The task is done: RUNNING -> PROTECT; returns the end of the protect time."""
        self._expect(now, (ReplicaState.RUNNING,), "finish")
        self._enter(ReplicaState.PROTECT, now, now + self.config.protect.protect_s(self.reuses))
        return self._until

    def reuse(self, now: float) -> None:
        """A task of its application takes it: PROTECT or SLEEP -> RUNNING, no start-up."""
        self._expect(now, (ReplicaState.PROTECT, ReplicaState.SLEEP), "reuse")
        self.reuses += 1
        self._enter(ReplicaState.RUNNING, now, math.inf)

    def end(self, now: float) -> None:
        """Its GPU goes elsewhere (lent to training, or another application's task)."""
        self._expect(now, (ReplicaState.PROTECT, ReplicaState.SLEEP), "end")
        self._enter(ReplicaState.END, now, math.inf)

    def view(self, now: float) -> ReplicaView:
        state = self.state(now)
        view = self._view
        if view is None or view.state is not state or view.since_s != self._since:
            view = self._view = ReplicaView(self.replica_id, self.application, self.node, self.gpu, state, self._since)
        return view

    def _expect(self, now: float, allowed, action: str) -> None:
        state = self.state(now)
        if state not in allowed:
            raise ReplicaError(f"{self.replica_id}: cannot {action} a replica in state {state.value}")

    def _enter(self, state: ReplicaState, since: float, until: float) -> None:
        self._state, self._since, self._until = state, since, until


class InferencePool:
    """A cluster's inference replicas: what the engine keeps between events."""

    def __init__(self, config: LifecycleConfig = LifecycleConfig()):
        self.config = config
        self._replicas: dict[str, Replica] = {}
        self._next_id = 0

    def views(self, now: float) -> tuple[ReplicaView, ...]:
        """Live replicas (ended ones are forgotten)."""
        result = []
        for replica_id, replica in list(self._replicas.items()):
            if replica.state(now) is ReplicaState.END:
                del self._replicas[replica_id]
            else:
                result.append(replica.view(now))
        return tuple(result)

    def busy(self, now: float) -> dict[str, tuple[int, ...]]:
        """``ClusterSnapshot.inference_busy``: GPUs of RUNNING and PROTECT replicas."""
        return busy_gpus(self.views(now))

    def replica(self, replica_id: str) -> Replica:
        return self._replicas[replica_id]

    def adopt(self, replica: Replica) -> None:
        """Keep a replica rebuilt elsewhere (the live scheduler's restart); new ids never clash with it."""
        self._replicas[replica.replica_id] = replica
        suffix = replica.replica_id.rpartition("#")[2]
        if suffix.isdigit():
            self._next_id = max(self._next_id, int(suffix) + 1)

    def start(self, decision: InferenceDecision, task: Task, now: float) -> tuple[str, float]:
        """Run ``task`` where ATS-I decided; returns ``(replica id, finish time)``.

        A reused replica starts at once; otherwise the replica it replaces (``sleep``, ``evict``) ends and a new
        replica pays its cold start. The caller applies ``decision.job_allocation`` to the
        training plan for a ``reclaim``.
        """
        if decision.kind == "wait":
            raise ReplicaError(f"{task.name}: ATS-I found no GPU; keep the task pending")
        if decision.kind == "reuse":
            self._replicas[decision.replica_id].reuse(now)
            return decision.replica_id, now + task.duration_s
        if decision.kind in ("sleep", "evict"):  # the sleeper, or another application's idle protected replica
            self._replicas[decision.replica_id].end(now)
        replica_id = replica_id_for(task.application, self._next_id)
        self._next_id += 1
        self._replicas[replica_id] = Replica(replica_id, task.application, decision.node, decision.gpu, now=now, config=self.config)
        return replica_id, now + self.config.cold_start(task.application) + task.duration_s

    def finish(self, replica_id: str, now: float) -> float:
        """Its task is done; returns when its protect time ends."""
        return self._replicas[replica_id].finish(now)

    def end_lent(self, plan: Plan, now: float) -> tuple[str, ...]:
        """End the SLEEP replicas whose GPU ``plan`` gives to training; returns their ids."""
        sleeping = [view for view in self.views(now) if view.state is ReplicaState.SLEEP]
        if not sleeping:
            return ()  # the usual case: no GPU of the whole plan to look at
        taken = {(node, i) for allocation in plan.allocations.values() for node, indices in allocation.placement for i in indices}
        ended = []
        for view in sleeping:
            if (view.node, view.gpu) in taken:
                self._replicas[view.replica_id].end(now)
                ended.append(view.replica_id)
        return tuple(ended)

    def next_change_s(self) -> float:
        """Earliest timed transition of any replica (the engine wakes up then to re-plan lending)."""
        return min((r.next_change_s() for r in self._replicas.values()), default=math.inf)
