"""What the dashboard shows, gathered from the metadata service and the nodes' cache servers.

One call, :func:`overview`, builds a JSON-ready dict per page refresh. It only reads: the
latest plan tells which job holds which GPU (a training job on an inference-pool node is a
*lent* GPU; a GPU with a fault is *faulted*, whoever the plan still names), the nodes carry
their GPUs' NVML figures (none for emulated GPUs), the job table gives state and progress, each node's cache server answers
``Stats`` for hit ratios and remote IO, and the plan history comes from ``ListPlans``.

A cache server that does not answer within ``cache_timeout_s`` is shown as unreachable
rather than delaying or failing the page: the dashboard is for looking at a cluster that
may be partly broken.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from silod.v1 import cache_pb2, common_pb2, metadata_pb2, metadata_pb2_grpc, plan_pb2

CacheStats = Callable[[str], Awaitable[cache_pb2.StatsResponse]]  # cache address -> Stats reply

POOLS = {common_pb2.NODE_POOL_TRAINING: "training", common_pb2.NODE_POOL_INFERENCE: "inference"}


def _state_name(state: int) -> str:
    return common_pb2.JobState.Name(state).removeprefix("JOB_STATE_").lower()


def _ts(stamp: Any) -> float | None:
    return stamp.ToDatetime().timestamp() if stamp.ByteSize() else None


async def _all_jobs(md: metadata_pb2_grpc.MetadataServiceStub, limit: int) -> list[common_pb2.Job]:
    jobs: list[common_pb2.Job] = []
    token = ""
    while len(jobs) < limit:
        page = await md.ListJobs(metadata_pb2.ListJobsRequest(page_size=min(1000, limit), page_token=token))
        jobs.extend(page.jobs)
        token = page.next_page_token
        if not token:
            break
    return jobs[:limit]


async def _latest_plan(md: metadata_pb2_grpc.MetadataServiceStub) -> plan_pb2.AllocationPlan | None:
    try:
        return await md.GetLatestPlan(metadata_pb2.GetLatestPlanRequest())
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.NOT_FOUND:
            return None  # no round has committed a plan yet
        raise


def gpu_holders(plan: plan_pb2.AllocationPlan | None) -> dict[tuple[str, int], str]:
    """(node, GPU index) -> job id holding it under ``plan``."""
    holders: dict[tuple[str, int], str] = {}
    if plan is None:
        return holders
    for job in plan.jobs:
        for placement in job.placements:
            for index in placement.gpu_indices:
                holders[(placement.node, index)] = job.job_id
    for replica in plan.replicas:
        holders.setdefault((replica.node, replica.gpu_index), f"inference:{replica.application}")
    return holders


def _cache_summary(stats: cache_pb2.StatsResponse) -> dict[str, Any]:
    hits = sum(t.hits for t in stats.tiers)
    lookups = hits + (stats.tiers[-1].misses if stats.tiers else 0)
    return {
        "reachable": True,
        "plan_version": stats.plan_version,
        "tiers": [{"tier": t.tier, "used_bytes": t.used_bytes, "capacity_bytes": t.capacity_bytes,
                   "hits": t.hits, "misses": t.misses} for t in stats.tiers],
        # A lookup that misses memory and hits disk is one hit; only the last tier's misses went remote.
        "hit_ratio": hits / lookups if lookups else None,
        "remote_bytes": sum(j.remote_bytes for j in stats.jobs),
        "remote_rate_bytes_per_s": sum(j.remote_io_rate_bytes_per_s for j in stats.jobs),
        "jobs": [{"job_id": j.job_id, "dataset": j.dataset, "quota_bytes": j.quota_bytes,
                  "cached_bytes": j.cached_bytes, "hit_ratio": j.hit_ratio,
                  "remote_io_limit_bytes_per_s": j.remote_io_limit_bytes_per_s,
                  "remote_io_rate_bytes_per_s": j.remote_io_rate_bytes_per_s} for j in stats.jobs],
    }


async def _cache_of(address: str, stats_of: CacheStats, timeout_s: float) -> dict[str, Any]:
    if not address:
        return {"reachable": False, "error": "no cache server on this node"}
    try:
        return _cache_summary(await asyncio.wait_for(stats_of(address), timeout_s))
    except (grpc.aio.AioRpcError, asyncio.TimeoutError, OSError) as exc:
        detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else type(exc).__name__
        return {"reachable": False, "error": f"{address}: {detail}"}


_FIGURES = ("utilization_ratio", "memory_used_bytes", "memory_total_bytes", "temperature_celsius",
            "ecc_uncorrectable_errors")


def _figures(t: common_pb2.GpuTelemetry) -> dict[str, Any]:
    """One GPU's NVML figures; those NVML does not give for it are left out."""
    return {name: getattr(t, name) for name in _FIGURES if t.HasField(name)} | ({"lost": True} if t.lost else {})


