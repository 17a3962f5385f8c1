"""``silod simulate``: run, compare and generate trace-driven simulations.

    silod simulate --workload CSV --policy NAME [--cluster YAML] [--seed N] --out DIR
    silod simulate run ...                      (the same, spelled out)
    silod simulate compare --workload CSV --policy A --policy B ... [--cluster YAML] [--cache all] --out DIR
    silod simulate generate --philly --jobs N --seed S --out CSV
    silod simulate shape --philly [--vc ID]     (the trace's jobs, days and GPU demand by week)
    silod simulate mix --workload CSV --pattern diurnal --rate R --seed S --out CSV   (training + inference rows)
    silod simulate list                         (packaged workloads and registered policies)

Bad input (unknown policy, missing file, malformed CSV row or YAML field) exits with status 2
and one message naming the problem; a run that cannot finish (a policy that never places a
job, a plan that breaks an invariant) exits with status 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from simulator import cli_options

USAGE_ERROR = 2
RUN_ERROR = 1


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Add ``simulate`` and its actions to the ``silod`` parser."""
    sim = sub.add_parser(
        "simulate",
        help="trace-driven cluster simulation of the scheduling policies",
        description=(
            "Simulate a workload on a GPU cluster with one of silod's scheduling policies, using the same policy "
            "and estimator code as the live scheduler. Without an ACTION, runs one simulation "
            "(same options as 'silod simulate run')."
        ),
        epilog="Workloads: a CSV or Gavel .trace path, or a packaged name like workload-6, workloads/workload-6.csv, "
               "workloads-2.0/workload-3, gavel/msr-seed0-0e4a51, philly (the whole Philly trace), philly/6214e9 (one virtual cluster).",
    )
    _add_run_flags(sim, required=False)
    sim.set_defaults(handler=_run, simulate_parser=sim)
    actions = sim.add_subparsers(dest="simulate_action", metavar="ACTION")

    run = actions.add_parser("run", help="run one policy on a workload (the default action)",
                             description="Run one policy on a workload and write summary.json, jobs.csv and plots to --out.")
    _add_run_flags(run, required=True)
    run.set_defaults(handler=_run)

    cmp_ = actions.add_parser("compare", help="run several policies on one workload, side by side",
                              description="Run each --policy on the same workload and cluster, in parallel processes "
                                          "(--jobs); write compare.md, compare.json, compare.png and one directory per "
                                          "policy to --out.")
    cmp_.add_argument("--workload", required=True, metavar="CSV", help="workload CSV path or packaged name")
    cmp_.add_argument("--policy", dest="policies", action="append", required=True, metavar="NAME",
                      help="policy to run (repeat, or comma-separate: --policy fifo --policy tiresias)")
    _add_common_flags(cmp_)
    cmp_.add_argument("--jobs", type=int, default=None, metavar="N",
                      help="simulations at once, one process each (default: one per core, here "
                           f"{_cores()}; 1 = one after another in this process)")
    cmp_.add_argument("--out", required=True, metavar="DIR", help="directory for the results")
    cmp_.set_defaults(handler=_compare)

    gen = actions.add_parser("generate", help="write a workload CSV sampled from the Philly trace",
                             description="Sample jobs from the packaged Microsoft Philly trace into a Pollux-format "
                                         "workload CSV (mapping in docs/evaluation.md).")
    gen.add_argument("--philly", action="store_true", required=True, help="sample the Philly trace (the only source so far)")
    gen.add_argument("--jobs", type=int, default=None, metavar="N", help="number of jobs to sample (or --replay)")
    gen.add_argument("--replay", action="store_true",
                     help="every job of the trace at its own arrival time and GPU count instead of a sample "
                          "(the same as --workload philly; --seed picks the even-odds applications)")
    gen.add_argument("--vc", default=None, metavar="ID", help="--replay: only the jobs of this virtual cluster")
    gen.add_argument("--seed", type=int, default=0, metavar="S", help="random seed (default 0)")
    gen.add_argument("--hours", type=float, default=8.0, metavar="H", help="submission window in hours of the day (default 8)")
    gen.add_argument("--start-hour", type=float, default=0.0, metavar="H", help="hour of day the window starts (default 0)")
    gen.add_argument("--load", type=float, default=1.0, metavar="X",
                     help="arrival-rate multiplier: arrival times are divided by X (default 1)")
    gen.add_argument("--max-gpus", type=int, default=None, metavar="G",
                     help="cap on a job's GPUs (default 64; --replay: none but the application's batch limits)")
    gen.add_argument("--mix", default="pollux", choices=("pollux", "io"),
                     help="applications by GPU-hours: pollux (the artifact's mapping, default) or io (image and speech only)")
    gen.add_argument("--max-gpu-hours", type=float, default=1000.0, metavar="H",
                     help="sample only Philly jobs under H GPU-hours (default 1000, at most 1000)")
    gen.add_argument("--out", required=True, metavar="CSV", help="file to write")
    gen.set_defaults(handler=_generate)

    shape = actions.add_parser("shape", help="the Philly trace's shape: jobs, days, GPU demand by week",
                               description="Print what the packaged Philly trace (or one virtual cluster) asked of its "
                                           "cluster as it ran there: jobs, days, GPU-hours, GPUs busy by week.")
    shape.add_argument("--philly", action="store_true", required=True, help="the Philly trace (the only source so far)")
    shape.add_argument("--vc", default=None, metavar="ID", help="only the jobs of this virtual cluster")
    shape.set_defaults(handler=lambda args: _guarded(lambda: _print_shape(args.vc)))

    mix = actions.add_parser("mix", help="write a DeepBoot workload: training rows plus generated inference tasks",
                             description="Copy a workload's training rows and add inference tasks drawn by "
                                         "simulator.inference.generate_inference_tasks (columns "
                                         "name,time,application,num_replicas,batch_size,duration,num_task).")
    mix.add_argument("--workload", required=True, metavar="CSV", help="training workload (path or packaged name)")
    mix.add_argument("--pattern", default="diurnal", choices=("steady", "diurnal", "bursty"), help="arrival pattern (default diurnal)")
    mix.add_argument("--rate", type=float, required=True, metavar="R", help="mean task arrivals per second")
    mix.add_argument("--horizon-s", type=float, default=None, metavar="S",
                     help="arrivals in [0, S) (default: the last training arrival + 1 h)")
    mix.add_argument("--period-s", type=float, default=86_400.0, metavar="S", help="diurnal period (default 86400)")
    mix.add_argument("--amplitude", type=float, default=0.8, metavar="A", help="diurnal amplitude in [0, 1] (default 0.8)")
    mix.add_argument("--burst-factor", type=float, default=10.0, metavar="F", help="bursty: burst rate / calm rate (default 10)")
    mix.add_argument("--duration-s", type=float, nargs=2, default=(1.0, 10.0), metavar=("LOW", "HIGH"),
                     help="task GPU seconds, uniform in [LOW, HIGH] (default 1 10)")
    mix.add_argument("--services-per-model", type=int, default=1, metavar="K", help="services infer-<model>-1..K (default 1)")
    mix.add_argument("--seed", type=int, default=0, metavar="S", help="random seed (default 0)")
    mix.add_argument("--out", required=True, metavar="CSV", help="file to write")
    mix.set_defaults(handler=_mix)

    conv = actions.add_parser("convert", help="write silod's CSV of a Gavel trace (.trace as Gavel writes it)",
                              description="Read a Gavel trace (tab-separated, 7 fields a row as in Gavel's msr traces "
                                          "or 10 as its generator writes them; the layout is told from the content) "
                                          "and write silod's CSV of it: job_type,total_steps,arrival_s,scale_factor. "
                                          "--workload takes either file and gives the same jobs.")
    conv.add_argument("trace", metavar="TRACE", help="Gavel .trace file")
    conv.add_argument("--out", required=True, metavar="CSV", help="file to write")
    conv.set_defaults(handler=_convert)

    lst = actions.add_parser("list", help="list packaged workloads and registered policies")
    lst.set_defaults(handler=_list)


