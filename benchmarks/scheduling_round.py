"""Time one scheduling round of every registered policy on a large cluster.

Run: ``python benchmarks/scheduling_round.py [--jobs 2000] [--nodes 512] [--gpus-per-node 8] [--runs 3]``.

The snapshot: ``--jobs`` active jobs of the six profiled applications (chosen at random),
each asking for 1-8 GPUs (``requested_gpus``) and elastic between 1 GPU and what its batch
limits allow (``max_batch_size // min_local_bsz``, at most 64 GPUs, as the simulator sets
it), with random arrival times, progress and attained service; the current plan is a FIFO
one (jobs in arrival order get their requested GPUs while they fit), so about half the
jobs are running and policies that keep jobs in place have work to do. Rigid policies (fifo,
sjf, tiresias, themis) give jobs their requested count; elastic ones (gavel's candidates,
pollux) may choose any count in the bounds.

``--gpu-types v100,p100,k80`` gives the nodes those types in turn and every job its models
on them (estimator.gpu_types). ``--compare-partitions 1,2,4`` instead times gavel's LP split
POP-style into that many parts and measures the quality lost against the first (unsplit); 0 is
gavel's default (one LP, or past ``partition_jobs`` distinct jobs its price solver).
``--set OPTION=VALUE`` passes an option to the policies timed (e.g. ``--policy gavel --set
objective=makespan``: every job its own normalizer, so no two jobs share an LP row).
``--own-models`` gives every job models of its own (its speed on each type off by up to 30 %, as
jobs refitted from their own steps are), so no two jobs are alike under either objective.

Each policy is called once to warm up (profile loading, imports), then ``--runs`` timed
calls; the table shows the median and the slowest call (wall time), the median CPU time of
the process (what a call costs on an idle core; on a shared machine wall time is larger), how
many jobs got GPUs and how many GPUs were handed out, how many allocations the policy changes
when asked again with its own plan in force and nothing else changed, and once more after that
(0, 0: the plan stands until something changes; n, 0: it settles after one round, as policies
that re-balance the plan they started from do; both above 0: jobs are moved, and restarted,
round after round), then the load average. With gavel, a line
gives its level (the lowest normalized rate the LP guarantees every job) and, from the price
solver, an upper bound on the unpartitioned LP's level, so the gap to it (target: at most 1 %);
``--check-level`` solves the unpartitioned LP too (HiGHS; slow) and prints the measured gap.

Targets (issue 4): gavel well under 1 s, pollux under 5 s; on three GPU types at 20,000 jobs and
4,096 nodes (heterogeneous-GPU issue): gavel under 1 s of CPU, every usable GPU placed, also with
distinct jobs (``--set objective=makespan``), its level within 1 % of the unpartitioned LP's.
gavel remembers its last LPs' answers (a simulation round with no arrival or departure
reuses one); the benchmark forgets them before every timed call, so each call solves its LP.
Likewise fifo, sjf and tiresias keep what their last call worked out and answer a call like it
from that in milliseconds (scheduler.policies.fifo_queue, ranked_queue); the benchmark drops it
before every timed call, so each is a whole pass, the cost of a round over a snapshot they have
not followed (``benchmarks/live_scheduler.py`` times the rounds answered from what they kept).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import statistics
import sys
import time

import numpy as np

try:
    import scheduler  # noqa: F401
except ImportError:  # run from a clone without installing
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from estimator.job_model import JobModel  # noqa: E402
from estimator.profiles import POLLUX_APPLICATIONS  # noqa: E402
from scheduler.invariants import check_plan  # noqa: E402
from estimator.gpu_types import on_type, typed_models  # noqa: E402
from scheduler.placement import TypeRoom, place, plan_from_placements  # noqa: E402
from scheduler.policy import ClusterSnapshot, JobInfo, NodeInfo  # noqa: E402
from scheduler.policies.gavel import forget_lps  # noqa: E402
from scheduler.policies.memo import memo_of  # noqa: E402
from scheduler.registry import get_policy, policy_names  # noqa: E402


def build_snapshot(jobs: int, nodes: int, gpus_per_node: int, seed: int = 0, gpu_types: tuple[str, ...] = (),
                   own_models: bool = False) -> ClusterSnapshot:
    rng = np.random.default_rng(seed)
    apps = POLLUX_APPLICATIONS
    models = {app: JobModel.from_profile(app) for app in apps}
    by_type = {app: typed_models(models[app], gpu_types) for app in apps}
    now = 86_400.0
    # Typed: node k has type k mod len(types), so every type has a share of the nodes.
    cluster = tuple(NodeInfo(name=f"node-{k:04d}", gpus=gpus_per_node, gpu_type=gpu_types[k % len(gpu_types)] if gpu_types else "")
                    for k in range(nodes))
    infos = []
    arrivals = np.sort(rng.uniform(0.0, now, jobs))
    for k in range(jobs):
        app = apps[int(rng.integers(len(apps)))]
        model = models[app]
        requested = int(rng.integers(1, 9))
        by_batch = max(1, model.bounds.max_batch_size // model.bounds.min_local_bsz)
        target = float(rng.uniform(1e6, 1e8))
        type_models = by_type[app]
        if own_models:  # as if refitted from the job's own steps: its speed on each type off by up to 30 %
            model = on_type(model, model.gpu_type, float(rng.uniform(0.7, 1.3)))
            type_models = {t: on_type(m, t, float(rng.uniform(0.7, 1.3))) for t, m in type_models.items()}
        infos.append(
            JobInfo(
                job_id=f"job-{k:05d}",
                model=model,
                submit_time_s=float(arrivals[k]),
                min_gpus=1,
                max_gpus=max(requested, min(64, by_batch)),
                target_samples=target,
                samples_done=float(rng.uniform(0.0, 0.9)) * target,
                requested_gpus=requested,
                attained_gpu_s=float(rng.uniform(0.0, 1.0)) * (now - arrivals[k]) * requested,
                restarts=int(rng.integers(0, 4)),
                type_models=type_models,
            )
        )
    bare = ClusterSnapshot(time_s=now, nodes=cluster, jobs=tuple(infos))
    # Current plan: FIFO by arrival with requested GPUs while they fit (on one type).
    room = TypeRoom(bare)
    admitted = {}
    every_type = bare.gpu_types()
    for job in infos:
        gpu_type = room.claim(job.requested, every_type)
        if gpu_type is not None:
            admitted[job.job_id] = (job.requested, gpu_type)
    current = plan_from_placements(place(bare, {j: n for j, (n, _) in admitted.items()},
                                         preferences={j: (t,) for j, (_, t) in admitted.items()}).placements)
    return ClusterSnapshot(time_s=now, nodes=cluster, jobs=tuple(infos), current=current)


def _forget_memos(policy) -> None:
    memo = memo_of(policy)  # fifo's queue, sjf's and tiresias' ranked jobs
    if memo is not None:
        memo.forget()


def time_policy(name: str, snapshot: ClusterSnapshot, runs: int,
                options: dict | None = None) -> tuple[float, float, float, int, int, tuple[int, int]]:
    """``(median wall s, slowest wall s, median CPU s, jobs placed, GPUs used, changed again)`` of
    ``runs`` rounds; the last: the allocations the policy changes when asked again with its own
    plan in force and nothing else changed, and again after that (0, 0: the plan stands; n, 0: it
    settles after one round; both above 0: it moves jobs round after round).

    CPU time is the process's (every thread): what the round costs on an idle core. On a
    machine shared with other work the wall time is that times the share of a core it gets.
    """
    policy = get_policy(name, **(options or {}))
    plan = policy.schedule(snapshot)  # warm-up
    check_plan(snapshot, plan)
    timings, cpu = [], []
    for _ in range(runs):
        forget_lps()  # time a round that solves its LP, not one that reuses the last answer
        _forget_memos(policy)  # nor one that fifo, sjf or tiresias answer from what they kept
        start, cpu_start = time.perf_counter(), time.process_time()
        plan = policy.schedule(snapshot)
        timings.append(time.perf_counter() - start)
        cpu.append(time.process_time() - cpu_start)
    running = sum(1 for a in plan.allocations.values() if a.gpus)
    gpus = sum(a.gpus for a in plan.allocations.values())
    changed = []
    for _ in range(2):
        again = policy.schedule(dataclasses.replace(snapshot, current=plan))
        changed.append(sum(1 for job_id in plan.allocations.keys() | again.allocations.keys()
                           if plan.get(job_id) != again.get(job_id)))
        plan = again
    return statistics.median(timings), max(timings), statistics.median(cpu), running, gpus, (changed[0], changed[1])


def compare_partitions(snapshot: ClusterSnapshot, counts: list[int], runs: int, options: dict | None = None) -> None:
    """gavel's LP split into P parts (POP) against the whole LP: CPU time and quality of the allocation.

    Quality is measured on the whole problem: the lowest and the mean normalized throughput
    (``sum_c X thr / ref``, the max-min objective and what water-filling raises) of the
    stitched allocation, relative to the unpartitioned LP's.
    """
    from scheduler.policies.gavel import GavelPolicy

    print(f"{'partitions':>10} {'solve s':>8} {'round s':>8} {'min norm':>9} {'mean norm':>10} {'loss min':>9} "
          f"{'loss mean':>10} {'GPUs used':>10}   (seconds of CPU)")
    base = None
    for parts in counts:
        policy = GavelPolicy(**{**(options or {}), "partitions": parts})
        solve_times, round_times = [], []
        for _ in range(runs):
            forget_lps()
            start = time.process_time()
            solved = policy.solve(snapshot)
            solve_times.append(time.process_time() - start)
            forget_lps()
            start = time.process_time()
            plan = policy.schedule(snapshot)
            round_times.append(time.process_time() - start)
        check_plan(snapshot, plan)
        norm = solved.normalized_throughput()
        has = np.bincount(solved.job, minlength=len(solved.jobs)) > 0
        low, mean = float(norm[has].min()), float(norm[has].mean())
        if base is None:
            base = (low, mean)
        used = sum(a.gpus for a in plan.allocations.values())
        label = "0 (prices)" if parts == 0 else str(parts)
        print(f"{label:>10} {statistics.median(solve_times):>8.3f} {statistics.median(round_times):>8.3f} {low:>9.4g} "
              f"{mean:>10.4g} {1 - low / base[0]:>9.2%} {1 - mean / base[1]:>10.2%} {used:>10d}")


def gavel_level(snapshot: ClusterSnapshot, options: dict | None, check: bool) -> None:
    """gavel's level (the lowest normalized rate the LP guarantees every job) against the
    unpartitioned LP's: the price solver's own upper bound on it, and with ``check`` the LP itself
    (one HiGHS LP over every job: tens of seconds at 20,000 distinct jobs)."""
    from scheduler.policies.gavel import GavelPolicy

    policy = GavelPolicy(**(options or {}))
    solved = policy.solve(snapshot)
    unit = "1/s: 1 / the makespan" if policy.objective == "makespan" else "normalized throughput"
    if solved.bound is not None:
        gap = 1 - solved.level / solved.bound if solved.bound > 0 else 0.0
        print(f"gavel level {solved.level:.6g} ({unit}), by prices; the unpartitioned LP's is at most "
              f"{solved.bound:.6g}: gap <= {gap:.4%} (target <= 1 %)")
    else:
        print(f"gavel level {solved.level:.6g} ({unit}), from HiGHS' LP over the round's distinct jobs (the LP's own)")
    if check:
        forget_lps()
        start = time.process_time()
        whole = GavelPolicy(**{**(options or {}), "partitions": 1}).solve(snapshot)
        print(f"unpartitioned LP (HiGHS, {time.process_time() - start:.1f} s of CPU): level {whole.level:.6g}; "
              f"gap {1 - solved.level / whole.level:.4%}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2000, help="active jobs (default 2000)")
    parser.add_argument("--nodes", type=int, default=512, help="training nodes (default 512)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    parser.add_argument("--runs", type=int, default=3, help="timed calls per policy (default 3)")
    parser.add_argument("--policy", action="append", help="time only these policies (repeat); default: every registered one")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gpu-types", default="", help="comma list: nodes take these GPU types in turn (e.g. v100,p100,k80)")
    parser.add_argument("--compare-partitions", default="",
                        help="comma list of POP partition counts for gavel (e.g. 1,2,4): time and quality against the first")
    parser.add_argument("--own-models", action="store_true",
                        help="every job its own models (speeds off by up to 30 %%, as if refitted): no two jobs alike")
    parser.add_argument("--check-level", action="store_true",
                        help="gavel: also solve the unpartitioned LP with HiGHS and print the level's gap (slow)")
    parser.add_argument("--set", action="append", default=[], metavar="OPTION=VALUE",
                        help="policy option for the timed policies (repeat), e.g. objective=makespan")
    args = parser.parse_args(argv)
    options = {}
    for item in args.set:
        key, _, value = item.partition("=")
        try:
            options[key] = int(value)
        except ValueError:
            try:
                options[key] = float(value)
            except ValueError:
                options[key] = {"true": True, "false": False}.get(value.lower(), value)

    types = tuple(t for t in args.gpu_types.split(",") if t)
    snapshot = build_snapshot(args.jobs, args.nodes, args.gpus_per_node, args.seed, types, args.own_models)
    names = args.policy or policy_names()
    command = "python benchmarks/scheduling_round.py " + " ".join(sys.argv[1:] if argv is None else argv)
    print(f"$ {command.strip()}")
    print(
        f"{args.jobs} active jobs on {args.nodes} nodes x {args.gpus_per_node} GPUs "
        f"({snapshot.total_gpus} GPUs{', types ' + '/'.join(types) if types else ''}; "
        f"{len(snapshot.current.allocations)} jobs running before the round); "
        f"median of {args.runs} runs after a warm-up"
    )
    if args.compare_partitions:
        compare_partitions(snapshot, [int(p) for p in args.compare_partitions.split(",")], args.runs, options)
        return 0
    print(f"{'policy':<12} {'median s':>9} {'max s':>8} {'CPU s':>7} {'jobs placed':>12} {'GPUs used':>10} "
          f"{'changed again':>14}")
    for name in names:
        median, worst, cpu, running, gpus, again = time_policy(name, snapshot, args.runs, options)
        print(f"{name:<12} {median:>9.3f} {worst:>8.3f} {cpu:>7.3f} {running:>12d} {gpus:>10d} "
              f"{f'{again[0]}, {again[1]}':>14}")
    if "gavel" in names:
        gavel_level(snapshot, options, args.check_level)
    print(f"load average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