def _node_figures(telemetry: Any) -> dict[str, Any]:
    """A node's mean GPU utilisation and its GPUs' memory; None without NVML figures."""
    utils = [t.utilization_ratio for t in telemetry if t.HasField("utilization_ratio")]
    totals = [t.memory_total_bytes for t in telemetry if t.HasField("memory_total_bytes")]
    return {
        "gpu_utilization_ratio": sum(utils) / len(utils) if utils else None,
        "gpu_memory_used_bytes": sum(t.memory_used_bytes for t in telemetry if t.HasField("memory_used_bytes"))
        if totals else None,
        "gpu_memory_total_bytes": sum(totals) if totals else None,
    }


async def overview(md: metadata_pb2_grpc.MetadataServiceStub, stats_of: CacheStats, *,
                   liveness_window_s: float, cache_timeout_s: float = 1.0, plan_history: int = 20,
                   job_limit: int = 500) -> dict[str, Any]:
    nodes_reply, jobs, plan, plans = await asyncio.gather(
        md.ListNodes(metadata_pb2.ListNodesRequest(liveness_window_s=liveness_window_s)),
        _all_jobs(md, job_limit),
        _latest_plan(md),
        md.ListPlans(metadata_pb2.ListPlansRequest(page_size=plan_history)),
    )
    nodes = sorted(nodes_reply.nodes, key=lambda n: n.spec.name)
    holders = gpu_holders(plan)
    names = {j.id: j.spec.name for j in jobs}
    caches = await asyncio.gather(*(_cache_of(n.spec.cache_address if n.alive else "", stats_of, cache_timeout_s)
                                    for n in nodes))
    node_rows = []
    for node, cache in zip(nodes, caches):
        pool = POOLS.get(node.spec.pool, "training")
        figures = {t.index: _figures(t) for t in node.gpu_telemetry}  # NVML; none for emulated GPUs
        faults = {f.index: f for f in node.gpu_faults}
        gpus = []
        for index in range(node.spec.gpus):
            holder = holders.get((node.spec.name, index), "")
            kind = "idle"
            if index in faults:  # its job, if any, is being moved off it
                kind = "faulted"
            elif holder.startswith("inference:"):
                kind = "inference"
            elif holder:
                kind = "lent" if pool == "inference" else "training"
            fault = faults.get(index)
            gpus.append({"index": index, "holder": holder, "job_name": names.get(holder, ""), "use": kind,
                         "fault": fault.reason if fault else "", "fault_since": _ts(fault.since) if fault else None,
                         **figures.get(index, {})})
        node_rows.append({
            "name": node.spec.name, "pool": pool, "gpu_type": node.spec.gpu_type, "alive": node.alive, "gpus": gpus,
            "applied_plan_version": node.applied_plan_version,
            "last_heartbeat": _ts(node.last_heartbeat), "cache": cache, **_node_figures(node.gpu_telemetry),
        })
    allocated = {}
    if plan is not None:
        for entry in plan.jobs:
            allocated[entry.job_id] = sum(len(p.gpu_indices) for p in entry.placements)
    job_rows = [{
        "id": j.id, "name": j.spec.name, "state": _state_name(j.state), "tenant": j.spec.tenant or "default",
        "gpus": allocated.get(j.id, 0), "min_gpus": j.spec.min_gpus, "max_gpus": j.spec.max_gpus,
        "fraction_done": j.progress.fraction_done, "samples_done": j.progress.samples_done,
        "throughput_samples_per_s": j.progress.throughput_samples_per_s,
        "cache_hit_ratio": j.progress.cache_hit_ratio, "dataset": j.spec.dataset,
        "created_at": _ts(j.created_at), "finished_at": _ts(j.finished_at), "message": j.message,
    } for j in jobs]
    plan_rows = [{
        "version": p.version, "created_at": _ts(p.created_at), "policy": p.policy, "cache_mode": p.cache_mode,
        "reason": p.reason, "jobs_placed": sum(1 for j in p.jobs if j.placements),
        "gpus_used": sum(len(pl.gpu_indices) for j in p.jobs for pl in j.placements),
        "loans": len(p.loans),
    } for p in plans.plans]
    totals = {use: sum(1 for n in node_rows for g in n["gpus"] if g["use"] == use)
              for use in ("idle", "training", "lent", "inference", "faulted")}
    return {"generated_at": time.time(), "latest_plan_version": plan.version if plan is not None else 0,
            "gpu_totals": totals, "nodes": node_rows, "jobs": job_rows, "plans": plan_rows}


# --- one job's page -------------------------------------------------------------------------