def _add_run_flags(p: argparse.ArgumentParser, required: bool) -> None:
    p.add_argument("--workload", required=required, metavar="CSV", help="workload CSV path or packaged name")
    p.add_argument("--policy", required=required, metavar="NAME", help="scheduling policy (see 'silod simulate list')")
    _add_common_flags(p)
    p.add_argument("--seed", type=int, default=None, metavar="N", help="seed for policies that take one (others are deterministic)")
    p.add_argument("--out", required=required, metavar="DIR", help="directory for summary.json, jobs.csv and the plots")


def _add_common_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster", metavar="YAML", help="cluster spec (default: 16 nodes x 4 GPUs, 60 s rounds, 30 s restarts)")
    p.add_argument("--cache", default="none", metavar="MODE",
                   help="dataset cache and remote IO: none (default), lru, static, quiver (independent of the scheduler) "
                        "or silod (co-designed with the policy); compare also takes a comma list or 'all'")
    p.add_argument("--set", dest="options", action="append", default=[], metavar="POLICY.OPTION=VALUE",
                   help="policy option, e.g. pollux.p=-0.5 or tiresias.thresholds_gpu_s=(3200,) (repeatable; "
                        "the POLICY. prefix may be left out with a single policy)")
    p.add_argument("--inference-protect-scale", type=float, default=1.0, metavar="X",
                   help="DeepBoot workloads: scale the inference replicas' protect times (30 s + 15 s per reuse, "
                        "at most 120 s) by X; 0 = no protect (default 1)")
    p.add_argument("--tenant-quotas", metavar="FILE", default=None,
                   help="tenant quotas (YAML/JSON 'tenants: {NAME: {gpus: N, ...}}', see docs/tenants.md); "
                        "jobs name their tenant in the workload's tenant column")
    p.add_argument("--quiet", action="store_true",
                   help="no progress and no result lines (progress is shown only when stderr is a terminal)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--no-check", action="store_true", help="skip the per-round plan invariant checks (faster)")


