"""Summaries, per-job tables and plots of simulation results (the files in ``--out``).

Definitions (also in docs/evaluation.md):

- JCT = finish - arrival; ``avg``, ``p50``, ``p99`` over all jobs (percentiles by linear
  interpolation between order statistics, numpy's default).
- makespan = last finish - first arrival.
- GPU utilization = GPU-seconds allocated / (cluster GPUs x makespan); a job holds its GPUs
  during restarts too, so restarts count as allocated (but unproductive) time.
- finish-time fairness rho = JCT / isolated JCT, where the isolated JCT is the job alone on
  the cluster with its requested GPUs (packed) at its own batch size, plus one restart cost;
  ``rho_max`` and ``rho_mean`` over all jobs (Themis reports the maximum). With cache and IO
  the isolated job also has the whole storage budget and its nodes' cache (steady state),
  the same for every cache mode.
- remote IO utilization = bytes read from remote storage / (storage budget x makespan); 0
  when the budget is unlimited.
- inference (DeepBoot workloads): a task's wait = placed - arrival (queued for a GPU, cold
  start excluded); its start latency = wait + cold start (arrival until it runs);
  ``cold_start_share`` = tasks that started a new replica / all tasks; ``lent_gpu_hours`` =
  GPU-hours training held on inference-pool nodes; ``reclaims`` = lent GPUs taken back.
  Training figures above cover the training jobs only.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from simulator.engine import SimulationResult

JOB_COLUMNS = (
    "name", "application", "arrival_s", "start_s", "finish_s", "jct_s", "restarts", "attained_gpu_s",
    "mean_gpus", "requested_gpus", "batch_size", "isolated_jct_s", "rho",
)


INFERENCE_COLUMNS = ("name", "application", "arrival_s", "start_s", "ready_s", "finish_s", "wait_s", "cold_start", "kind")


def _r(value: float, digits: int = 6) -> float:
    return round(float(value), digits) if math.isfinite(value) else float(value)


def summary(result: SimulationResult) -> dict[str, Any]:
    jobs = result.jobs
    jct = np.array([j.jct_s for j in jobs])
    rho = np.array([j.jct_s / j.isolated_jct_s if j.isolated_jct_s > 0 else math.inf for j in jobs])
    first_arrival = min(j.arrival_s for j in jobs)
    makespan = max(j.finish_s for j in jobs) - first_arrival
    gpu_seconds = float(sum(j.attained_gpu_s for j in jobs))
    gpus = result.cluster.total_gpus
    budget = result.cluster.storage_bandwidth_bytes_per_s
    io_util = result.remote_bytes_read / (budget * makespan) if math.isfinite(budget) and makespan > 0 else 0.0
    data = {
        "policy": result.policy,
        "cache_mode": result.cache_mode,
        "policy_options": {k: list(v) if isinstance(v, tuple) else v for k, v in result.policy_options.items()},
        "workload": result.workload,
        "jobs": len(jobs),
        "avg_jct_s": _r(jct.mean(), 3),
        "p50_jct_s": _r(float(np.percentile(jct, 50)), 3),
        "p99_jct_s": _r(float(np.percentile(jct, 99)), 3),
        "max_jct_s": _r(jct.max(), 3),
        "makespan_s": _r(makespan, 3),
        "gpu_seconds_allocated": _r(gpu_seconds, 3),
        "gpu_utilization": _r(gpu_seconds / (gpus * makespan), 6) if makespan > 0 else 0.0,
        "remote_bytes_read": _r(result.remote_bytes_read, 0),
        "io_utilization": _r(io_util, 6),
        "rho_max": _r(rho.max(), 6),
        "rho_mean": _r(rho.mean(), 6),
        "restarts": int(sum(j.restarts for j in jobs)),
        "restart_charges": {k: {"count": n, "seconds": _r(sec, 3)} for k, (n, sec) in result.restart_charges.items()},
        "cluster": result.cluster.describe(),
        "rounds": result.rounds,
        "rounds_computed": result.rounds if result.rounds_computed < 0 else result.rounds_computed,
        "events": result.events,
        "plans_checked": result.plans_checked,
        "wall_time_s": _r(result.wall_time_s, 3),
        "definitions": {
            "jct": "finish - arrival (s)",
            "makespan": "last finish - first arrival (s)",
            "gpu_utilization": "GPU-seconds allocated (restarts included) / (cluster GPUs x makespan)",
            "rho": "JCT / isolated JCT; isolated = alone with the requested GPUs (packed) at the job's batch size + one restart cost",
            "io_utilization": "remote bytes read / (storage budget x makespan); 0 when the budget is unlimited",
        },
    }
    inference = inference_summary(result)
    if inference:
        data["inference"] = inference
        data["definitions"]["inference"] = ("wait = placed - arrival (cold start excluded); start latency = wait + cold start; "
                                            "cold_start_share = tasks starting a new replica / tasks")
    return data


def inference_summary(result: SimulationResult) -> dict[str, Any]:
    """Inference figures of a run with inference tasks ({} without)."""
    tasks = result.inference
    if not tasks:
        return {}
    wait = np.array([t.wait_s for t in tasks])
    latency = np.array([t.ready_s - t.arrival_s for t in tasks])
    kinds: dict[str, int] = {}
    for t in tasks:
        kinds[t.kind] = kinds.get(t.kind, 0) + 1
    return {
        "tasks": len(tasks),
        "wait_p50_s": _r(float(np.percentile(wait, 50)), 3),
        "wait_p99_s": _r(float(np.percentile(wait, 99)), 3),
        "wait_max_s": _r(float(wait.max()), 3),
        "waited_share": _r(float(np.mean(wait > 0)), 6),
        "start_latency_p50_s": _r(float(np.percentile(latency, 50)), 3),
        "start_latency_p99_s": _r(float(np.percentile(latency, 99)), 3),
        "cold_start_share": _r(float(np.mean([t.cold_start for t in tasks])), 6),
        "decisions": dict(sorted(kinds.items())),
        "reclaims": result.reclaims,
        "lent_gpu_hours": _r(result.lent_gpu_s / 3600.0, 3),
        "protect_scale": result.protect_scale,
    }


def write_inference_csv(result: SimulationResult, path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(INFERENCE_COLUMNS)
        for t in result.inference:
            writer.writerow((t.name, t.application, _r(t.arrival_s), _r(t.start_s), _r(t.ready_s), _r(t.finish_s),
                             _r(t.wait_s), int(t.cold_start), t.kind))


def write_jobs_csv(result: SimulationResult, path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(JOB_COLUMNS)
        for j in result.jobs:
            rho = j.jct_s / j.isolated_jct_s if j.isolated_jct_s > 0 else math.inf
            writer.writerow((
                j.name, j.application, _r(j.arrival_s), _r(j.start_s), _r(j.finish_s), _r(j.jct_s), j.restarts,
                _r(j.attained_gpu_s), _r(j.mean_gpus), j.requested_gpus, j.batch_size, _r(j.isolated_jct_s), _r(rho),
            ))


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf(values: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    x = np.sort(np.asarray(values, dtype=float))
    return x, np.arange(1, len(x) + 1) / len(x)


def plot_jct_cdf(results: Sequence[SimulationResult], path: Path, title: str | None = None) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for result in results:
        x, y = _cdf([j.jct_s for j in result.jobs])
        avg = float(np.mean(x))
        ax.step(x, y, where="post", label=f"{result.policy} (avg {avg:,.0f} s)")
    ax.set_xscale("log")
    ax.set_xlabel("job completion time (s, log scale)")
    ax.set_ylabel("fraction of jobs")
    ax.set_ylim(0, 1.02)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(title or f"JCT CDF: {results[0].workload}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_utilization(result: SimulationResult, path: Path) -> None:
    plt = _pyplot()
    gpus = result.cluster.total_gpus
    t = np.array([p.time_s for p in result.timeline]) / 3600.0
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.step(t, [p.allocated_gpus / gpus for p in result.timeline], where="post", label="GPUs allocated (fraction)")
    ax.set_xlabel("simulated time (h)")
    ax.set_ylabel("fraction of GPUs allocated")
    ax.set_ylim(0, 1.05)
    ax.grid(True, alpha=0.3)
    other = ax.twinx()
    other.step(t, [p.active_jobs for p in result.timeline], where="post", color="tab:orange", alpha=0.7, label="active jobs")
    other.set_ylabel("active jobs")
    lines = ax.get_lines() + other.get_lines()
    ax.legend(lines, [line.get_label() for line in lines], loc="upper right")
    s = summary(result)
    ax.set_title(f"{result.policy} on {result.workload}: utilization {s['gpu_utilization']:.1%}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(result: SimulationResult, out: str | Path, *, plots: bool = True) -> dict[str, Any]:
    """summary.json, jobs.csv and (unless ``plots`` is off) jct_cdf.png, utilization.png in ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    data = summary(result)
    (out / "summary.json").write_text(json.dumps(data, indent=2) + "\n")
    write_jobs_csv(result, out / "jobs.csv")
    if result.inference:
        write_inference_csv(result, out / "inference.csv")
    if plots:
        plot_jct_cdf([result], out / "jct_cdf.png")
        plot_utilization(result, out / "utilization.png")
    return data


