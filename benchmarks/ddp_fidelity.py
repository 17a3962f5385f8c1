"""Simulator fidelity against real training: the same small workload of real DDP jobs live on a
`silod up` cluster and in the simulator, per policy; per-job JCT and throughput side by side,
and the policy's allocations over time in both worlds.

    .venv/bin/python benchmarks/profile_ddp_digits.py          # once: writes estimator/profiles/digits
    .venv/bin/python benchmarks/ddp_fidelity.py [--policies pollux,sjf] [--out results.json]

The jobs are examples/train_ddp_digits.py (PyTorch DDP over gloo on CPU, a small MLP, the digits
read through the nodes' cache servers from `silod store-emulator`), application ``digits``: the
live scheduler and the simulator both price them with the profile the first command measured.
The store serves ``--bandwidth-kb-s`` in total and the scheduler gets the same figure as its
storage budget (``--cache silod``); each node caches ``--cache-bytes``, less than a dataset, and
the jobs alternate between two copies of the digits (two datasets), so cache and IO both
matter. Elastic jobs (1-2 GPUs) and rigid ones (1 GPU) arrive ``--gap-s`` apart; every job keeps
the batch size it was submitted with (``max_batch_size`` 0: Pollux chooses GPUs only), so its
statistical efficiency is 1 in both worlds and both finish it after ``--epochs`` epochs.

Sizing for this 2-core machine (shared with other work): 2 nodes x 1 GPU, so at most two ranks
run at once; ``OMP_NUM_THREADS=1``; the per-sample sleep of the profile stands in for the GPU
part of a step and keeps each rank's CPU use to a fraction of a core.

The simulator gets the same cluster (nodes, GPUs, cache per node, budget, round interval,
rounds on arrivals and completions), the live datasets' bytes and sample count, each job's
live submission time, and the profile's measured overheads (``overheads.csv``: launch and finish
per world size, which the simulator charges in place of its fixed restart cost; the live jobs'
own launch and finish are printed next to them). ``--launch-s`` is the restart cost both
schedulers are told (ClusterSnapshot.restart_cost_s); ``--fixed-restart`` runs the simulator
the old way, charging it for every launch and nothing at a job's end. JCT is finish minus
submission; throughput is samples over the time from the first plan placing the job to its
finish.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from live_cluster import LiveCluster  # noqa: E402
from profile_ddp_digits import EXAMPLE, job_env, prepare_store  # noqa: E402
from silod.launcher import start_service  # noqa: E402
from silod.v1 import common_pb2  # noqa: E402

APPLICATION = "digits"
DATASETS = ["digits-a", "digits-b"]
# (name, min GPUs, max GPUs, dataset index); arrivals are --gap-s apart, in this order
WORKLOAD = [("e0", 1, 2, 0), ("r1", 1, 1, 1), ("e2", 1, 2, 1), ("r3", 1, 1, 0), ("e4", 1, 2, 0)]


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policies", default="pollux,sjf")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--gap-s", type=float, default=10.0, help="seconds between submissions")
    p.add_argument("--bandwidth-kb-s", type=float, default=16.0, help="store link = storage budget (1e3 B/s)")
    p.add_argument("--cache-bytes", type=int, default=200_000, help="each node's cache (disk tier; memory tier 0)")
    p.add_argument("--interval-s", type=float, default=2.0)
    p.add_argument("--launch-s", type=float, default=6.8, help="the restart cost both schedulers are told: a live launch, as the profiler measured it (median)")
    p.add_argument("--fixed-restart", action="store_true",
                   help="simulate with --launch-s for every launch and no finish time instead of the profile's overheads.csv")
    p.add_argument("--sample-sleep-s", type=float, default=0.008, help="as profiled (profile_ddp_digits.py)")
    p.add_argument("--timeout-s", type=float, default=1200.0)
    p.add_argument("--out", default="", help="write everything measured here (JSON)")
    p.add_argument("--resimulate", default="", metavar="JSON",
                   help="no live run: simulate again the live runs an earlier --out recorded (with this run's simulator flags)")
    return p.parse_args()


# ---- live ------------------------------------------------------------------------------------------
def live(args: argparse.Namespace, policy: str, store_address: str, work: Path) -> dict:
    with LiveCluster(work / f"live-{policy}", nodes=2, gpus_per_node=1, policy=policy, cache="silod",
                     storage_bandwidth_bytes_per_s=args.bandwidth_kb_s * 1e3, cache_disk_bytes=args.cache_bytes,
                     interval_s=args.interval_s, restart_cost_s=args.launch_s) as cluster:
        for name in DATASETS:
            cluster.register(name, f"s3://bench/{name}", f"endpoint_url=http://{store_address}", "anon=true")
        ids: dict[str, str] = {}
        start = time.time()
        for k, (name, low, high, ds) in enumerate(WORKLOAD):
            time.sleep(max(0.0, start + k * args.gap_s - time.time()))
            spec = common_pb2.JobSpec(name=name, application=APPLICATION, dataset=DATASETS[ds], min_gpus=low,
                                      max_gpus=high, batch_size=args.batch, epochs=args.epochs,
                                      command=[sys.executable, str(EXAMPLE)], env=job_env(args.sample_sleep_s),
                                      resize_in_place=True)
            ids[cluster.submit(spec)] = name
        jobs = cluster.wait(list(ids), args.timeout_s)
        plans = cluster.plans()
        steps = {ids[j]: cluster.steps(j) for j in ids}
        caches = {ids[j]: cluster.cache_stats(j) for j in ids}
    t0 = min(j.created_at.ToDatetime().timestamp() for j in jobs.values())
    out: dict = {"jobs": {}, "timeline": []}
    for job_id, job in jobs.items():
        name = ids[job_id]
        if job.state != common_pb2.JOB_STATE_SUCCEEDED:
            raise RuntimeError(f"{name} ended {common_pb2.JobState.Name(job.state)}; logs under {work}")
        first_plan = min((p.at for p in plans if job_id in p.gpus), default=job.started_at.ToDatetime().timestamp())
        first_step = min((s["t"] for s in steps[name]), default=first_plan)
        out["jobs"][name] = {
            "arrival": job.created_at.ToDatetime().timestamp() - t0, "first_placed": first_plan - t0,
            "finish": job.finished_at.ToDatetime().timestamp() - t0, "launch_s": first_step - first_plan,
            "finish_s": job.finished_at.ToDatetime().timestamp() - max((s["t"] for s in steps[name]), default=first_step),
            "samples": float(job.progress.samples_done),
            # per node: the job's cache stats at its first and last sample (cached bytes at the
            # start; hits, misses = store reads, peer hits at the end)
            "cache": {node: {"first": seen[0][1], "last": seen[-1][1]} for node, seen in caches[name].items()},
        }
        for node, seen in sorted(caches[name].items()):
            first, last = seen[0][1], seen[-1][1]
            print(f"  {name} {node}: cached {int(first.get('cached_bytes', 0))} B at its first sample; "
                  f"hits {last.get('hits', 0)} (peer {last.get('peer_hits', 0)}), misses {last.get('misses', 0)}, "
                  f"remote {last.get('remote_bytes', 0)} B", flush=True)
    last: dict[str, int] = {}
    for plan in plans:
        now = {ids[j]: sum(n.values()) for j, n in plan.gpus.items() if j in ids}
        if now != last:
            out["timeline"].append((plan.at - t0, now))
            last = now
    return out


# ---- simulator -------------------------------------------------------------------------------------
def simulate(args: argparse.Namespace, policy: str, arrivals: dict[str, float], dataset_bytes: float,
             samples_per_epoch: int) -> dict:
    from estimator.job_model import JobModel
    from simulator.cluster import ClusterSpec, uniform_nodes
    from simulator.engine import Simulator
    from simulator.workload import JobSpec, workload_from_jobs

    cluster = ClusterSpec(
        nodes=uniform_nodes(2, 1, cache_bytes=float(args.cache_bytes)), restart_cost_s=args.launch_s,
        interval_s=args.interval_s, schedule_on_events=True, storage_bandwidth_bytes_per_s=args.bandwidth_kb_s * 1e3,
        job_overheads=not args.fixed_restart,
    )
    specs = [JobSpec(name=name, application=APPLICATION, arrival_s=arrivals[name], num_replicas=high, batch_size=args.batch)
             for name, _, high, _ in WORKLOAD]
    specs.sort(key=lambda s: s.arrival_s)
    sim = Simulator(workload_from_jobs(specs), policy, cluster, cache_mode="silod")
    model = JobModel.from_profile(APPLICATION).with_dataset(dataset_bytes, dataset_bytes / samples_per_epoch)
    shape = {name: (low, high, ds) for name, low, high, ds in WORKLOAD}
    for job in sim._jobs:  # the live jobs' datasets, bounds and budgets (the workload CSV has no columns for them)
        low, high, ds = shape[job.spec.name]
        job.model = model
        job.dataset = DATASETS[ds]
        job.target = float(args.epochs * samples_per_epoch)
        job.min_gpus, job.max_gpus, job.requested = low, high, high
    timeline, last, first = [], {}, {}
    while sim.step():
        now = {j.spec.name: j.allocation.gpus for j in sim._jobs if j.allocation is not None and j.finish is None}
        for name in now:
            first.setdefault(name, sim.now)
        if now != last:
            timeline.append((sim.now, now))
            last = now
    result = sim.result()
    jobs = {r.name: {"arrival": r.arrival_s, "first_placed": first.get(r.name, r.start_s), "finish": r.finish_s,
                     "samples": r.target_samples} for r in result.jobs}
    return {"jobs": jobs, "timeline": timeline}


# ---- report ----------------------------------------------------------------------------------------
def metrics(jobs: dict) -> dict[str, tuple[float, float]]:
    """name -> (JCT s, throughput samples/s)."""
    return {n: (j["finish"] - j["arrival"], j["samples"] / max(j["finish"] - j["first_placed"], 1e-9)) for n, j in jobs.items()}


def gpu_seconds_table(timeline: list, horizon: float, step: float = 10.0) -> list[str]:
    """Per ``step`` seconds: each job's GPUs at its start (a compact allocation-over-time view)."""
    rows = []
    t = 0.0
    while t < horizon:
        state = {}
        for at, alloc in timeline:
            if at <= t + 1e-9:
                state = alloc
        rows.append(" ".join(f"{n}:{g}" for n, g in sorted(state.items())) or "-")
        t += step
    return rows