# --- helpers ---------------------------------------------------------------------------------


def _fail(message: str, code: int) -> int:
    print(f"silod simulate: error: {message}", file=sys.stderr)
    return code


def _cores() -> int:
    from simulator.parallel import default_jobs

    return default_jobs()


def _guarded(body):
    """Map expected failures to exit codes and one-line messages (never a traceback)."""
    from scheduler.invariants import PlanViolation
    from simulator.errors import SimulationStuck, SimulatorInputError

    try:
        return body()
    except SimulatorInputError as exc:
        return _fail(str(exc), USAGE_ERROR)
    except SimulationStuck as exc:
        return _fail(f"simulation stuck: {exc}", RUN_ERROR)
    except PlanViolation as exc:
        return _fail(f"plan broke an invariant: {exc}", RUN_ERROR)
    except OSError as exc:
        where = f" {exc.filename}" if getattr(exc, "filename", None) else ""
        return _fail(f"cannot write{where}: {exc.strerror or exc}", RUN_ERROR)
    except KeyboardInterrupt:
        return _fail("interrupted", 130)


def _result_line(s: dict[str, Any], out: Path) -> str:
    return (
        f"{s['policy']} on {s['workload']}: {s['jobs']} jobs, avg JCT {s['avg_jct_s']:,.0f} s, "
        f"p99 {s['p99_jct_s']:,.0f} s, makespan {s['makespan_s']:,.0f} s, GPU util {s['gpu_utilization']:.1%}, "
        f"rho max {s['rho_max']:.2f}, {s['restarts']} restarts, {s['wall_time_s']:.1f} s wall"
        + (f", cache {s['cache_mode']}, IO util {s['io_utilization']:.1%}" if s.get("cache_mode", "none") != "none" or s.get("io_utilization") else "")
        + (f", inference: {s['inference']['tasks']} tasks, wait p99 {s['inference']['wait_p99_s']:.2f} s, "
           f"{s['inference']['cold_start_share']:.1%} cold starts, {s['inference']['lent_gpu_hours']:,.1f} GPU-h lent"
           if "inference" in s else "")
        + f" -> {out}"
    )