_TABLE = (
    ("policy", "policy", "{}"),
    ("cache", "cache_mode", "{}"),
    ("avg JCT (s)", "avg_jct_s", "{:,.0f}"),
    ("p50 JCT (s)", "p50_jct_s", "{:,.0f}"),
    ("p99 JCT (s)", "p99_jct_s", "{:,.0f}"),
    ("makespan (s)", "makespan_s", "{:,.0f}"),
    ("GPU util.", "gpu_utilization", "{:.1%}"),
    ("IO util.", "io_utilization", "{:.1%}"),
    ("rho max", "rho_max", "{:.2f}"),
    ("rho mean", "rho_mean", "{:.2f}"),
    ("restarts", "restarts", "{}"),
    ("wall time (s)", "wall_time_s", "{:.1f}"),
)


_INFERENCE_TABLE = (
    ("inf. wait p50 (s)", "wait_p50_s", "{:.2f}"),
    ("inf. wait p99 (s)", "wait_p99_s", "{:.2f}"),
    ("inf. start p99 (s)", "start_latency_p99_s", "{:.2f}"),
    ("cold starts", "cold_start_share", "{:.1%}"),
    ("reclaims", "reclaims", "{}"),
    ("lent GPU-h", "lent_gpu_hours", "{:,.1f}"),
)


