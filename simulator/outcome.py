"""What a run records and returns: the timeline point after each event, the progress an observer
sees, and the result at the end (every job's record, with the JCT it would have had alone).

:class:`OutcomeMixin` is part of :class:`simulator.engine.Simulator`; it reads the engine's jobs
(``_jobs``, ``_active``, ``_running``), cluster, policy, rate model and counters, and owns the
timeline (``_timeline``).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from scheduler.policy import Allocation
from simulator.records import JobRecord, SimProgress, SimulationResult, TimelinePoint


class OutcomeMixin:
    def progress(self) -> SimProgress:
        return SimProgress(
            time_s=self.clock.now(),
            finished=self._finished,
            total=len(self._jobs),
            active=len(self._active),
            running=len(self._running),
            rounds=self.rounds,
        )

    def result(self) -> SimulationResult:
        if not self.finished:
            raise RuntimeError("the simulation has not finished")
        isolated = self._isolated_jcts()
        records = []
        for job, iso in zip(self._jobs, isolated):
            s = job.spec
            assert job.start is not None and job.finish is not None
            run_time = job.finish - job.start
            records.append(JobRecord(
                name=s.name, application=s.application, arrival_s=s.arrival_s + self.start_s,
                start_s=job.start, finish_s=job.finish, jct_s=job.finish - (s.arrival_s + self.start_s),
                restarts=job.restarts, attained_gpu_s=job.attained,
                mean_gpus=job.attained / run_time if run_time > 0 else 0.0,
                requested_gpus=job.requested, batch_size=s.batch_size, target_samples=job.target,
                isolated_jct_s=iso, tenant=s.tenant,
            ))
        return SimulationResult(
            policy=self.policy_name, workload=self.workload.name, cluster=self.cluster, jobs=tuple(records),
            policy_options=_options_of(self.policy),
            timeline=tuple(self._timeline), rounds=self.rounds, events=self.events,
            plans_checked=self.plans_checked, start_s=self.start_s,
            cache_mode=self.cache_mode, remote_bytes_read=float(getattr(self.rate_model, "bytes_read", 0.0)),
            inference=self._inference_records(), lent_gpu_s=self._lent_gpu_s, reclaims=self._reclaims,
            protect_scale=self._protect_scale, restart_charges={k: list(v) for k, v in sorted(self._charges.items())},
            rounds_computed=self.rounds_computed,
        )

    def _record(self, t: float) -> None:
        lent = busy = 0
        if self._tasks:
            lent = sum(self._lent_of(j.allocation) for j in self._running)
            busy = sum(map(len, self._busy(t).values()))
        point = TimelinePoint(t, self._allocated, len(self._active), len(self._running), lent, busy)
        if self._timeline and self._timeline[-1].time_s == t:
            self._timeline[-1] = point
        else:
            self._timeline.append(point)

    def _isolated_jcts(self) -> list[float]:
        """Restart cost + target / goodput of each job alone with its requested GPUs, packed."""
        nodes = sorted(self.cluster.nodes, key=lambda n: (-n.gpus, n.name))
        allocations = []
        for job in self._jobs:
            placement, remaining = [], job.requested
            for node in nodes:
                take = min(node.gpus, remaining)
                placement.append((node.name, tuple(range(take))))
                remaining -= take
                if remaining == 0:
                    break
            allocations.append(Allocation(placement=tuple(sorted(placement))))
        infos = [job.info() for job in self._jobs]
        isolated = getattr(self.rate_model, "isolated_rates", self.rate_model.rates)
        rates = np.asarray(isolated(infos, allocations), dtype=float)
        return [
            self.cluster.restart_cost_s + job.target / rate if rate > 0 else math.inf
            for job, rate in zip(self._jobs, rates.tolist())
        ]


def _options_of(policy: object) -> dict:
    """A dataclass policy's options as plain values (what summary.json records)."""
    if not dataclasses.is_dataclass(policy):
        return {}
    return {f.name: getattr(policy, f.name) for f in dataclasses.fields(policy)}

