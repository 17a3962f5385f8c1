"""Time whole simulations of a Pollux workload, end to end (load, simulate, summarize).

Run: ``python benchmarks/simulate_workload.py [--workload workload-6] [--policy NAME ...] [--no-check]``.
Default policies: fifo, tiresias and pollux (those registered). Target: pollux on workload-6
(160 jobs, 16 nodes x 4 GPUs, 60 s rounds) under 2 minutes; for scale, the Pollux artifact's
own simulator needs ~20 minutes for that run on this kind of machine (DESIGN.md).

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
from simulator import load_workload, simulate, summary  # noqa: E402

TARGET_S = {"pollux": 120.0}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="workload-6")
    parser.add_argument("--policy", action="append", dest="policies")
    parser.add_argument("--no-check", action="store_true", help="skip the per-round plan invariant checks")
    args = parser.parse_args()
    known = policy_names()
    policies = args.policies or [p for p in ("fifo", "tiresias", "pollux") if p in known]
    missing = [p for p in policies if p not in known]
    if missing:
        print(f"unknown policy {missing[0]!r}; known: {', '.join(known)}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    for application in sorted({job.application for job in load_workload(args.workload).jobs}):
        JobModel.from_profile(application)  # fits each application's profile once per process
    print(f"{'profiles':10s} {args.workload}: {time.perf_counter() - started:7.1f} s to load and fit the application profiles")
    status = 0
    for name in policies:
        started = time.perf_counter()
        workload = load_workload(args.workload)
        result = simulate(workload, name, check_invariants=not args.no_check)
        data = summary(result)
        wall = time.perf_counter() - started
        target = TARGET_S.get(name)
        verdict = "" if target is None else (f"  [target < {target:.0f} s: {'ok' if wall < target else 'MISSED'}]")
        if target is not None and wall >= target:
            status = 1
        print(
            f"{name:10s} {args.workload}: {wall:7.1f} s wall, {result.rounds} rounds "
            f"({1000 * wall / max(result.rounds, 1):.1f} ms/round), avg JCT {data['avg_jct_s']:,.0f} s{verdict}"
        )
    return status


if __name__ == "__main__":
    sys.exit(main())
