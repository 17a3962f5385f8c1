"""Time whole simulations of a workload, end to end (load, simulate, summarize).

Run: ``python benchmarks/simulate_workload.py [--workload workload-6] [--policy NAME ...] [--no-check]``.
Default policies: fifo, tiresias and pollux (those registered). Target: pollux on workload-6
(160 jobs, 16 nodes x 4 GPUs, 60 s rounds) under 2 minutes; for scale, the Pollux artifact's
own simulator needs ~20 minutes for that run on this kind of machine (DESIGN.md).

At scale on GPU types (heterogeneous-GPU issue): ``--philly 5000 --seed 2 --hours 24 --cluster
simulator/clusters/three-types-2048.yaml`` samples 5,000 Philly jobs (as ``silod simulate generate
--philly``) onto 2,048 GPUs of three types; target: every policy under a minute (``--target-s 60``).

Prints the one-off cost of fitting the application profiles, then one line per policy: wall time, scheduling rounds, wall time per round, average JCT.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

try:
    import simulator  # noqa: F401
except ImportError:  # run from a clone without installing
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from estimator.job_model import JobModel  # noqa: E402
from scheduler.registry import policy_names  # noqa: E402
from simulator import generate_philly, load_cluster, load_workload, simulate, summary  # noqa: E402
from simulator.workload import workload_from_jobs  # noqa: E402

TARGET_S = {"pollux": 120.0}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="workload-6")
    parser.add_argument("--policy", action="append", dest="policies")
    parser.add_argument("--no-check", action="store_true", help="skip the per-round plan invariant checks")
    parser.add_argument("--cluster", metavar="YAML", help="cluster spec (default: the Pollux cluster, 16 x 4 GPUs)")
    parser.add_argument("--philly", type=int, metavar="JOBS", help="instead of --workload: sample JOBS Philly jobs")
    parser.add_argument("--seed", type=int, default=0, help="--philly: random seed (default 0)")
    parser.add_argument("--hours", type=float, default=8.0, help="--philly: submission window in hours (default 8)")
    parser.add_argument("--target-s", type=float, help="wall-time target for every policy (default: pollux 120 s)")
    args = parser.parse_args()
    known = policy_names()
    policies = args.policies or [p for p in ("fifo", "tiresias", "pollux") if p in known]
    missing = [p for p in policies if p not in known]
    if missing:
        print(f"unknown policy {missing[0]!r}; known: {', '.join(known)}", file=sys.stderr)
        return 2
    def load():
        if args.philly:
            return workload_from_jobs(generate_philly(args.philly, args.seed, hours=args.hours),
                                      f"philly-{args.philly}-seed{args.seed}")
        return load_workload(args.workload)

    cluster = load_cluster(args.cluster)
    workload = load()  # a frozen value: every policy simulates the same one
    started = time.perf_counter()
    for application in sorted({job.application for job in workload.jobs}):
        JobModel.from_profile(application)  # fits each application's profile once per process
    print(f"{'profiles':10s} {workload.name}: {time.perf_counter() - started:7.1f} s to load and fit the application profiles "
          f"({cluster.total_gpus} GPUs, types {'/'.join(t or 'untyped' for t in cluster.gpu_types)})")
    status = 0
    for name in policies:
        started, cpu_started = time.perf_counter(), time.process_time()
        result = simulate(workload, name, cluster, check_invariants=not args.no_check)
        data = summary(result)
        wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
        target = args.target_s if args.target_s is not None else TARGET_S.get(name)
        verdict = "" if target is None else (f"  [target < {target:.0f} s: {'ok' if wall < target else 'MISSED'}]")
        if target is not None and wall >= target:
            status = 1
        print(
            f"{name:10s} {workload.name}: {wall:7.1f} s wall ({cpu:.1f} s CPU: the wall time on an idle core), {result.rounds} rounds "
            f"({1000 * wall / max(result.rounds, 1):.1f} ms/round), avg JCT {data['avg_jct_s']:,.0f} s{verdict}",
            flush=True,
        )
    return status


if __name__ == "__main__":
    sys.exit(main())
