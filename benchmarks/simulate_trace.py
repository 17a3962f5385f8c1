"""Replay the whole Philly trace (and its first N jobs) with every policy: wall time, CPU, peak
memory and results, before and after a change, side by side.

Run from the repository root::

    .venv/bin/python benchmarks/simulate_trace.py                       # every policy, the whole trace
    .venv/bin/python benchmarks/simulate_trace.py --jobs 5000,20000,all --policy fifo --policy pollux
    .venv/bin/python benchmarks/simulate_trace.py --before /tmp/base      # the same runs on an older tree too

Workloads: ``all`` is ``--workload philly`` (every one of the trace's 82,247 jobs at its own
arrival time, simulator/philly.py); a number N is the first N of those jobs; ``day24h`` is the
issue's busy reference, 20,000 jobs sampled over 24 h (``simulate generate --philly --jobs 20000
--hours 24``). The cluster is the trace's scale, 256 x 8 GPUs (simulator/clusters/philly-2048.yaml);
deepboot runs on philly-2048-inference.yaml (224 training + 32 inference nodes) with inference
tasks mixed in (``simulate mix --pattern diurnal --rate 0.01 --duration-s 60 1200 --seed 1``, over
the workload's span). Workloads are written once as CSVs, so a tree that cannot build them reads
the same jobs.

Each run is a process of its own (``PYTHONPATH`` = the tree): it loads the workload, simulates with
the invariant checks on (``--no-check`` to skip them) and reports its wall and CPU time for the
simulation (loading excluded), the process's peak RSS, rounds (run and in all) and the results.
``--before DIR`` runs every case on that tree too, alternating before and after (``--repeat``
times). A run that passes ``--budget-s`` of wall time stops and reports how far it got (simulated
day, jobs finished). ``--out DIR`` keeps results.json and, for each finished run of this tree, its
summary.json and jobs.csv (the raw results).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

POLICIES = ("fifo", "sjf", "tiresias", "themis", "gavel", "pollux", "deepboot")
CLUSTER = ROOT / "simulator/clusters/philly-2048.yaml"
INFERENCE_CLUSTER = ROOT / "simulator/clusters/philly-2048-inference.yaml"
INFERENCE = dict(pattern="diurnal", rate=0.01, duration_s=(60.0, 1200.0), seed=1)

# The child: simulate one case and print one JSON line. Runs on whichever tree PYTHONPATH names.
CHILD = r"""
import json, math, resource, sys, time
args = json.loads(sys.argv[1])
from simulator import Simulator, load_cluster, load_workload
workload = load_workload(args["workload"])
cluster = load_cluster(args["cluster"])
sim = Simulator(workload, args["policy"], cluster, check_invariants=args["check"])
wall, cpu = time.perf_counter(), time.process_time()
budget = args["budget_s"]
finished = True
while sim.step():
    if time.perf_counter() - wall > budget:
        finished = False
        break
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
out = dict(finished=finished, wall_s=wall, cpu_s=cpu, sim_days=sim.now / 86400.0, jobs=len(workload.jobs),
           jobs_finished=sim._finished, rounds=sim.rounds, rounds_computed=getattr(sim, "rounds_computed", sim.rounds),
           events=sim.events)
if finished:
    from simulator.metrics import summary, write_outputs
    result = sim.result()
    s = summary(result)
    out.update({k: s[k] for k in ("avg_jct_s", "p50_jct_s", "p99_jct_s", "makespan_s", "gpu_utilization", "restarts")})
    if "inference" in s:
        out["inference"] = {k: s["inference"][k] for k in ("tasks", "wait_p99_s", "cold_start_share", "lent_gpu_hours")}
    if args.get("keep"):
        write_outputs(result, args["keep"], plots=False)
