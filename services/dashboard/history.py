"""The dashboard's own memory of the cluster over time, for its charts.

The dashboard needs no Prometheus: a background task takes a compact :class:`Sample` of the
overview (:func:`services.dashboard.collect.overview`) every ``interval_s`` seconds and keeps
the last ``window_s`` seconds of them in a ring buffer of ``ceil(window_s / interval_s)``
samples; older ones fall off. A sample holds, at one time, the GPUs each job holds under the
latest plan and the idle GPUs, GPUs per tenant, the pending jobs, each job's cache hit ratio
and remote IO rate (from the cache servers' ``Stats``, over the nodes where the job has
cache) and each node's mean GPU utilisation where NVML reports it. Only jobs that hold GPUs
or cache appear in a sample, so a sample stays small on a cluster with a long job table.

The history starts empty when the dashboard starts and is lost when it stops: for longer or
shared history, scrape the services' Prometheus metrics.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Sample:
    time: float
    idle: int
    pending: int
    job_gpus: dict[str, int] = field(default_factory=dict)
    tenant_gpus: dict[str, int] = field(default_factory=dict)
    tenant_pending: dict[str, int] = field(default_factory=dict)  # a user's chart counts their tenants' only
    cache_hit: dict[str, float | None] = field(default_factory=dict)
    remote_rate: dict[str, float] = field(default_factory=dict)
    node_util: dict[str, float | None] = field(default_factory=dict)  # None: no NVML figures for its GPUs


def sample_of(data: dict[str, Any]) -> Sample:
    """The compact sample of one overview (the dict :func:`collect.overview` returns)."""
    s = Sample(time=data["generated_at"], idle=data["gpu_totals"]["idle"],
               pending=sum(1 for j in data["jobs"] if j["state"] == "pending"))
    for j in data["jobs"]:
        if j["state"] == "pending":
            s.tenant_pending[j["tenant"]] = s.tenant_pending.get(j["tenant"], 0) + 1
        if j["gpus"]:
            s.job_gpus[j["id"]] = j["gpus"]
            s.tenant_gpus[j["tenant"]] = s.tenant_gpus.get(j["tenant"], 0) + j["gpus"]
    hits: dict[str, list[float]] = {}
    for n in data["nodes"]:
        s.node_util[n["name"]] = n.get("gpu_utilization_ratio")
        cache = n["cache"]
        if not cache.get("reachable"):
            continue
        for cj in cache["jobs"]:
            s.remote_rate[cj["job_id"]] = s.remote_rate.get(cj["job_id"], 0.0) + cj["remote_io_rate_bytes_per_s"]
            hits.setdefault(cj["job_id"], []).append(cj["hit_ratio"])
    s.cache_hit = {job: sum(v) / len(v) for job, v in hits.items()}
    return s


class History:
    """A ring buffer of :class:`Sample`: at most ``ceil(window_s / interval_s)`` of them."""

    def __init__(self, window_s: float, interval_s: float) -> None:
        self.window_s = window_s
        self.interval_s = interval_s
        self.capacity = max(2, math.ceil(window_s / interval_s))
        self.samples: deque[Sample] = deque(maxlen=self.capacity)
        self.names: dict[str, tuple[str, str]] = {}  # job id -> (name, tenant), for jobs in the buffer

    def add(self, data: dict[str, Any]) -> Sample:
        sample = sample_of(data)
        self.samples.append(sample)
        for j in data["jobs"]:
            if j["id"] in sample.job_gpus or j["id"] in sample.remote_rate:
                self.names[j["id"]] = (j["name"], j["tenant"])
        live = {job for s in self.samples for job in (*s.job_gpus, *s.remote_rate)}
        for job in [k for k in self.names if k not in live]:
            del self.names[job]
        return sample

    def series(self, window_s: float | None = None) -> dict[str, Any]:
        """Column-wise series (one list per line, aligned with ``times``; null = no value then)
        over the last ``window_s`` seconds (all that is kept by default)."""
        samples = list(self.samples)
        if window_s is not None and samples:
            samples = [s for s in samples if s.time >= samples[-1].time - window_s]
        jobs = sorted({j for s in samples for j in s.job_gpus})
        tenants = sorted({t for s in samples for t in s.tenant_gpus})
        queued = sorted({t for s in samples for t in s.tenant_pending})
        cache_jobs = sorted({j for s in samples for j in s.remote_rate})
        nodes = sorted({n for s in samples for n in s.node_util})

        def info(job: str) -> dict[str, str]:
            name, tenant = self.names.get(job, ("", ""))
            return {"id": job, "name": name, "tenant": tenant}

        return {
            "interval_s": self.interval_s, "window_s": self.window_s, "capacity": self.capacity,
            "times": [s.time for s in samples],
            "idle_gpus": [s.idle for s in samples],
            "pending_jobs": [s.pending for s in samples],
            "pending_jobs_by_tenant": [{"tenant": t, "values": [s.tenant_pending.get(t, 0) for s in samples]}
                                       for t in queued],
            "gpus_by_job": [{**info(j), "values": [s.job_gpus.get(j, 0) for s in samples]} for j in jobs],
            "gpus_by_tenant": [{"tenant": t, "values": [s.tenant_gpus.get(t, 0) for s in samples]} for t in tenants],
            "cache_hit_ratio_by_job": [{**info(j), "values": [s.cache_hit.get(j) for s in samples]}
                                       for j in cache_jobs],
            "remote_io_bytes_per_s_by_job": [{**info(j), "values": [s.remote_rate.get(j) for s in samples]}
                                             for j in cache_jobs],
            "gpu_utilization_by_node": [{"node": n, "values": [s.node_util.get(n) for s in samples]}
                                        for n in nodes if any(s.node_util.get(n) is not None for s in samples)],
            "nodes_without_gpu_figures": [n for n in nodes if all(s.node_util.get(n) is None for s in samples)],
        }
