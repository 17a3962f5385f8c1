"""The live scheduler at cluster scale: real metadata and scheduler processes, and a node fleet
(worker_agent/fleet.py) of ``--nodes`` emulated nodes, every one registered, heartbeating and
watching its plans, with ranks that report progress and finish.

    .venv/bin/python benchmarks/live_scale.py --nodes 1000 --jobs 5000 --policy fifo [--postgres] [--json F]

For each ``--policy`` (comma-separated), on a fresh database:

1. metadata and scheduler (``--interval-s``) start; one job per application goes through a
   round and is cancelled (profiles are fitted once, at start-up); ``--jobs`` minus
   ``--measure-jobs`` jobs are queued (there are no nodes yet, so nothing is placed);
2. the fleet starts and registers; the other ``--measure-jobs`` jobs are submitted over gRPC,
   ``--concurrency`` at a time, while rounds run (each arrival triggers one, and the first
   places the queue): the submission rate as the nodes join is measured here, at the busiest
   moment of the run (a first round places thousands of jobs, whose ranks all start and report);
3. ``--measure-s`` seconds of steady running follow: ranks finish after ``--task-seconds``
   (times 1 +- ``--task-spread``, by job), so rounds have completions to commit and pending
   jobs to place; ``--steady-after-s``
   into it, ``--steady-jobs`` more jobs are submitted and timed: the rate in steady running.

It reads the scheduler's own round histogram (``silod_scheduler_round_duration_seconds`` by
phase, from its ``/metrics``) over phases 2 and 3, the fleet's receive and ack times of every
plan against the plan's creation time in the metadata store, and each process's CPU time and
resident memory (Linux /proc). Each target prints MET or MISSED with its value. On a machine
of few cores every process competes with the fleet's own CPU (reported too): the fleet and the
client stand in for a thousand machines and their users, and ``--pin-scheduler`` keeps them, and
the metadata service, off the scheduler's CPU, as a deployment's own host for it would.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import grpc
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.live_scheduler import _spec, cpu_seconds, warm_up  # noqa: E402
from scheduler.live import convert  # noqa: E402
from silod.launcher import start_service  # noqa: E402
from silod.rpc.channels import open_channel  # noqa: E402
from silod.v1 import (  # noqa: E402
    common_pb2, metadata_pb2, metadata_pb2_grpc, plan_pb2, scheduler_pb2, scheduler_pb2_grpc)
from worker_agent.fleet import FleetSettings, start_fleet  # noqa: E402

ROUND_TARGET_S = {"fifo": 1.0, "sjf": 1.0, "tiresias": 1.0, "gavel": 2.0, "pollux": 2.0}
ACK_TARGET_S = 2.0
RETRIES = [0]  # submissions that timed out and were sent again
SUBMIT_TARGET = 300.0


def rss_mib(pid: int) -> tuple[float, float]:
    """(resident now, peak resident) MiB of process ``pid`` (Linux /proc)."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def exited(pid: int) -> bool:
    """Has process ``pid`` ended (gone, or a zombie its parent has not reaped)?"""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "VmRSS:" not in status


def pin(pid: int, cpus: set[int]) -> None:
    """Run every thread of process ``pid`` on ``cpus`` (threads it starts later inherit it)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        os.sched_setaffinity(int(task.name), cpus)


ROUNDS = "silod_scheduler_round_duration_seconds"
LOOP_LAG = "silod_event_loop_lag_seconds"
GC_PAUSES = "silod_gc_pause_seconds"


def histograms(port: int) -> dict[str, dict[tuple[str, str], float]]:
    """Every histogram of the process serving /metrics on ``port``: name -> {(series, phase): value},
    series "count", "sum" or "bucket le=X", phase the ``phase`` label ("" without one; other labels
    summed)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict[str, dict[tuple[str, str], float]] = {}
    for family in text_string_to_metric_families(text):
        if family.type != "histogram":
            continue
        series = out.setdefault(family.name, {})
        for sample in family.samples:
            suffix = sample.name[len(family.name) + 1:]
            if suffix not in ("bucket", "count", "sum"):
                continue  # _created
            key = (f"bucket le={sample.labels['le']}" if suffix == "bucket" else suffix, sample.labels.get("phase", ""))
            series[key] = series.get(key, 0.0) + sample.value
    return out