def report(policy: str, real: dict, sim: dict, step: float) -> dict:
    lm, sm = metrics(real["jobs"]), metrics(sim["jobs"])
    print(f"\n[{policy}] per job (live vs simulated)")
    print("| job | GPUs | arrival (s) | JCT live | JCT sim | JCT err | thr. live | thr. sim | thr. err | launch live (s) | finish live (s) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    errs_jct, errs_thr = [], []
    for name, low, high, _ in WORKLOAD:
        (lj, lt), (sj, st) = lm[name], sm[name]
        errs_jct.append(sj / lj - 1)
        errs_thr.append(st / lt - 1)
        print(f"| {name} | {low}-{high} | {real['jobs'][name]['arrival']:.1f} | {lj:.1f} | {sj:.1f} | {sj / lj - 1:+.0%} | "
              f"{lt:.0f} | {st:.0f} | {st / lt - 1:+.0%} | {real['jobs'][name]['launch_s']:.1f} | "
              f"{real['jobs'][name]['finish_s']:.1f} |")
    avg_l, avg_s = statistics.mean(v[0] for v in lm.values()), statistics.mean(v[0] for v in sm.values())
    print(f"average JCT: live {avg_l:.1f} s, sim {avg_s:.1f} s ({avg_s / avg_l - 1:+.1%}); "
          f"worst per-job throughput error {max(abs(e) for e in errs_thr):.0%}, JCT {max(abs(e) for e in errs_jct):.0%}")
    horizon = max(max(j["finish"] for j in real["jobs"].values()), max(j["finish"] for j in sim["jobs"].values()))
    print(f"allocations every {step:g} s (job:GPUs), live | sim")
    for k, (a, b) in enumerate(zip(gpu_seconds_table(real["timeline"], horizon, step), gpu_seconds_table(sim["timeline"], horizon, step))):
        print(f"  {k * step:6.0f} s  {a:<24} | {b}")
    return {"avg_jct_live": avg_l, "avg_jct_sim": avg_s, "avg_jct_err": avg_s / avg_l - 1,
            "thr_err": dict(zip([w[0] for w in WORKLOAD], errs_thr)), "jct_err": dict(zip([w[0] for w in WORKLOAD], errs_jct))}


def resimulate(args: argparse.Namespace) -> int:
    """The simulator side only, against live runs recorded by an earlier ``--out``."""
    try:
        recorded = json.loads(Path(args.resimulate).read_text())
        recorded["args"], recorded["results"]  # noqa: B018 - what an --out file holds
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"--resimulate {args.resimulate}: not a file written by --out ({exc})") from None
    rerun = argparse.Namespace(**{**recorded["args"], "fixed_restart": args.fixed_restart})
    facts = recorded.get("dataset", {"bytes": 255_258.0, "samples": 1_797})  # the digits files (runs before this key)
    for policy, result in recorded["results"].items():
        real = result["live"]
        sim = simulate(rerun, policy, {n: j["arrival"] for n, j in real["jobs"].items()}, facts["bytes"], facts["samples"])
        report(policy, real, sim, 10.0)
    return 0


