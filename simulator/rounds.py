"""Scheduling rounds: the snapshot a policy sees, the policy's plan checked and carried out,
restart charges, every running job's rate from then on, and the rounds left out because their
plan is known.

**Known rounds.** After a round the engine asks the policy how long its plan will stand
(``stable_until``, :mod:`scheduler.steady`): until a job arrives or leaves, or a line the policy
watches is crossed (Tiresias' queue thresholds, the order of attained service Pollux breaks ties
by). The rounds before then would return the plan in force, so they are counted but not run:
the clock jumps over them, and the next round runs at the first tick after an arrival, a
departure the promise does not cover, an inference event, or the promise's end. Nothing else
about a run changes (every job finishes when it did; ``rounds`` counts every round,
``rounds_computed`` those run). Rounds are always run with tenant quotas (the rule runs the
policy on slices the promise does not describe), with ``--cache silod`` (the snapshot carries
caches that fill), with a rate model whose rates change between rounds (the cache modes), with
an ``on_round`` observer, and for policies without ``stable_until``.

:class:`RoundsMixin` is part of :class:`simulator.engine.Simulator`; it reads the engine's
jobs (``_active``), cluster, policy, rate model and inference pool, and owns the restart
charges (``_charges``) and the promise in force (``_promise_until``, ``_promise_departures``).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from scheduler import data_grants
from scheduler import quotas as quota_rule
from scheduler.invariants import PlanViolation
from scheduler.plan_check import PlanCheck
from scheduler.placement import placement_type
from scheduler.plan_changes import changes_between
from scheduler.policy import Allocation, ClusterSnapshot, JobInfo, Plan
from scheduler.rank_requests import within_reach
from simulator.jobs import SimJob

_EPS = 1e-9


class RoundsMixin:
    # --- known rounds ------------------------------------------------------------------

    def _init_known_rounds(self, skip: bool, verify: bool) -> None:
        self._promise_until = -math.inf       # rounds before this return the plan in force
        self._promise_departures = False      # ... also after jobs finish
        self._promise_busy: dict | None = None  # the inference GPUs busy when it was made
        self.rounds_computed = 0
        self._verify_known = verify
        self._plan_check = PlanCheck()  # the invariants, checked by what changed since the last round's plan
        self._promises = (skip or verify) and hasattr(self.policy, "stable_until") and not self.quotas \
            and self.cache_mode != "silod" and self.on_round is None and getattr(self.rate_model, "stateless", False)

    def _forget_promise(self) -> None:
        self._promise_until = -math.inf
        self._promise_departures = False

    def _inference_moved(self, t: float) -> None:
        """After inference tasks came or went at ``t`` (no training job moved): the promise stands
        while the same inference GPUs are busy (all a training policy sees of them), until the next
        replica's protect time runs out."""
        if self._promise_until == -math.inf:
            return
        if self._busy(t) != self._promise_busy:
            self._forget_promise()
        else:
            self._promise_until = min(self._promise_until, self._pool.next_change_s())

    def _known(self, t: float) -> bool:
        """Is the plan of a round at ``t`` the plan in force (promised)? With verification the
        round is run anyway, and its plan must be that one."""
        if t >= self._promise_until:
            return False
        if self._verify_known:
            self._verify_promise(t)
        return True

    def _pass_known_ticks(self, t: float) -> None:
        """Count the rounds the clock jumped over on its way to ``t`` (all promised)."""
        if not self._active or self._tick(self._round_index) >= t - _EPS:
            return
        index = self._first_tick_at_or_after(t)
        last = self._tick(index - 1)
        if last >= self._promise_until:
            raise AssertionError(f"round at t={last:.0f}s passed without a promise (until {self._promise_until})")
        self.rounds += index - self._round_index
        self._round_index = index

    def _verify_promise(self, t: float) -> None:
        snapshot = self._snapshot(t)
        plan = quota_rule.schedule(self.policy, snapshot)
        now, promised = plan.allocations, snapshot.current.allocations
        if now != promised:
            differ = sorted(j for j in set(now) | set(promised) if now.get(j) != promised.get(j))[:4]
            raise AssertionError(f"policy {self.policy_name} at t={t:.0f}s: the promised plan changed for "
                                 + "; ".join(f"{j}: {promised.get(j)} -> {now.get(j)}" for j in differ))

    def _promise(self, snapshot: ClusterSnapshot, plan: Plan, t: float) -> None:
        """Ask the policy how long ``plan`` (its answer to ``snapshot``, now in force) stands."""
        promise = self.policy.stable_until(within_reach(snapshot), plan)
        until = promise.until
        if self._tasks:  # a replica's protect time running out changes which inference GPUs are busy
            until = min(until, self._pool.next_change_s())
            self._promise_busy = self._busy(t)
        self._promise_until = until if until > t else -math.inf
        self._promise_departures = promise.departures and until > t

    # --- rounds ------------------------------------------------------------------------
    def _snapshot(self, t: float) -> ClusterSnapshot:
        infos = tuple(job.info(t) for job in self._active)
        current = Plan({j.spec.name: j.allocation for j in self._active if j.allocation is not None})
        # Only a co-designing scheduler (--cache silod) is told about the storage budget and
        # what is cached; with an independent cache the scheduler is GPU-only.
        silod = self.cache_mode == "silod"
        cached = self.rate_model.cached_bytes() if silod and hasattr(self.rate_model, "cached_bytes") else {}
        fresh = self._epoch_starts.fresh(cached, (
            (j.spec.name, j.dataset, self.rate_model.epochs_done(j.spec.name),
             [n for n, _ in j.allocation.placement] if j.allocation is not None else [])
            for j in self._active)) if silod and hasattr(self.rate_model, "epochs_done") else {}
        return ClusterSnapshot(
            time_s=t,
            nodes=self.cluster.nodes,
            jobs=infos,
            current=current,
            restart_cost_s=self.cluster.restart_cost_s,
            interval_s=self.cluster.interval_s,
            storage_bandwidth_bytes_per_s=self.cluster.storage_bandwidth_bytes_per_s if silod else math.inf,
            cached_bytes=cached,
            fresh_bytes=fresh,
            inference_busy=self._busy(t) if self._tasks else {},
            quotas=self.quotas,
        )

    def _round(self, t: float) -> None:
        self.rounds += 1
        self.rounds_computed += 1
        self._forget_promise()
        snapshot = self._snapshot(t)
        infos = snapshot.jobs
        plan = quota_rule.schedule(self.policy, snapshot)  # the policy itself when there are no quotas
        if self.cache_mode == "silod":
            # The live scheduler's data step after its policy (which jobs start without IO, the
            # spare budget): one rulebook for both worlds. The other modes' grants only label
            # quotas for the cache servers; here cacheio models those caches itself.
            plan = data_grants.grant("silod", snapshot, plan, plan, {job.job_id for job in infos}, policy_co_designs=True)
        if self.check_invariants:
            self.plans_checked += 1
            problems = self._plan_check.problems(snapshot, plan)
            if problems:
                raise PlanViolation(f"policy {self.policy_name} at t={t:.0f}s: " + "; ".join(problems))
        if self.on_round is not None:
            self.on_round(snapshot, plan)
        if self._tasks:
            if self._pool.end_lent(plan, t):  # sleepers whose GPU the plan lends to training end
                self._pool_changed()
        # Only what the plan changes is carried out (the live scheduler commits the same changes).
        changes = changes_between(snapshot.current.allocations, plan.allocations)
        stopped = set(changes.removals)
        as_planned = True  # every allocation carried out as the plan has it (its GPU type included)
        moved: list[SimJob] = []  # jobs whose allocation changed
        for job, info in zip(self._active, infos):
            if job.spec.name not in changes.upserts and job.spec.name not in stopped:
                continue  # holds what it held (or still nothing)
            new = plan.get(job.spec.name)
            if new is None or new.gpus == 0:
                as_planned &= new is None
                if job.allocation is not None:
                    self._assign(job, None, t)
                continue
            self._settle(job, t)
            if not new.same_gpus(job.allocation):
                job.restart_until = t + self._resize_cost(job, info, new)
                if job.start is None:
                    job.start = t
                else:
                    job.restarts += 1
            # The job runs at the speed of the GPUs it got, whatever type the plan names.
            kind = self._node_types.get(new.placement[0][0], "") if len(new.placement) == 1 else \
                placement_type(new.placement, self._node_types, info)
            if new.gpu_type != kind:
                new = dataclasses.replace(new, gpu_type=kind)
                as_planned = False
            if new != job.allocation:  # an unchanged allocation keeps its object (and what it has cached)
                self._assign(job, new, t)
                moved.append(job)
        self._set_rates(t, moved)
        if self._promises and as_planned:
            self._promise(snapshot, plan, t)

    def _resize_cost(self, job: SimJob, info: JobInfo, new: Allocation) -> float:
        """Seconds without progress after ``job`` moves to ``new`` (see the module docstring)."""
        if self._costs is None:
            if job.overheads is not None:
                return self._charge("launch", job.overheads.launch(new.gpus))
            return self._charge("fixed", self.cluster.restart_cost_s)
        old = job.allocation
        kept = old is not None and bool(_gpu_set(old) & _gpu_set(new))
        cost = self._costs.cost_s(info, starting=not kept, default_s=self.cluster.restart_cost_s)
        return self._charge("afe" if kept and self._costs.afe else "full", cost)

    def _charge(self, kind: str, seconds: float) -> float:
        """Count a restart cost (summary.json ``restart_charges``: what the resize model cost the jobs)."""
        entry = self._charges.setdefault(kind, [0, 0.0])
        entry[0] += 1
        entry[1] += seconds
        return seconds

    def _set_rates(self, t: float, moved: list[SimJob] | None = None) -> None:
        """Rates and completion times from ``t`` of the jobs whose allocation changed (``moved``,
        default every running job), or of every running job when the rate model's rates change
        between rounds (caches that fill): the others keep theirs."""
        stateless = getattr(self.rate_model, "stateless", False)
        jobs = [j for j in self._active if j.allocation is not None] if moved is None or not stateless \
            else [j for j in moved if j.allocation is not None]
        if not jobs:
            return
        for job in jobs:
            self._settle(job, t)
        infos = [j.info(t) for j in jobs]  # unchanged since the round's snapshot: the same objects
        rates = np.asarray(self.rate_model.rates(infos, [j.allocation for j in jobs]), dtype=float)
        if rates.shape != (len(jobs),) or not np.all(np.isfinite(rates)) or np.any(rates < 0):
            bad = next((j.spec.name for j, r in zip(jobs, np.atleast_1d(rates)) if not (r >= 0 and math.isfinite(r))), "?")
            raise ValueError(f"rate model returned an invalid rate (job {bad}): {rates!r}")
        for job, rate in zip(jobs, rates.tolist()):
            job.run_at(rate, t)
            self._expect_finish(job)


def _gpu_set(allocation: Allocation) -> set[tuple[str, int]]:
    return {(node, i) for node, indices in allocation.placement for i in indices}
