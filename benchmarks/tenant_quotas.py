"""Tenant quotas in the simulator: three tenants on a Philly-derived workload, one of which lends
its idle quota and then wants it back.

Run: ``python benchmarks/tenant_quotas.py [--policy fifo --policy tiresias ...] [--out DIR]``.

The cluster is the simulator's default (16 nodes x 4 GPUs, 60 s rounds, 30 s restarts). Quotas
(nominal GPUs, the whole cluster between them): ``team-a`` 24, ``team-b`` 24, ``team-c`` 16.

- ``team-b`` and ``team-c`` share a steady stream of Philly jobs (``silod simulate generate
  --philly``: 8 hours of the trace, alternating tenants), more than their quotas hold.
- ``team-a`` submits a burst of Philly jobs in the first half hour, then nothing until
  ``--return-h`` (default 3 h), when a second burst arrives: meanwhile its quota is lent to the
  other two, and the second burst must take it back from them.

Each policy runs twice on the same workload: with the quotas, and without any (the policy
alone). Reported, per run:

- the guarantee is *delivered* in a round when no waiting job of team-a would fit in the part
  of its 24 GPUs it does not hold (a rigid job larger than that waits for team-a's own jobs,
  by its policy's order, like on a cluster of its own). ``guarantee_met_after_s``: from the
  first job of team-a's second burst to the first round that delivers it;
  ``short_of_guarantee_s``: over the 4 hours from that first job, the seconds of rounds that
  do not; ``full_share_after_s``: until team-a first holds all 24;
- ``gpu_utilization``: GPU-seconds allocated / (64 x makespan) (simulator.metrics.summary), and
  ``window_utilization``: the mean share of the 64 GPUs allocated over the rounds between the
  first and the last arrival (the contended part, where lending matters);
- each tenant's average JCT and job count.

Raw JSON (one file per run plus ``summary.json``) goes to ``--out``
(default ``benchmarks/results/tenant-quotas-2026-11-28``). ``--round-cost`` instead times one
round of 2,000 jobs on 512 nodes x 8 GPUs with and without three quotas (``round-cost.json``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time

try:
    import simulator  # noqa: F401
except ImportError:  # run from a clone without installing
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from scheduler.quotas import TenantQuota, usage  # noqa: E402
from simulator import generate_philly, summary  # noqa: E402
from simulator.cluster import ClusterSpec  # noqa: E402
from simulator.engine import Simulator  # noqa: E402
from simulator.workload import JobSpec, workload_from_jobs  # noqa: E402

QUOTAS = {"team-a": TenantQuota(gpus={"": 24}), "team-b": TenantQuota(gpus={"": 24}), "team-c": TenantQuota(gpus={"": 16})}
OWNER = "team-a"
DEFAULT_OUT = pathlib.Path(__file__).resolve().parent / "results" / "tenant-quotas-2026-11-28"


def workload(stream_jobs: int, burst_jobs: int, return_s: float, seed: int) -> tuple[tuple[JobSpec, ...], float]:
    """The three tenants' jobs, by arrival, and the time team-a's demand returns."""
    stream = generate_philly(stream_jobs, seed, hours=8.0, load=8.0 / 6.0, max_gpu_hours=100.0)  # 6 hours of arrivals
    jobs = [dataclasses.replace(j, name=f"bc-{k}", tenant=("team-b", "team-c")[k % 2]) for k, j in enumerate(stream)]
    burst = generate_philly(2 * burst_jobs, seed + 1, hours=8.0, load=48.0, max_gpu_hours=100.0)  # 10 minutes of arrivals
    for k, j in enumerate(burst):
        shift = 0.0 if k % 2 == 0 else return_s
        jobs.append(dataclasses.replace(j, name=f"a-{k}", tenant=OWNER, arrival_s=j.arrival_s + shift))
    second = min(j.arrival_s for j in jobs if j.tenant == OWNER and j.arrival_s >= return_s)
    return tuple(sorted(jobs, key=lambda j: (j.arrival_s, j.name))), second


def run(policy: str, jobs: tuple[JobSpec, ...], quotas, returned_s: float) -> dict:  # type: ignore[no-untyped-def]
    rounds: list[dict] = []

    def watch(snapshot, plan) -> None:  # type: ignore[no-untyped-def]
        held = usage(snapshot, plan)
        mine = [j for j in snapshot.jobs if j.tenant == OWNER]
        room = QUOTAS[OWNER].nominal_gpus - held.get(OWNER, 0)
        # Whether a waiting job of team-a would fit in what its share left unused: the share was
        # then not delivered (a job larger than that waits for team-a's own jobs, by its policy).
        denied = any(not plan.gpus_of(j.job_id) and j.requested <= room for j in mine)
        rounds.append({"t": snapshot.time_s, "held": held, "owner_demand": sum(j.requested for j in mine),
                       "owner_denied": denied, "allocated": sum(held.values())})

    started = time.perf_counter()
    sim = Simulator(workload_from_jobs(jobs), policy, ClusterSpec(), check_invariants=False, quotas=quotas, on_round=watch)
    result = dataclasses.replace(sim.run(), wall_time_s=time.perf_counter() - started)
    data = summary(result)
    nominal = QUOTAS[OWNER].nominal_gpus
    met = next((r["t"] - returned_s for r in rounds if r["t"] >= returned_s and r["owner_demand"] > 0
                and not r["owner_denied"]), None)
    # Every round from the return on (4 hours): seconds in which its share was not delivered,
    # and when it first held its whole nominal share.
    after = [r for r in rounds if returned_s <= r["t"] <= returned_s + 4 * 3600.0]
    short_s = sum(b["t"] - a["t"] for a, b in zip(after, after[1:]) if a["owner_denied"])
    full = next((r["t"] - returned_s for r in after if r["held"].get(OWNER, 0) >= nominal), None)
    arrivals = [j.arrival_s for j in jobs]
    window = [r for r in rounds if min(arrivals) <= r["t"] <= max(arrivals)]
    spans = [(b["t"] - a["t"], a["allocated"]) for a, b in zip(window, window[1:])]
    total = ClusterSpec().total_gpus
    tenants = {}
    for tenant in sorted({j.tenant for j in result.jobs}):
        mine = [j.jct_s for j in result.jobs if j.tenant == tenant]
        tenants[tenant] = {"jobs": len(mine), "avg_jct_s": round(sum(mine) / len(mine), 1)}
    owner_after = [r for r in rounds if r["t"] >= returned_s][:30]
    return {
        "policy": policy, "quotas": bool(quotas),
        "guarantee_met_after_s": met,
        "short_of_guarantee_s": short_s, "full_share_after_s": full,
        "gpu_utilization": data["gpu_utilization"],
        "window_utilization": round(sum(d * g for d, g in spans) / (total * sum(d for d, _ in spans)), 4) if spans else None,
        "tenants": tenants,
        "avg_jct_s": data["avg_jct_s"], "makespan_s": data["makespan_s"], "restarts": data["restarts"],
        "rounds": data["rounds"], "wall_time_s": round(result.wall_time_s, 1),
        "owner_rounds_after_return": owner_after,
    }


def round_cost(policies: list[str], out: pathlib.Path) -> None:
    """Wall time of one round with and without three quotas (2,000 jobs on 512 nodes x 8 GPUs,
    benchmarks/scheduling_round.py's snapshot, jobs spread over three tenants)."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    from scheduling_round import build_snapshot

    from scheduler.quotas import schedule
    from scheduler.registry import get_policy

    snap = build_snapshot(2000, 512, 8)
    tenants = ("team-a", "team-b", "team-c")
    plain = dataclasses.replace(snap, jobs=tuple(dataclasses.replace(j, tenant=tenants[k % 3]) for k, j in enumerate(snap.jobs)))
    quoted = dataclasses.replace(plain, quotas={"team-a": TenantQuota(gpus={"": 1536}), "team-b": TenantQuota(gpus={"": 1024}),
                                                "team-c": TenantQuota(gpus={"": 512})})
    rows = []
    for name in policies:
        policy = get_policy(name)
        policy.schedule(plain)  # warm up
        row = {"policy": name}
        for label, s in (("no_quotas_s", plain), ("quotas_s", quoted)):
            started = time.perf_counter()
            schedule(policy, s)
            row[label] = round(time.perf_counter() - started, 3)
        rows.append(row)
        print(f"round, 2,000 jobs on 4,096 GPUs: {name:<10} {row['no_quotas_s']:.2f} s without quotas, "
              f"{row['quotas_s']:.2f} s with three", flush=True)
    (out / "round-cost.json").write_text(json.dumps(rows, indent=1) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", action="append", dest="policies", help="policies to run (default fifo, tiresias, pollux)")
    parser.add_argument("--stream-jobs", type=int, default=320, help="team-b and team-c jobs (default 320)")
    parser.add_argument("--burst-jobs", type=int, default=40, help="team-a jobs per burst (default 40)")
    parser.add_argument("--return-h", type=float, default=3.0, help="hours until team-a's second burst (default 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
    parser.add_argument("--round-cost", action="store_true",
                        help="instead: time one round of 2,000 jobs on 512 x 8 GPUs with and without quotas")
    args = parser.parse_args()
    policies = args.policies or ["fifo", "tiresias", "pollux"]
    if args.round_cost:
        args.out.mkdir(parents=True, exist_ok=True)
        round_cost(policies, args.out)
        return 0
    jobs, returned_s = workload(args.stream_jobs, args.burst_jobs, args.return_h * 3600.0, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for policy in policies:
        for quotas in (QUOTAS, None):
            r = run(policy, jobs, quotas, returned_s)
            label = f"{policy}-{'quotas' if quotas else 'no-quotas'}"
            (args.out / f"{label}.json").write_text(json.dumps(r, indent=1) + "\n")
            results.append(r)
            met = "never" if r["guarantee_met_after_s"] is None else f"{r['guarantee_met_after_s']:.0f} s"
            full = "never" if r["full_share_after_s"] is None else f"{r['full_share_after_s']:.0f} s"
            jcts = ", ".join(f"{t} {v['avg_jct_s'] / 3600:.2f} h" for t, v in r["tenants"].items())
            print(f"{label:<22} guarantee met after {met:>6}, short of it {r['short_of_guarantee_s']:>5.0f} s, "
                  f"24 GPUs after {full:>6}  util {r['gpu_utilization']:.3f} "
                  f"(window {r['window_utilization']:.3f})  avg JCT: {jcts}  [{r['wall_time_s']:.0f} s]", flush=True)
    summary_doc = {
        "command": "python benchmarks/tenant_quotas.py " + " ".join(sys.argv[1:]),
        "cluster": ClusterSpec().describe(),
        "quotas": {t: q.nominal_gpus for t, q in QUOTAS.items()},
        "owner": OWNER, "owner_demand_returns_s": returned_s,
        "jobs": {t: sum(1 for j in jobs if j.tenant == t) for t in sorted({j.tenant for j in jobs})},
        "runs": [{k: v for k, v in r.items() if k != "owner_rounds_after_return"} for r in results],
    }
    (args.out / "summary.json").write_text(json.dumps(summary_doc, indent=1) + "\n")
    print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