def _p99_at_most(before: dict, after: dict, phase: str, count: float) -> float | None:
    """The smallest bucket bound holding 99 % of the observations between two scrapes."""
    bounds = sorted((float(k.split("=")[1]), k) for k, p in after if k.startswith("bucket le=") and p == phase)
    return next((b for b, k in bounds if count and after[(k, phase)] - before.get((k, phase), 0.0) >= 0.99 * count),
                None)


def lag_figures(before: dict, after: dict) -> dict[str, Any]:
    """Loop-lag probes between two scrapes: how many, the mean lag, and a bound on the p99."""
    count = after.get(("count", ""), 0.0) - before.get(("count", ""), 0.0)
    total = after.get(("sum", ""), 0.0) - before.get(("sum", ""), 0.0)
    return {"probes": int(count), "mean_s": round(total / count, 4) if count else None,
            "p99_s_at_most": _p99_at_most(before, after, "", count)}


def gc_figures(before: dict, after: dict, span_s: float) -> dict[str, Any]:
    """The garbage collector between two scrapes: seconds, collections, share of the span."""
    seconds = after.get(("sum", ""), 0.0) - before.get(("sum", ""), 0.0)
    return {"seconds": round(seconds, 2),
            "collections": int(after.get(("count", ""), 0.0) - before.get(("count", ""), 0.0)),
            "share_of_wall_time": round(seconds / span_s, 3)}


def round_figures(before: dict, after: dict) -> dict[str, Any]:
    """Rounds between two scrapes: count, mean per phase, and the smallest bucket bound that
    holds 99 % of whole rounds (an upper bound on their p99)."""
    def delta(key: str, phase: str) -> float:
        return after.get((key, phase), 0.0) - before.get((key, phase), 0.0)

    count = delta("count", "total")
    figures: dict[str, Any] = {"rounds": int(count)}
    for phase in ("snapshot", "policy", "commit", "total"):
        n = delta("count", phase)
        figures[f"mean_{phase}_s"] = round(delta("sum", phase) / n, 3) if n else None
    figures["p99_total_s_at_most"] = _p99_at_most(before, after, "total", count)
    return figures


def _empty_part(node: str, plan: plan_pb2.AllocationPlan) -> plan_pb2.NodePlan:
    return plan_pb2.NodePlan(version=plan.version, node=node, epoch=plan.epoch)


def _consecutive_plans(md: Any, oldest: int) -> Iterator[tuple[plan_pb2.AllocationPlan, plan_pb2.AllocationPlan]]:
    """(plan v-1, plan v) for every v whose plan and predecessor the store still holds, from the
    newest down to v-1 = ``oldest``: ListPlans rebuilds a page of plans in one pass over the stored
    changes, where a GetPlan per version rebuilt each from the nearest whole plan (a fifth of the
    metadata service's time at 1,000 nodes). A page at a time, so a long run's plans are never all
    held at once."""
    newer: plan_pb2.AllocationPlan | None = None
    token = ""
    while True:
        page = md.ListPlans(metadata_pb2.ListPlansRequest(page_size=10, page_token=token))
        for plan in page.plans:  # newest first
            if newer is not None and plan.version == newer.version - 1:
                yield plan, newer
            if plan.version <= oldest:
                return
            newer = plan
        token = page.next_page_token
        if not token:
            return