# --- actions ---------------------------------------------------------------------------------


def _run(args: argparse.Namespace) -> int:
    missing = [flag for flag, value in (("--workload", args.workload), ("--policy", args.policy), ("--out", args.out)) if not value]
    if missing:
        return _fail(
            f"{', '.join(missing)} required: silod simulate --workload CSV --policy NAME --out DIR "
            "(or one of the actions: run, compare, generate, list)", USAGE_ERROR
        )
    problem = cli_options.check_policies([args.policy])
    if problem:
        return _fail(problem, USAGE_ERROR)

    def body() -> int:
        from simulator.cluster import load_cluster
        from simulator.errors import SimulatorInputError
        from simulator.metrics import write_outputs
        from simulator.runner import simulate
        from simulator.loading import load_workload

        options = cli_options.parse_options(args.options, [args.policy])
        workload = load_workload(args.workload)
        cluster = load_cluster(args.cluster)
        policy = cli_options.policy(args.policy, args.seed, options)
        quotas = cli_options.quotas(args)
        modes = cli_options.cache_modes(args.cache)
        if len(modes) != 1:
            raise SimulatorInputError(f"--cache {args.cache!r}: run takes one mode; use 'silod simulate compare' for several")
        from simulator.parallel import Board, Run, run_many

        def task(observer):
            return simulate(workload, policy, cluster, check_invariants=not args.no_check, observer=observer,
                            cache_mode=modes[0], protect_scale=args.inference_protect_scale, quotas=quotas)

        with Board(not args.quiet) as board:
            (result,) = run_many([Run(args.policy, task)], 1, board)
        data = write_outputs(result, args.out, plots=not args.no_plots)
        if not args.quiet:
            print(_result_line(data, Path(args.out)))
        return 0

    return _guarded(body)


def _compare(args: argparse.Namespace) -> int:
    names = [n.strip() for value in args.policies for n in value.split(",") if n.strip()]
    if not names:
        return _fail("--policy: give at least one policy", USAGE_ERROR)
    if len(set(names)) != len(names):
        return _fail("--policy: each policy may appear once", USAGE_ERROR)
    problem = cli_options.check_policies(names)
    if problem:
        return _fail(problem, USAGE_ERROR)

    def body() -> int:
        import dataclasses

        from simulator.cluster import load_cluster
        from simulator.metrics import write_compare
        from simulator.runner import simulate
        from simulator.loading import load_workload

        from simulator.errors import SimulatorInputError
        from simulator.parallel import Board, Run, default_jobs, run_many

        if args.jobs is not None and args.jobs < 1:
            raise SimulatorInputError(f"--jobs: expected a number >= 1, got {args.jobs}")
        options = cli_options.parse_options(args.options, names)
        workload = load_workload(args.workload)
        cluster = load_cluster(args.cluster)
        modes = cli_options.cache_modes(args.cache)
        quotas = cli_options.quotas(args)

        def task(name: str, mode: str, label: str):
            def run(observer):
                result = simulate(workload, cli_options.policy(name, None, options), cluster, check_invariants=not args.no_check,
                                  observer=observer, cache_mode=mode, protect_scale=args.inference_protect_scale,
                                  quotas=quotas)
                return dataclasses.replace(result, policy=label)
            return run

        runs = [Run(label, task(name, mode, label)) for name in names for mode in modes
                for label in [name if len(modes) == 1 else f"{name}/{mode}"]]  # the label is also the output directory
        with Board(not args.quiet) as board:
            results = run_many(runs, args.jobs or default_jobs(), board)
        data = write_compare(results, args.out, plots=not args.no_plots)
        if not args.quiet:
            print((Path(args.out) / "compare.md").read_text().rstrip())
            print(f"-> {args.out}")
        return 0 if data else RUN_ERROR

    return _guarded(body)