def main() -> int:
    args = parse()
    if args.resimulate:
        return resimulate(args)
    work = Path(tempfile.mkdtemp(prefix="silod-ddp-fidelity-"))
    prepare_store(work / "store", DATASETS)
    files = sorted((work / "store" / "bench" / DATASETS[0]).iterdir())
    dataset_bytes, samples = float(sum(f.stat().st_size for f in files)), len(files)
    store = start_service("store-emulator", "--root", str(work / "store"), "--bandwidth-mb-s", str(args.bandwidth_kb_s / 1e3),
                          "--log-level", "warning", workdir=work / "logs")
    results = {}
    if not args.fixed_restart:
        from estimator.profiles.loading import read_overheads

        overheads = read_overheads(APPLICATION)
        if overheads is None:
            print(f"the {APPLICATION} profile has no overheads.csv: the simulator charges --launch-s "
                  f"(re-run benchmarks/profile_ddp_digits.py to measure launch and finish)", file=sys.stderr)
        else:
            print("simulator overheads (profile): " + ", ".join(
                f"{n} rank(s) launch {a:.2f} s finish {b:.2f} s"
                for n, a, b in zip(overheads.num_replicas, overheads.launch_s, overheads.finish_s)))
    try:
        for policy in [p for p in args.policies.split(",") if p]:
            load0, cpu0, wall0 = os.getloadavg(), os.times(), time.monotonic()
            real = live(args, policy, store.address, work)
            load1, cpu1 = os.getloadavg(), os.times()
            sim = simulate(args, policy, {n: j["arrival"] for n, j in real["jobs"].items()}, dataset_bytes, samples)
            print(f"\n[{policy}] live run {time.monotonic() - wall0:.0f} s wall, children CPU "
                  f"{cpu1.children_user + cpu1.children_system - cpu0.children_user - cpu0.children_system:.0f} s; "
                  f"load average {load0[0]:.2f} at the start, {load1[0]:.2f} at the end", flush=True)
            results[policy] = {"live": real, "sim": sim, "load": [load0[0], load1[0]],
                               "summary": report(policy, real, sim, 10.0)}
    finally:
        store.close()
    print(f"\nworkload: {len(WORKLOAD)} jobs, {args.epochs} epochs of {samples} samples ({dataset_bytes:.0f} B) each, batch "
          f"{args.batch}; datasets {DATASETS}; 2 nodes x 1 GPU, cache {args.cache_bytes} B/node, store = budget "
          f"{args.bandwidth_kb_s} kB/s; work dir {work}")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results,
                                              "dataset": {"bytes": dataset_bytes, "samples": samples}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
