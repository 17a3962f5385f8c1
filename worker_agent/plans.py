"""Applying the node's plans: which ranks should run here, and making it so.

* Plans: ``AllocationService.Watch`` is consumed by one task; only the newest NodePlan is kept
  pending and the applier applies each version at most once (versions <= applied are ignored),
  then Acks it. Applying diffs the desired tasks (job_id, rank, generation, gpus) against the
  local ones: tasks no longer desired (or of another generation, or on other GPUs) are stopped
  first, and only once they have exited are their GPUs released and new tasks launched.
* Fencing: a plan from an older leadership epoch than the newest seen comes from a deposed
  scheduler: it is refused (logged, and Acked ok=False naming the reason).
* Fast resize (AFE, ``TaskAssignment.fast_resize``): a live task of the job whose GPUs are
  exactly those of an assignment of a newer generation *survives*: it keeps its process and
  GPUs, is re-keyed to the new (rank, generation) at once (reports go under the new identity,
  STARTING until its SDK calls with it) and its directive becomes REFORM with the new world,
  which the SDK picks up on its next poll. The agent also answers the survivor's SDK under the
  old identity until then. If the job has a survivor on this node, its other old tasks are
  removed with directive EXIT (exit 0, no checkpoint: the survivors keep the state), else the
  usual checkpoint-and-exit stop applies. New ranks launch once removed ones have exited: the
  jobs side by side, each job's ranks one after another in the plan's order. A
  survivor's GPUs and run record stay under the key it was launched as (``launch_key``), so the
  GPU table's acquires are exactly the launched processes. See docs/development.md.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc

from services.runtime.structured_logging import get_logger
from silod.v1 import allocation_pb2, allocation_pb2_grpc, plan_pb2
from worker_agent import node_protocol, task_metrics
from worker_agent.ranks import Ranks
from worker_agent.tasks import task_key

_log = get_logger("silod.worker_agent")
_COMPONENT = allocation_pb2.PLAN_COMPONENT_WORKER_AGENT


class PlanApplier:
    def __init__(self, node: str, ranks: Ranks, checkpoint_deadline_s: float,
                 alloc: Callable[[], allocation_pb2_grpc.AllocationServiceStub | None],
                 applied: Callable[[int], None]) -> None:
        self.node = node
        self.ranks = ranks
        self.checkpoint_deadline_s = checkpoint_deadline_s
        self._alloc = alloc  # the stub of the scheduler followed now
        self._applied = applied  # told each version applied (before its Ack)
        self.applied_version = 0
        self.applied_versions: list[int] = []
        self.plan_epoch = 0  # the newest scheduler leadership epoch seen on a plan (fencing)
        self.refused_plans: list[tuple[int, int]] = []  # (version, epoch) of plans from an older epoch
        self._acks: set[asyncio.Task[None]] = set()  # refusals' Acks in flight
        self._pending: plan_pb2.NodePlan | None = None
        self._pending_since = 0.0  # monotonic time the pending plan arrived
        self._plan_ready = asyncio.Event()
        self.lock = asyncio.Lock()  # held while a plan is applied, and while the agent shuts down

    def offer(self, plan: plan_pb2.NodePlan) -> None:
        """Keep ``plan`` as the next to apply if it is newer than what is applied or pending."""
        reason = node_protocol.epoch_refusal(plan, self.plan_epoch)
        if reason:
            _log.warning("plan from an older epoch refused", extra={"version": plan.version, "reason": reason})
            self.refused_plans.append((plan.version, plan.epoch))
            if self._alloc() is not None:
                self._spawn_ack(allocation_pb2.AckPlanRequest(
                    node=self.node, component=_COMPONENT, version=plan.version, ok=False, message=reason))
            return
        self.plan_epoch = plan.epoch
        newest = max(self.applied_version, self._pending.version if self._pending is not None else 0)
        if plan.version <= newest:
            return
        if self._pending is None:
            self._pending_since = time.monotonic()
        self._pending = plan
        self._plan_ready.set()

    def _spawn_ack(self, request: allocation_pb2.AckPlanRequest) -> None:
        async def ack() -> None:
            try:
                await self._alloc().Ack(request, timeout=10)  # type: ignore[union-attr]
            except grpc.aio.AioRpcError as exc:
                _log.warning("ack failed", extra={"version": request.version, "code": exc.code().name})

        task = asyncio.ensure_future(ack())
        self._acks.add(task)
        task.add_done_callback(self._acks.discard)

    async def run(self) -> None:
        """Apply pending plans, one at a time, for ever."""
        while True:
            await self._plan_ready.wait()
            self._plan_ready.clear()
            plan, self._pending = self._pending, None
            arrived = self._pending_since
            if plan is None or plan.version <= self.applied_version:
                continue
            ok, message, released = True, "", []
            try:
                async with self.lock:
                    released = await self.apply(plan)
            except Exception as exc:  # noqa: BLE001 - reported to the scheduler in the Ack
                _log.exception("applying plan failed", extra={"version": plan.version})
                ok, message = False, f"{type(exc).__name__}: {exc}"
            self.applied_version = plan.version
            self.applied_versions.append(plan.version)
            self._applied(plan.version)
            try:
                await self._alloc().Ack(  # type: ignore[union-attr]
                    allocation_pb2.AckPlanRequest(node=self.node, component=_COMPONENT, version=plan.version,
                                                  ok=ok, message=message, released_jobs=sorted(set(released))),
                    timeout=10)
            except grpc.aio.AioRpcError as exc:
                _log.warning("ack failed", extra={"version": plan.version, "code": exc.code().name})
            task_metrics.plan_applied(self.node, plan.version, time.monotonic() - arrived)

    async def apply(self, plan: plan_pb2.NodePlan) -> list[str]:
        """Make the local tasks match ``plan``; return jobs whose GPUs here were released."""
        ranks = self.ranks
        desired = {task_key(a.job_id, a.rank, a.generation): a for a in plan.tasks}
        surviving_jobs = self._fast_resize(plan)
        to_stop = []
        for t in ranks.live():
            want = desired.get(t.key)
            if want is None or sorted(want.gpu_indices) != sorted(t.gpus):
                t.leave = t.leave or (t.stop_deadline == 0.0 and t.job_id in surviving_jobs)
                to_stop.append(t)
        released = [t.job_id for t in to_stop]
        if to_stop:
            _log.info("stopping tasks", extra={"version": plan.version, "tasks": [t.key for t in to_stop],
                                               "leaving": [t.key for t in to_stop if t.leave]})
            await asyncio.gather(*(ranks.stop(t, self.checkpoint_deadline_s) for t in to_stop))
            for t in to_stop:  # moved to other GPUs within one generation (not expected): relaunch it
                if t.key in desired:
                    ranks.finished.discard(t.key)
                    del ranks.tasks[t.key]
        running = {t.key for t in ranks.live()}
        by_job: dict[str, list[plan_pb2.TaskAssignment]] = {}
        for key, a in desired.items():
            if key not in running and key not in ranks.finished:
                by_job.setdefault(a.job_id, []).append(a)
        # Jobs launch side by side, each job's ranks in the plan's order: a launch that waits (a
        # container image being pulled) holds up its own job only. Every launch takes its GPUs in
        # the table before its first await and only after the stops above have released theirs,
        # so the table refuses exactly what it refused when launches ran one by one.
        done = await asyncio.gather(*(self._launch_in_order(job) for job in by_job.values()), return_exceptions=True)
        failed = next((e for e in done if isinstance(e, BaseException)), None)
        if failed is not None:
            raise failed
        return released

    async def _launch_in_order(self, assignments: list[plan_pb2.TaskAssignment]) -> None:
        for a in assignments:
            await self.ranks.launch(a)

    def _fast_resize(self, plan: plan_pb2.NodePlan) -> set[str]:
        """Re-key survivors of fast resizes to their new assignments; return the jobs that have one.

        A survivor is a live task not asked to stop, of an older generation than a fast_resize
        assignment of its job, on exactly that assignment's GPUs. Ranks are matched by GPUs,
        not by number: a survivor may be renumbered (the world shrank below it)."""
        tasks = self.ranks.tasks
        surviving: set[str] = set()
        live = [t for t in self.ranks.live() if t.stop_deadline == 0.0]
        for a in plan.tasks:
            if not a.fast_resize:
                continue
            t = next((t for t in live if t.job_id == a.job_id and t.generation < a.generation
                      and sorted(t.gpus) == sorted(a.gpu_indices)), None)
            if t is None:
                continue
            live.remove(t)
            old = (t.rank, t.generation, t.assignment.world_size)
            del tasks[t.key]
            t.aliases.add((t.rank, t.generation))
            t.assignment = a
            t.phase = allocation_pb2.TASK_PHASE_STARTING  # RUNNING again once its SDK uses the new identity
            t.reform_since = time.monotonic()
            tasks[t.key] = t
            surviving.add(a.job_id)
            with open(t.log_path, "ab") as log:  # not a launch line: the e2e checks count those
                log.write(f"--- silod: fast resize to generation {a.generation} rank {a.rank} of {a.world_size} "
                          f"(was generation {old[1]} rank {old[0]} of {old[2]})\n".encode())
            _log.info("fast resize: task survives", extra={
                "task": t.key, "was": task_key(t.job_id, old[0], old[1]), "pid": t.process.pid if t.process else 0})
        if surviving:
            self.ranks.changed()
        return surviving