def ack_figures(metadata_addr: str, plans: dict[str, Any]) -> dict[str, Any]:
    """Seconds from a plan's creation (set by the scheduler just before it commits it) until each
    node whose part it changed acked it or a newer plan (a node busy applying one plan applies
    only the newest of those that arrived meanwhile, as the agent does), over the plans every such
    node got that far with. A node is sent the plans that change its part only: the others have
    nothing to apply. Which nodes a plan changed is worked out from the store's plans."""
    acked_at: dict[int, dict[str, float]] = {int(v): dict(t.get("acked", {})) for v, t in plans.items()}
    received_at: dict[int, dict[str, float]] = {int(v): dict(t.get("received", {})) for v, t in plans.items()}

    def first_at(times: dict[int, dict[str, float]], version: int, node: str) -> float | None:
        seen = [t[node] for v, t in times.items() if v >= version and node in t]
        return min(seen) if seen else None

    per_node: list[float] = []
    per_plan: list[float] = []
    received_by_all: list[float] = []  # plan to the last changed node's receipt (the fan-out)
    changed_nodes: list[int] = []
    unacked: list[dict[str, int]] = []  # plans some changed node never acked (nor a newer one)
    with open_channel(metadata_addr, default_timeout_s=30) as channel:
        md = metadata_pb2_grpc.MetadataServiceStub(channel)
        versions = sorted(acked_at)
        last: tuple[int, dict[str, plan_pb2.NodePlan]] | None = None  # the older plan of the pair before
        for older, plan in _consecutive_plans(md, versions[0] - 1) if versions else ():
            version = plan.version
            views = last[1] if last and last[0] == version else convert.node_plans(plan, {}, {})
            previous = convert.node_plans(older, {}, {})
            last = (older.version, previous)
            if version > versions[-1]:
                continue
            due = [n for n in set(views) | set(previous)
                   if not convert.same_node_part(views.get(n) or _empty_part(n, plan),
                                                 previous.get(n) or _empty_part(n, plan))]
            if not due:
                continue
            acks = [first_at(acked_at, version, n) for n in due]
            if any(t is None for t in acks):
                unacked.append({"version": version, "changed_nodes": len(due),
                                "unacked_nodes": sum(t is None for t in acks)})
                continue  # some node did not get that far while it was measured
            created = plan.created_at.ToNanoseconds() / 1e9
            lags = [t - created for t in acks if t is not None]
            per_node.extend(lags)
            per_plan.append(max(lags))
            changed_nodes.append(len(due))
            receipts = [first_at(received_at, version, n) for n in due]
            if all(t is not None for t in receipts):
                received_by_all.append(max(t for t in receipts if t is not None) - created)

    unacked.sort(key=lambda plan: plan["version"])  # listed newest first

    def pct(values: list[float], q: float) -> float | None:
        return round(sorted(values)[min(len(values) - 1, int(q * len(values)))], 3) if values else None

    return {"plans_fully_acked": len(per_plan), "plans_not_fully_acked": unacked, "nodes_changed_per_plan_mean": round(sum(changed_nodes) / len(changed_nodes))
            if changed_nodes else None, "node_ack_p50_s": pct(per_node, 0.5), "node_ack_p99_s": pct(per_node, 0.99),
            "all_nodes_acked_p50_s": pct(per_plan, 0.5), "all_nodes_acked_p99_s": pct(per_plan, 0.99),
            "all_nodes_acked_max_s": round(max(per_plan), 3) if per_plan else None,
            "all_nodes_received_p50_s": pct(received_by_all, 0.5), "all_nodes_received_p99_s": pct(received_by_all, 0.99)}