def _generate(args: argparse.Namespace) -> int:
    def body() -> int:
        from simulator.errors import SimulatorInputError
        from simulator.philly import generate_philly, replay_philly
        from simulator.workload import write_workload

        if args.replay:
            if args.jobs is not None:
                raise SimulatorInputError("--replay takes every job of the trace; leave out --jobs")
            jobs = replay_philly(args.seed, cluster=args.vc, max_gpus=args.max_gpus, mix=args.mix)
        elif args.jobs is None:
            raise SimulatorInputError("--jobs N (a sample) or --replay (every job) required")
        elif args.vc is not None:
            raise SimulatorInputError("--vc goes with --replay")
        else:
            jobs = generate_philly(args.jobs, args.seed, hours=args.hours, start_hour=args.start_hour, load=args.load,
                                   max_gpus=64 if args.max_gpus is None else args.max_gpus, mix=args.mix,
                                   max_gpu_hours=args.max_gpu_hours)
        write_workload(jobs, args.out)
        print(f"wrote {len(jobs)} jobs to {args.out}", file=sys.stderr)
        return 0

    return _guarded(body)


def _print_shape(vc: str | None) -> int:
    from simulator.philly import describe_shape, trace_shape

    print(describe_shape(trace_shape(vc), "Philly trace" if vc is None else f"Philly virtual cluster {vc}"))
    return 0


def _convert(args: argparse.Namespace) -> int:
    def body() -> int:
        from simulator.errors import SimulatorInputError
        from simulator.gavel_trace import looks_like_gavel_tsv, read_gavel_tsv, write_gavel_csv
        from simulator.loading import read_text

        path = Path(args.trace)
        if not path.is_file():
            raise SimulatorInputError(f"trace {path}: no such file")
        text = read_text(path)
        if not looks_like_gavel_tsv(text):
            raise SimulatorInputError(f"trace {path}: not a Gavel trace (tab-separated rows of 7 or 10 fields)")
        count = write_gavel_csv(read_gavel_tsv(text, str(path)), args.out)
        print(f"wrote {count} jobs to {args.out}", file=sys.stderr)
        return 0

    return _guarded(body)


def _mix(args: argparse.Namespace) -> int:
    def body() -> int:
        from simulator.errors import SimulatorInputError
        from simulator.inference import ArrivalPattern, generate_inference_tasks, mixed_rows
        from simulator.loading import load_workload

        workload = load_workload(args.workload)
        horizon = args.horizon_s if args.horizon_s is not None else workload.jobs[-1].arrival_s + 3600.0
        try:
            pattern = ArrivalPattern(args.pattern, rate_per_s=args.rate, period_s=args.period_s, amplitude=args.amplitude,
                                     burst_factor=args.burst_factor)
            tasks = generate_inference_tasks(seed=args.seed, horizon_s=horizon, pattern=pattern,
                                             services_per_model=args.services_per_model, duration_s=tuple(args.duration_s))
        except ValueError as exc:
            raise SimulatorInputError(f"mix: {exc}") from None
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(mixed_rows(workload.jobs, tasks), encoding="utf-8")
        print(f"wrote {len(workload.jobs)} training jobs and {len(tasks)} inference tasks to {out}", file=sys.stderr)
        return 0

    return _guarded(body)


def _list(args: argparse.Namespace) -> int:
    from scheduler.registry import policy_names
    from simulator.workload import packaged_workloads

    print("policies: " + ", ".join(policy_names()))
    print("packaged workloads:")
    for name in packaged_workloads():
        print(f"  {name}")
    print("  philly (every job of the Philly trace at its own arrival time; philly/<virtual cluster> for one)")
    return 0
