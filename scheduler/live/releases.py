"""Release-before-reuse: GPUs a committed plan took from a job stay its own until it let go.

When a committed plan takes GPUs away from a job (resize, preemption, completion, cancel),
those (node, GPU) pairs are recorded as *pending release* for that job. Until the node
acknowledges the release (AckPlan.released_jobs naming the job, or a ReportTasks at or after
the releasing plan version that shows no live task of the job on the GPU), the policy's output
is filtered: an allocation that uses a GPU pending release by *another* job is replaced by the
job's current allocation if that one is conflict-free, else dropped (the job waits). The
policy stays a pure function; the filter runs after check_plan. The pending set lives in
memory: after a scheduler restart it starts empty (agents still stop old tasks before starting
new ones on their node).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping

import grpc

from scheduler.live import convert
from scheduler.live.entries import EntryChanges
from scheduler.policy import Allocation, ChangedSince, ClusterSnapshot, Plan
from scheduler.rank_requests import NodeRoom
from silod.v1 import metadata_pb2, plan_pb2

Gpu = tuple[str, int]  # (node, GPU index)


class ReleaseTracker:
    def __init__(self) -> None:
        self.pending: dict[Gpu, tuple[str, int]] = {}  # (node, gpu) -> (job, releasing version)
        self._held: tuple[plan_pb2.AllocationPlan | None, dict[Gpu, str]] = (None, {})  # see _held_under

    def record(self, previous: plan_pb2.AllocationPlan, new: plan_pb2.AllocationPlan,
               changes: EntryChanges | None = None) -> None:
        """The GPUs ``new`` takes from jobs that held them under ``previous``. ``changes``: what
        ``new`` changes of ``previous``, where known: only those entries are compared."""
        if changes is not None:
            pairs: Iterable[tuple[plan_pb2.JobAllocation, plan_pb2.JobAllocation | None]] = (
                (entry, changes.upserts.get(job_id)) for job_id, entry in changes.previous.items())
        else:
            entries = {e.job_id: e for e in new.jobs}
            pairs = ((entry, entries.get(entry.job_id)) for entry in previous.jobs)
        for entry, now in pairs:
            if now is not None and convert.placement_of(now) == convert.placement_of(entry):
                continue  # the usual case: most of 5,000 jobs keep what they hold
            kept = set(convert.ranks_of(now)) if now is not None else set()
            for gpu in convert.ranks_of(entry):
                if gpu not in kept:
                    self.pending[gpu] = (entry.job_id, new.version)
        self._follow(previous, new, changes)

    def _follow(self, previous: plan_pb2.AllocationPlan, new: plan_pb2.AllocationPlan,
                changes: EntryChanges | None) -> None:
        """Carry the GPUs held under ``previous`` over to ``new`` by its changes, where the holders
        of ``previous`` are known and so are the changes (else they are worked out when asked)."""
        if changes is None or self._held[0] is not previous:
            return
        held = self._held[1]
        for job_id, entry in changes.previous.items():
            for gpu in convert.ranks_of(entry):
                if held.get(gpu) == job_id:
                    del held[gpu]
        for job_id, entry in changes.upserts.items():
            for gpu in convert.ranks_of(entry):
                held[gpu] = job_id
        self._held = (new, held)

    async def recover(self, md, latest: plan_pb2.AllocationPlan | None) -> None:  # type: ignore[no-untyped-def]
        """After a restart: GPUs the latest plan took from a job are pending release again
        (conservative: a release acked before the crash is re-proven by the agent's next report)."""
        if latest is None or latest.version < 2:
            return
        try:
            previous = await md.GetPlan(metadata_pb2.GetPlanRequest(version=latest.version - 1))
        except grpc.aio.AioRpcError:
            return
        self.record(previous, latest)

    def release(self, node: str, jobs: Iterable[str]) -> bool:
        """The node acknowledged that ``jobs`` let go of their GPUs there; whether any was pending."""
        jobs = set(jobs)
        freed = [gpu for gpu, (job, _) in self.pending.items() if gpu[0] == node and job in jobs]
        for gpu in freed:
            del self.pending[gpu]
        return bool(freed)

    def proven_by_report(self, node: str, applied_version: int, live_held: set[tuple[str, int]]) -> bool:
        """Releases proven by a task report: no live task of the job on the GPU, at or after the
        releasing plan. ``live_held``: (job, GPU index) of the node's live tasks. Whether any was freed."""
        freed = [gpu for gpu, (job, version) in self.pending.items()
                 if gpu[0] == node and applied_version >= version and (job, gpu[1]) not in live_held]
        for gpu in freed:
            del self.pending[gpu]
        return bool(freed)

    def busy(self, latest: plan_pb2.AllocationPlan | None,
             current_from: plan_pb2.AllocationPlan | None = None) -> BusyGpus:
        """GPU -> the job it belongs to until released. ``current_from``: the plan the snapshot's
        ``current`` was read off; when it is ``latest``, hold_releases passes the jobs that keep
        their allocation without looking at each of its GPUs."""
        # GPUs held under the plan in force count as busy for every other job: handing one over
        # means its holder releases it in this plan, and it is reusable only once that is acked.
        return BusyGpus(self._held_under(latest), dict(self.pending),
                        current_follows_held=latest is not None and current_from is latest)

    def _held_under(self, latest: plan_pb2.AllocationPlan | None) -> dict[Gpu, str]:
        """GPU -> its job under ``latest``: worked out once per plan (25,000 GPUs at 1,000 nodes,
        every round, while the plan in force changes only when one is committed)."""
        if latest is None:
            return {}
        if self._held[0] is not latest:
            self._held = (latest, {gpu: entry.job_id for entry in latest.jobs for gpu in convert.ranks_of(entry)})
        return self._held[1]


class BusyGpus(Mapping[Gpu, str]):
    """GPU -> the job it belongs to until released: its holder under the plan in force, or the
    job it is pending release from. The holders are the tracker's own map, not a copy: good for
    the round it was made in, until the round's plan is committed."""

    def __init__(self, held: Mapping[Gpu, str], pending: Mapping[Gpu, tuple[str, int]], *,
                 current_follows_held: bool = False) -> None:
        self.held = held
        self.pending = pending
        # The snapshot's current plan was read off the plan the holders are of: every GPU of a
        # job's current allocation is held by that job.
        self.current_follows_held = current_follows_held

    def __getitem__(self, gpu: Gpu) -> str:
        pending = self.pending.get(gpu)
        return pending[0] if pending is not None else self.held[gpu]

    def __iter__(self) -> Iterator[Gpu]:
        yield from self.pending
        yield from (gpu for gpu in self.held if gpu not in self.pending)

    def __len__(self) -> int:
        return len(self.pending) + sum(1 for gpu in self.held if gpu not in self.pending)

    def holders_of_released(self) -> set[str]:
        """The jobs that hold, under the plan in force, a GPU pending release from another job:
        those whose current allocation may use a GPU that is not theirs yet."""
        return {holder for gpu, (job, _) in self.pending.items()
                if (holder := self.held.get(gpu)) is not None and holder != job}


def hold_releases(plan: Plan, current: Plan, busy: Mapping[Gpu, str], snapshot: ClusterSnapshot | None = None, *,
                  overlap_free: bool = False) -> Plan:
    """Drop allocations that would use a GPU another job has not released yet. With
    ``snapshot``, also those whose ranks no longer find the cores and memory they request
    once kept allocations took theirs (a job kept on its old GPUs holds its old nodes' share).
    ``overlap_free``: no GPU is in two of ``plan``'s allocations (a plan the invariants passed).

    Cost: at 20,000 jobs most keep their GPUs round after round. With ``busy`` a BusyGpus whose
    holders ``current`` follows, those are passed by one comparison of placements each; only the
    allocations that moved, and those of jobs holding a GPU another job still has to release, are
    looked at GPU by GPU. :class:`ReleaseHolds` also skips the comparisons, round after round."""
    return _held(plan, current, busy, snapshot, overlap_free).plan


@dataclasses.dataclass
class _Held:
    plan: Plan
    suspects: set[str] | None  # jobs holding a GPU another job has yet to release (None: no fast path)
    slow: set[str]  # jobs whose allocation was looked at GPU by GPU (or kept back)
    first_pass: bool  # the plan is the first pass's own: no old allocation kept, no overlap to settle


def _held(plan: Plan, current: Plan, busy: Mapping[Gpu, str], snapshot: ClusterSnapshot | None,
          overlap_free: bool, looked: Iterable[tuple[str, Allocation | None]] | None = None,
          result: dict[str, Allocation] | None = None) -> _Held:
    """hold_releases' work; with ``looked`` (job -> its allocation in ``plan``, None where it has
    none), only those jobs are decided again, into ``result`` (the last round's, copied)."""
    # A job that keeps its current allocation holds each of its GPUs under the plan in force, so
    # only a pending release of one of them by another job can stand in its way.
    suspects = busy.holders_of_released() \
        if isinstance(busy, BusyGpus) and busy.current_follows_held else None
    currents = current.allocations
    if result is None:
        result = {}
    kept_old: set[str] = set()
    slow: set[str] = set()
    for job_id, alloc in (plan.allocations.items() if looked is None else looked):
        result.pop(job_id, None)
        if alloc is None or not alloc.gpus:
            continue
        if suspects is not None and job_id not in suspects:
            now = currents.get(job_id)
            # Only the GPUs matter here (the policy's batch size and the data grants differ
            # from the plan in force's, which are made after this).
            if now is not None and (now is alloc or now.placement == alloc.placement):
                result[job_id] = alloc
                continue
        slow.add(job_id)
        if _conflicts(busy, job_id, alloc):
            old = current.get(job_id)
            if old is not None and old.gpus and not _conflicts(busy, job_id, old):
                result[job_id] = old
                kept_old.add(job_id)
            continue
        result[job_id] = alloc
    if overlap_free and not kept_old:
        return _Held(Plan(result), suspects, slow, True)  # every allocation kept is the plan's own: none shares a GPU
    # A kept (running) allocation wins over a new one of another job on the same GPU.
    used: set[Gpu] = set()
    jobs = {job.job_id: job for job in snapshot.jobs if job.has_requests} if snapshot is not None and kept_old else {}
    room = NodeRoom(snapshot.nodes) if jobs else None
    for job_id in sorted(result, key=lambda j: j not in kept_old):
        gpus = {(node, i) for node, idx in result[job_id].placement for i in idx}
        job = jobs.get(job_id)
        if gpus & used or (job is not None and not room.fits(job, result[job_id].placement)):  # type: ignore[union-attr]
            del result[job_id]
            continue
        used |= gpus
        if job is not None:
            room.take(job, result[job_id].placement)  # type: ignore[union-attr]
    return _Held(Plan(result), suspects, slow, False)


def _conflicts(busy: Mapping[Gpu, str], job_id: str, alloc: Allocation | None) -> bool:
    if alloc is None:
        return False
    return any(busy.get((node, i), job_id) != job_id for node, idx in alloc.placement for i in idx)


class ReleaseHolds:
    """hold_releases round after round, deciding again only the jobs that may come out otherwise:
    those the plan's and the current plan's hints name (Plan.changed), those holding a GPU
    another job has yet to release, and those last round looked at GPU by GPU.
    Any other job keeps its GPUs under the plan in force, as last round, and comes out as last
    round. Where a hint does not follow the last round's plans, or either round had to settle
    overlaps (an old allocation kept back, inference tasks), every job is decided again.

    The plan it gives says what changed of the last one (Plan.changed). Its allocations are the
    same as hold_releases gives, though not always in the same order: a job decided again goes last."""

    def __init__(self) -> None:
        self._last: tuple[Mapping[str, Allocation], Mapping[str, Allocation], _Held] | None = None
        self.last_looked: int | None = None  # jobs decided again by the last call (None: all; tests)

    def hold(self, plan: Plan, current: Plan, busy: Mapping[Gpu, str], snapshot: ClusterSnapshot | None = None, *,
             overlap_free: bool = False) -> Plan:
        last, self._last = self._last, None
        plan_hint, current_hint = plan.changed, current.changed
        if last is not None and overlap_free and last[2].first_pass and last[2].suspects is not None \
                and isinstance(busy, BusyGpus) and busy.current_follows_held \
                and plan_hint is not None and plan_hint.follows(last[0], plan.allocations) \
                and current_hint is not None and current_hint.follows(last[1], current.allocations):
            before = last[2].plan.allocations
            # Last round's suspects were looked at GPU by GPU: they are among its slow ones.
            ids = {*plan_hint.entries, *current_hint.entries, *busy.holders_of_released(), *last[2].slow}
            allocations = plan.allocations
            looked = [(job_id, allocations.get(job_id)) for job_id in sorted(ids)]
            held = _held(plan, current, busy, snapshot, overlap_free, looked, dict(before))
            if held.first_pass:
                self.last_looked = len(looked)
                held.plan = Plan(held.plan.allocations, changed=ChangedSince(
                    before, held.plan.allocations, {job_id: held.plan.allocations.get(job_id) for job_id in ids}))
                self._last = (plan.allocations, current.allocations, held)
                return held.plan
        self.last_looked = None
        held = _held(plan, current, busy, snapshot, overlap_free)
        self._last = (plan.allocations, current.allocations, held)
        return held.plan