def compare_table(summaries: Sequence[dict[str, Any]]) -> str:
    """A Markdown table, one row per policy (and cache mode; those columns only when a run had cache or an IO budget)."""
    data_aware = any(s.get("cache_mode", "none") != "none" or s.get("io_utilization", 0.0) > 0 for s in summaries)
    table = [c for c in _TABLE if data_aware or c[1] not in ("cache_mode", "io_utilization")]
    head = "| " + " | ".join(h for h, _, _ in table) + " |"
    rule = "|" + "|".join("---" if k in ("policy", "cache_mode") else "---:" for _, k, _ in table) + "|"
    rows = ["| " + " | ".join(fmt.format(s.get(k, "")) for _, k, fmt in table) + " |" for s in summaries]
    if any("inference" in s for s in summaries):  # DeepBoot: inference beside training
        extra = [(h, k, fmt) for h, k, fmt in _INFERENCE_TABLE]
        head = head + " " + " | ".join(h for h, _, _ in extra) + " |"
        rule = rule + "|".join("---:" for _ in extra) + "|"
        rows = [row + " " + " | ".join(fmt.format(s.get("inference", {}).get(k, float("nan"))) for _, k, fmt in extra) + " |"
                for row, s in zip(rows, summaries)]
    return "\n".join([head, rule, *rows])


def write_compare(results: Sequence[SimulationResult], out: str | Path, *, plots: bool = True) -> dict[str, Any]:
    """Per-policy outputs in ``out/<policy>/`` plus compare.md, compare.json and compare.png in ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    summaries = [write_outputs(r, out / r.policy, plots=plots) for r in results]
    first = results[0]
    data = {
        "workload": first.workload,
        "cluster": first.cluster.describe(),
        "policies": {s["policy"]: {k: v for k, v in s.items() if k not in ("cluster", "definitions")} for s in summaries},
    }
    (out / "compare.json").write_text(json.dumps(data, indent=2) + "\n")
    c = first.cluster
    text = (
        f"# {first.workload}: {', '.join(r.policy for r in results)}\n\n"
        f"Cluster: {len(c.nodes)} nodes, {c.total_gpus} GPUs, {c.interval_s:g} s rounds, {c.restart_cost_s:g} s restart cost; "
        f"{len(first.jobs)} jobs.\n\n{compare_table(summaries)}\n"
    )
    (out / "compare.md").write_text(text)
    if plots:
        plot_jct_cdf(results, out / "compare.png", title=f"JCT CDF: {first.workload}")
    return data