out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
print("RESULT " + json.dumps(out), flush=True)
"""


def write_workloads(sizes: list[str], directory: pathlib.Path, with_inference: bool) -> dict[str, tuple[str, str]]:
    """size -> (training CSV, mixed CSV or '') under ``directory``."""
    from simulator.inference import ArrivalPattern, generate_inference_tasks, mixed_rows
    from simulator.philly import generate_philly, replay_philly
    from simulator.workload import write_workload

    whole = replay_philly()
    paths = {}
    for size in sizes:
        if size == "all":
            jobs = whole
        elif size == "day24h":
            jobs = generate_philly(20000, 0, hours=24)
        else:
            jobs = whole[: int(size)]
        training = directory / f"philly-{size}.csv"
        write_workload(jobs, training)
        mixed = ""
        if with_inference:
            pattern = ArrivalPattern(INFERENCE["pattern"], rate_per_s=INFERENCE["rate"])
            tasks = generate_inference_tasks(seed=INFERENCE["seed"], horizon_s=jobs[-1].arrival_s + 3600.0, pattern=pattern,
                                             duration_s=INFERENCE["duration_s"])
            mixed_path = directory / f"philly-{size}-inference.csv"
            mixed_path.write_text(mixed_rows(jobs, tasks), encoding="utf-8")
            mixed = str(mixed_path)
        paths[size] = (str(training), mixed)
    return paths


def run(tree: pathlib.Path, policy: str, workload: str, cluster: pathlib.Path, check: bool, budget_s: float,
        keep: str | None) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    args = json.dumps(dict(policy=policy, workload=workload, cluster=str(cluster), check=check, budget_s=budget_s, keep=keep))
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CHILD, args], env=env, cwd=tempfile.gettempdir(), capture_output=True,
                          text=True, timeout=budget_s + 900)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        return dict(error=(proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"],
                    process_s=time.perf_counter() - started)
    return json.loads(line[len("RESULT "):])


def fmt(result: dict | None) -> str:
    if not result:
        return ""
    if "error" in result:
        return "error: " + " ".join(result["error"])[:60]
    text = f"{result['wall_s']:,.0f} s / {result['cpu_s']:,.0f} s CPU / {result['peak_rss_mb']:,.0f} MB"
    if not result["finished"]:
        share = result["jobs_finished"] / result["jobs"]
        text += f" (stopped at day {result['sim_days']:.1f}, {share:.0%} of jobs done)"
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", action="append", dest="policies", help=f"policies (default: {', '.join(POLICIES)})")
    parser.add_argument("--jobs", default="all", help="comma list of workloads: N (the first N jobs), all, day24h (default all)")
    parser.add_argument("--before", metavar="DIR", help="an older source tree: run every case on it too, alternating")
    parser.add_argument("--repeat", type=int, default=1, help="runs per case and tree (default 1)")
    parser.add_argument("--budget-s", type=float, default=3600.0, help="stop a run after this much wall time (default 3600)")
    parser.add_argument("--no-check", action="store_true", help="skip the plan invariant checks")
    parser.add_argument("--out", metavar="DIR", help="keep results.json and this tree's summary.json/jobs.csv per run here")
    args = parser.parse_args()
    policies = args.policies or list(POLICIES)
    sizes = [s.strip() for s in args.jobs.split(",") if s.strip()]
    trees = [("after", ROOT)] + ([("before", pathlib.Path(args.before).resolve())] if args.before else [])
    out = pathlib.Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    results: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="simulate-trace-") as scratch:
        started = time.perf_counter()
        paths = write_workloads(sizes, pathlib.Path(scratch), "deepboot" in policies)
        print(f"workloads written in {time.perf_counter() - started:.0f} s: {', '.join(sizes)}; "
              f"trees: {', '.join(f'{n} = {p}' for n, p in trees)}; load {os.getloadavg()[0]:.1f}", flush=True)
        for size in sizes:
            for policy in policies:
                inference = policy == "deepboot"
                workload = paths[size][1] if inference else paths[size][0]
                cluster = INFERENCE_CLUSTER if inference else CLUSTER
                for rep in range(args.repeat):
                    order = trees if rep % 2 == 0 else trees[::-1]
                    for name, tree in order:
                        keep = str(out / f"{size}-{policy}") if out and name == "after" and rep == 0 else None
                        result = run(tree, policy, workload, cluster, not args.no_check, args.budget_s, keep)
                        result.update(tree=name, policy=policy, workload=size, repeat=rep,
                                      load=os.getloadavg()[0], when=time.strftime("%Y-%m-%d %H:%M:%S"))
                        results.append(result)
                        print(f"{size:>7} {policy:9s} {name:6s} {fmt(result)}"
                              + (f"  avg JCT {result['avg_jct_s']:,.0f} s" if "avg_jct_s" in result else "")
                              + f"  [load {result['load']:.1f}]", flush=True)
                        if out:
                            (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print()
    print("| workload | policy | " + " | ".join(f"{name}: wall / CPU / peak RSS" for name, _ in trees) + " | avg JCT | p99 JCT | makespan | GPU util. |")
    print("|---|---|" + "---|" * len(trees) + "---:|---:|---:|---:|")
    for size in sizes:
        for policy in policies:
            cells = []
            mine = [r for r in results if r["workload"] == size and r["policy"] == policy]
            for name, _ in trees:
                runs = [r for r in mine if r["tree"] == name and "error" not in r]
                if not runs:
                    cells.append(fmt(next((r for r in mine if r["tree"] == name), None)))
                    continue
                median = dict(runs[0], wall_s=statistics.median(r["wall_s"] for r in runs),
                              cpu_s=statistics.median(r["cpu_s"] for r in runs),
                              peak_rss_mb=statistics.median(r["peak_rss_mb"] for r in runs))
                cells.append(fmt(median))
            done = next((r for r in mine if r["tree"] == "after" and r.get("finished")), {})
            print(f"| {size} | {policy} | " + " | ".join(cells)
                  + (f" | {done['avg_jct_s']:,.0f} s | {done['p99_jct_s']:,.0f} s | {done['makespan_s']:,.0f} s | "
                     f"{done['gpu_utilization']:.1%} |" if done else " | | | | |"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