async def _job_events(md: metadata_pb2_grpc.MetadataServiceStub, job_id: str, limit: int) -> list[common_pb2.JobEvent]:
    events: list[common_pb2.JobEvent] = []
    after = 0
    while len(events) < limit:
        want = min(1000, limit - len(events))
        page = await md.ListJobEvents(metadata_pb2.ListJobEventsRequest(job_id=job_id, after_sequence=after,
                                                                        limit=want))
        events.extend(page.events)
        if len(page.events) < want:
            break
        after = page.events[-1].sequence
    return events[:limit]


async def _job_plans(md: metadata_pb2_grpc.MetadataServiceStub, job_id: str, since: float | None,
                     max_plans: int) -> list[dict[str, Any]]:
    """The job's GPU count and generation in every plan since ``since`` (oldest first), read
    newest first from ``ListPlans`` until a plan older than the job or ``max_plans`` plans."""
    rows: list[dict[str, Any]] = []
    token, seen = "", 0
    while seen < max_plans:
        page = await md.ListPlans(metadata_pb2.ListPlansRequest(page_size=min(100, max_plans - seen), page_token=token))
        done = False
        for p in page.plans:
            seen += 1
            created = _ts(p.created_at)
            if since is not None and created is not None and created < since - 1:
                done = True
                break
            entry = next((j for j in p.jobs if j.job_id == job_id), None)
            rows.append({"version": p.version, "created_at": created, "reason": p.reason,
                         "gpus": sum(len(pl.gpu_indices) for pl in entry.placements) if entry else 0,
                         "generation": entry.generation if entry else 0,
                         "nodes": sorted({pl.node for pl in entry.placements if pl.gpu_indices}) if entry else []})
        token = page.next_page_token
        if done or not token:
            break
    rows.reverse()
    return rows


async def _job_metric(md: metadata_pb2_grpc.MetadataServiceStub, job_id: str, name: str,
                      limit: int) -> dict[str, list[float]]:
    reply = await md.QueryMetrics(metadata_pb2.QueryMetricsRequest(job_id=job_id, name=name, limit=limit))
    samples = sorted(((s.time.ToDatetime().timestamp(), s.value) for s in reply.samples), key=lambda x: x[0])
    return {"times": [t for t, _ in samples], "values": [v for _, v in samples]}


async def job_detail(md: metadata_pb2_grpc.MetadataServiceStub, job_id: str, *, max_events: int = 2000,
                     max_plans: int = 500, max_samples: int = 2000) -> dict[str, Any]:
    """What the job's page shows: the job, its events, its GPUs per plan version, its measured
    throughput. Raises the metadata service's ``AioRpcError`` (NOT_FOUND for an unknown job)."""
    job = await md.GetJob(metadata_pb2.GetJobRequest(job_id=job_id))
    created = _ts(job.created_at)
    events, plans, samples_per_s, step_time_s = await asyncio.gather(
        _job_events(md, job_id, max_events), _job_plans(md, job_id, created, max_plans),
        _job_metric(md, job_id, "samples_per_s", max_samples), _job_metric(md, job_id, "step_time_s", max_samples))
    # Only the plans where the job's GPUs or generation changed (and the newest): its resizes.
    changes: list[dict[str, Any]] = []
    for row in plans:
        if not changes or (row["gpus"], row["generation"]) != (changes[-1]["gpus"], changes[-1]["generation"]):
            changes.append(row)
    if plans and changes[-1] is not plans[-1]:
        changes.append(plans[-1])
    return {
        "job": {"id": job.id, "name": job.spec.name, "state": _state_name(job.state),
                "tenant": job.spec.tenant or "default", "application": job.spec.application,
                "dataset": job.spec.dataset, "min_gpus": job.spec.min_gpus, "max_gpus": job.spec.max_gpus,
                "gpus": job.allocated.gpus, "fraction_done": job.progress.fraction_done,
                "samples_done": job.progress.samples_done,
                "throughput_samples_per_s": job.progress.throughput_samples_per_s,
                "cache_hit_ratio": job.progress.cache_hit_ratio, "message": job.message,
                "created_at": created, "started_at": _ts(job.started_at), "finished_at": _ts(job.finished_at)},
        "events": [{"sequence": e.sequence, "time": _ts(e.time), "type": e.type,
                    "from_state": _state_name(e.from_state) if e.type == "state" and e.from_state else "",
                    "to_state": _state_name(e.to_state) if e.type == "state" else "",
                    "message": e.message} for e in events],
        "plans": changes, "plans_scanned": len(plans),
        "metrics": {"samples_per_s": samples_per_s, "step_time_s": step_time_s},
        "logs_command": f"silod logs {job.id}",
    }