async def submit(address: str, jobs: int, concurrency: int, tag: str = "") -> tuple[list[str], float]:
    """Submit ``jobs`` jobs, ``concurrency`` in flight on one channel; (ids, seconds)."""
    channel = open_channel(address, aio=True, default_timeout_s=120)
    stub = scheduler_pb2_grpc.JobServiceStub(channel)
    ids = [""] * jobs
    todo = iter(range(jobs))

    async def submitter() -> None:
        for i in todo:
            request = scheduler_pb2.SubmitJobRequest(spec=_spec(i), client_request_id=f"scale-{tag}{i}")
            while True:  # a timed-out submission is retried with its id: it creates one job either way
                try:
                    ids[i] = (await stub.SubmitJob(request)).id
                    break
                except grpc.aio.AioRpcError as exc:
                    if exc.code() not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE):
                        raise
                    RETRIES[0] += 1

    try:
        started = time.perf_counter()
        await asyncio.gather(*(submitter() for _ in range(concurrency)))
        return ids, time.perf_counter() - started
    finally:
        await channel.close()


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def postgres_database(stack: ExitStack) -> str:
    """A scratch database on PostgreSQL at 127.0.0.1:5432 (user postgres), dropped at the end."""
    import psycopg2
    from psycopg2 import sql

    def admin(statement: Any) -> None:
        connection = psycopg2.connect(host="127.0.0.1", port=5432, user="postgres", dbname="postgres")
        try:
            connection.autocommit = True
            with connection.cursor() as cursor:
                cursor.execute(statement)
        finally:
            connection.close()

    name = f"silod_bench_{os.getpid()}_{secrets.token_hex(4)}"
    admin(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    stack.callback(admin, sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
    return f"postgresql://postgres@127.0.0.1:5432/{name}"


def run_policy(args: argparse.Namespace, policy: str, workdir: Path) -> dict[str, Any]:
    result: dict[str, Any] = {"policy": policy, "nodes": args.nodes, "gpus_per_node": 8, "jobs": args.jobs,
                              "database": "postgresql" if args.postgres else "sqlite"}
    all_cpus = os.sched_getaffinity(0)
    if args.pin_scheduler:  # this process, and so the metadata service and the fleet it starts, off the first CPU
        scheduler_cpus = {min(all_cpus)}
        pin(os.getpid(), all_cpus - scheduler_cpus)
        result["scheduler_cpus"] = sorted(scheduler_cpus)
    with ExitStack() as stack:
        if args.pin_scheduler:
            stack.callback(pin, os.getpid(), all_cpus)
        db = postgres_database(stack) if args.postgres else f"sqlite:///{workdir / 'm.db'}"
        md_port = _free_port()
        md = stack.enter_context(start_service("metadata", "--db", db, "--log-level", args.log_level, "--metrics-port",
                                               str(md_port), "--metrics-host", "127.0.0.1", workdir=workdir))
        port = _free_port()
        sch = stack.enter_context(start_service(
            "scheduler", "--metadata-address", md.address, "--policy", policy, "--interval-s", f"{args.interval_s:g}",
            "--node-timeout-s", f"{max(15.0, 3 * args.heartbeat_s):g}", "--metrics-port", str(port),
            "--metrics-host", "127.0.0.1", "--log-level", args.log_level, workdir=workdir))
        if args.pin_scheduler:
            pin(sch.pid, scheduler_cpus)
        watched = sch.address  # what the fleet's nodes watch, ack and report at
        if args.allocation:  # the deployments' topology: the nodes' calls apart from the rounds
            alloc_port = _free_port()
            alloc = stack.enter_context(start_service(
                "allocation", "--metadata-address", md.address, "--scheduler-address", sch.address,
                "--metrics-port", str(alloc_port), "--metrics-host", "127.0.0.1", "--log-level", args.log_level,
                workdir=workdir))
            watched = alloc.address
            result["allocation_service"] = True
            if args.pin_allocation:
                pin(alloc.pid, scheduler_cpus)
                result["allocation_cpus"] = sorted(scheduler_cpus)
        warm_up(sch.address, md.address)
        preload = max(0, args.jobs - args.measure_jobs)
        if preload:  # before the fleet: queued, not yet placed (there are no nodes)
            t = time.monotonic()
            asyncio.run(submit(sch.address, preload, args.concurrency, "pre"))
            result["preload"] = {"jobs": preload, "seconds": round(time.monotonic() - t, 1)}
        started = time.monotonic()
        fleet = start_fleet(FleetSettings(
            nodes=args.nodes, gpus=8, metadata_address=md.address, scheduler_address=watched,
            heartbeat_s=args.heartbeat_s, report_s=args.report_s, task_seconds=args.task_seconds,
            task_spread=args.task_spread), workdir / "fleet",
            timeout_s=max(300.0, 0.5 * args.nodes))
        stack.callback(fleet.terminate)
        result["fleet_start_s"] = round(time.monotonic() - started, 1)
        pids = {"scheduler": sch.pid, "metadata": md.pid, "fleet": fleet.pid}
        if args.allocation:
            pids["allocation"] = alloc.pid
        cpu0 = {k: cpu_seconds(p) for k, p in pids.items()}
        before, md_before = histograms(port), histograms(md_port)
        t0 = time.monotonic()
        measured = args.jobs - preload
        ids, elapsed = asyncio.run(submit(sch.address, measured, args.concurrency))
        assert len(set(ids)) == measured
        result["submissions_measured"] = measured
        result["submissions_per_s"] = round(measured / elapsed, 1)
        result["submissions_retried"] = RETRIES[0]
        # Which process the submissions waited for: its share of a core while they ran.
        result["cpu_cores_while_submitting"] = {k: round((cpu_seconds(p) - cpu0[k]) / elapsed, 2) for k, p in pids.items()}
        mid = histograms(port)
        result["rounds_while_submitting"] = round_figures(before.get(ROUNDS, {}), mid.get(ROUNDS, {}))
        steady_from = time.monotonic()
        if args.steady_jobs:  # once the queue is placed: submissions beside ordinary rounds
            time.sleep(args.steady_after_s)
            cpu1 = {k: cpu_seconds(p) for k, p in pids.items()}
            steady_ids, steady_elapsed = asyncio.run(submit(sch.address, args.steady_jobs, args.concurrency, "steady"))
            assert len(set(steady_ids)) == args.steady_jobs
            result["steady_submissions"] = {
                "jobs": args.steady_jobs, "after_s": args.steady_after_s,
                "per_s": round(args.steady_jobs / steady_elapsed, 1),
                "cpu_cores": {k: round((cpu_seconds(p) - cpu1[k]) / steady_elapsed, 2) for k, p in pids.items()}}
        time.sleep(max(0.0, args.measure_s - (time.monotonic() - steady_from)))
        after, md_after = histograms(port), histograms(md_port)
        span = time.monotonic() - t0
        # How long every call waited for each service's event loop (silod_event_loop_lag_seconds).
        result["event_loop_lag"] = {
            "scheduler": lag_figures(before.get(LOOP_LAG, {}), after.get(LOOP_LAG, {})),
            "metadata": lag_figures(md_before.get(LOOP_LAG, {}), md_after.get(LOOP_LAG, {}))}
        result["scheduler_gc"] = gc_figures(before.get(GC_PAUSES, {}), after.get(GC_PAUSES, {}), span)
        result["rounds_steady"] = round_figures(mid.get(ROUNDS, {}), after.get(ROUNDS, {}))
        result["rounds_all"] = round_figures(before.get(ROUNDS, {}), after.get(ROUNDS, {}))
        result["cpu_cores"] = {k: round((cpu_seconds(p) - cpu0[k]) / span, 2) for k, p in pids.items()}
        gone = [k for k, p in pids.items() if exited(p)]
        if gone:  # its figures would be of a cluster without it
            raise SystemExit(f"live_scale: the {' and the '.join(gone)} ended during the run; its log says why "
                             f"(--keep DIR --log-level info keeps the logs: DIR/{policy}/)")
        result["rss_mib"] = {k: [round(v) for v in rss_mib(p)] for k, p in pids.items()}
        with open_channel(md.address, default_timeout_s=60) as channel:
            stub = metadata_pb2_grpc.MetadataServiceStub(channel)
            counts = {}
            for state in ("PENDING", "SCHEDULED", "RUNNING", "SUCCEEDED"):
                n, token = 0, ""
                while True:
                    reply = stub.ListJobs(metadata_pb2.ListJobsRequest(
                        states=[common_pb2.JobState.Value(f"JOB_STATE_{state}")], page_size=1000, page_token=token))
                    n += len(reply.jobs)
                    token = reply.next_page_token
                    if not token:
                        break
                counts[state.lower()] = n
            result["jobs_at_end"] = counts
            # The churn the rounds carried: jobs that ended (and so freed GPUs to re-place) a second.
            result["jobs_succeeded_per_s"] = round(counts["succeeded"] / span, 1)
        stats = fleet.stats()
        result["fleet_running_tasks"] = stats.get("running_tasks")
        result["acks"] = ack_figures(md.address, stats.get("plans", {}))
        if not args.postgres:
            result["database_bytes"] = (workdir / "m.db").stat().st_size
    return result


def verdicts(r: dict[str, Any]) -> list[str]:
    target = ROUND_TARGET_S.get(r["policy"], 2.0)
    lines = []
    rounds = r["rounds_all"]
    mean = rounds["mean_total_s"]
    p99 = rounds["p99_total_s_at_most"]
    lines.append(f"round ({r['policy']}): mean {mean} s, p99 <= {p99} s over {rounds['rounds']} rounds "
                 f"(snapshot {rounds['mean_snapshot_s']}, policy {rounds['mean_policy_s']}, commit "
                 f"{rounds['mean_commit_s']})  [target <= {target:g} s: "
                 f"{'MET' if p99 is not None and p99 <= target else 'MISSED'}]")
    ack = r["acks"]["all_nodes_acked_p99_s"]
    lines.append(f"plan to every node it changed acked: p99 {ack} s, max {r['acks']['all_nodes_acked_max_s']} s over "
                 f"{r['acks']['plans_fully_acked']} plans of {r['acks'].get('nodes_changed_per_plan_mean')} changed "
                 f"nodes on average (per node p99 {r['acks']['node_ack_p99_s']} s; every such node received it: "
                 f"p99 {r['acks'].get('all_nodes_received_p99_s')} s)  "
                 f"[target <= {ACK_TARGET_S:g} s: {'MET' if ack is not None and ack <= ACK_TARGET_S else 'MISSED'}]")
    rate = r["submissions_per_s"]
    lines.append(f"submissions while the nodes join and the queue is placed: {rate}/s  [target >= {SUBMIT_TARGET:g}/s: "
                 f"{'MET' if rate >= SUBMIT_TARGET else 'MISSED'}]; CPU cores used meanwhile: "
                 f"{r.get('cpu_cores_while_submitting')}")
    steady = r.get("steady_submissions")
    if steady:
        lines.append(f"submissions in steady running ({steady['jobs']:,} more, {steady['after_s']:g} s later): "
                     f"{steady['per_s']}/s  [target >= {SUBMIT_TARGET:g}/s: "
                     f"{'MET' if steady['per_s'] >= SUBMIT_TARGET else 'MISSED'}]; CPU cores used meanwhile: "
                     f"{steady['cpu_cores']}")
    lines.append(f"jobs that ended and freed their GPUs: {r.get('jobs_succeeded_per_s')}/s over the run")
    lines.append("RSS MiB (now, peak): " + ", ".join(f"{k} {v}" for k, v in r["rss_mib"].items())
                 + f"; CPU cores used: {r['cpu_cores']}")
    lag = r.get("event_loop_lag")
    if lag:
        lines.append("event loop lag (mean, p99 at most): " + ", ".join(
            f"{k} {v['mean_s']} s, {v['p99_s_at_most']} s" for k, v in lag.items()))
    gc_time = r.get("scheduler_gc")
    if gc_time:
        lines.append(f"the scheduler's garbage collector: {gc_time['seconds']} s in {gc_time['collections']} "
                     f"collections ({gc_time['share_of_wall_time']:.1%} of the time measured)")
    return lines


def table(paths: list[str]) -> str:
    """A markdown table of result files (docs/sizing.md)."""
    rows = ["| run | policy | nodes x GPUs, jobs | database | round mean (snapshot, policy, commit) | round p99 at most "
            "| plan to every node it changed acked, p99 | submissions/s as the nodes join; in steady running | scheduler RSS | metadata RSS | CPU cores used "
            "(scheduler, metadata, fleet) | load average |", "|" + "---|" * 12]
    for path in paths:
        for r in json.loads(Path(path).read_text()):
            ro = r["rounds_all"]
            cpu = r["cpu_cores"]
            p99 = "> 32 s" if ro["p99_total_s_at_most"] == float("inf") else f"{ro['p99_total_s_at_most']} s"
            submitted = r.get("submissions_measured", r["jobs"])
            pinned = ", scheduler on a CPU of its own" if r.get("scheduler_cpus") else ""
            steady = (f"{r['steady_submissions']['per_s']} (of {r['steady_submissions']['jobs']:,})"
                      if r.get("steady_submissions") else "not measured")
            rows.append(
                f"| [{Path(path).stem}](../benchmarks/results/{Path(path).parent.name}/{Path(path).name}) "
                f"| {r['policy']} | {r['nodes']:,} x 8, {r['jobs']:,} | {r['database']}{pinned} | {ro['mean_total_s']} s ({ro['mean_snapshot_s']}, "
                f"{ro['mean_policy_s']}, {ro['mean_commit_s']}) over {ro['rounds']} rounds | {p99} "
                f"| {r['acks']['all_nodes_acked_p99_s']} s | {r['submissions_per_s']} (of {submitted:,}); {steady} "
                f"| {r['rss_mib']['scheduler'][1]} MiB | {r['rss_mib']['metadata'][1]} MiB "
                f"| {cpu['scheduler']}, {cpu['metadata']}, {cpu['fleet']} | {r['load_average_1m']:.0f} on {r['cpus']} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--jobs", type=int, default=5000)
    parser.add_argument("--policy", default="fifo", help="comma-separated: fifo,sjf,tiresias,gavel,pollux")
    parser.add_argument("--postgres", action="store_true", help="a scratch database on PostgreSQL 127.0.0.1:5432")
    parser.add_argument("--measure-jobs", type=int, default=1000,
                        help="of --jobs, how many are submitted (and timed) while the fleet runs; the rest are "
                             "queued before it starts")
    parser.add_argument("--concurrency", type=int, default=16, help="submissions in flight")
    parser.add_argument("--interval-s", type=float, default=2.0, help="the scheduler's round interval")
    parser.add_argument("--heartbeat-s", type=float, default=5.0, help="the fleet's heartbeat interval")
    parser.add_argument("--report-s", type=float, default=5.0, help="the fleet's task report interval")
    parser.add_argument("--task-seconds", type=float, default=120.0,
                        help="an emulated rank finishes after this, times 1 +- --task-spread (the shortest within "
                             "--measure-s: the steady rounds place the queue on the GPUs that completions free)")
    parser.add_argument("--task-spread", type=float, default=0.9,
                        help="each job runs --task-seconds x (1 +- this), by job id: the jobs placed together at the "
                             "start end over a span of rounds rather than all in one, as in a cluster in steady running")
    parser.add_argument("--measure-s", type=float, default=30.0, help="steady seconds measured after submitting")
    parser.add_argument("--steady-jobs", type=int, default=1000,
                        help="jobs submitted (and timed) in steady running, beyond --jobs: "
                             "--steady-after-s into the --measure-s window; 0: none")
    parser.add_argument("--steady-after-s", type=float, default=10.0,
                        help="when the --steady-jobs go, in seconds after the first submissions ended")
    parser.add_argument("--pin-scheduler", action="store_true",
                        help="give the scheduler the first CPU to itself and run everything this benchmark starts "
                             "(metadata, fleet, client) on the others, as a deployment gives the scheduler its own "
                             "core; needs 2 or more CPUs (PostgreSQL, a system service, stays where it runs)")
    parser.add_argument("--allocation", action="store_true",
                        help="start the allocation service (silod allocation) and give it to the fleet's nodes, as the "
                             "deployments do: their watches, acks and reports off the scheduler's process (with "
                             "--pin-scheduler it runs on the other CPUs)")
    parser.add_argument("--pin-allocation", action="store_true",
                        help="with --pin-scheduler --allocation: run the allocation service on the scheduler's CPU "
                             "rather than beside the metadata service, fleet and client (on 2 CPUs the scheduler "
                             "uses about half of its own, while the other one is the busier)")
    parser.add_argument("--json", default="", help="write the results here (a JSON list, one entry per policy, "
                        "written again after each)")
    parser.add_argument("--keep", default="", metavar="DIR", help="keep each policy's logs and database in DIR/<policy> "
                        "(default: a temporary directory, removed)")
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
                        help="the services' log level (info logs every RPC with its duration)")
    parser.add_argument("--table", nargs="+", metavar="JSON", help="print a markdown table of result files and exit")
    args = parser.parse_args(argv)
    if not 0 <= args.task_spread < 1:
        parser.error(f"--task-spread: must be >= 0 and < 1, got {args.task_spread:g}")
    if args.steady_jobs < 0 or args.steady_after_s < 0:
        parser.error("--steady-jobs and --steady-after-s: must be >= 0")
    if args.pin_allocation and not (args.pin_scheduler and args.allocation):
        parser.error("--pin-allocation: needs --pin-scheduler and --allocation")
    if args.pin_scheduler and len(os.sched_getaffinity(0)) < 2:
        parser.error("--pin-scheduler: needs 2 or more CPUs, this process may use "
                     f"{len(os.sched_getaffinity(0))}")
    if args.table:
        print(table(args.table))
        return 0
    print("$ python benchmarks/live_scale.py " + " ".join(argv if argv is not None else sys.argv[1:]), flush=True)
    results = []
    for policy in [p.strip() for p in args.policy.split(",") if p.strip()]:
        if args.keep:  # the services' logs and the database stay there, one folder per policy
            kept = Path(args.keep) / policy
            shutil.rmtree(kept, ignore_errors=True)
            kept.mkdir(parents=True)
            r = run_policy(args, policy, kept)
        else:
            with tempfile.TemporaryDirectory(prefix="silod-scale-") as tmp:
                r = run_policy(args, policy, Path(tmp))
        r["load_average_1m"] = os.getloadavg()[0]
        r["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                     cwd=Path(__file__).resolve().parent).stdout.strip()
        r["cpus"] = os.cpu_count()
        results.append(r)
        where = f", scheduler alone on CPU {r['scheduler_cpus']}" if r.get("scheduler_cpus") else ""
        if r.get("allocation_cpus"):
            where = f", scheduler and allocation service on CPU {r['allocation_cpus']}"
        print(f"--- {policy}, {args.nodes} nodes x 8 GPUs, {args.jobs} jobs, {r['database']}{where}", flush=True)
        for line in verdicts(r):
            print("  " + line, flush=True)
        if args.json:  # after each policy: a run cut short keeps what it measured
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
