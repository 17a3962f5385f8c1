"""How long a rank takes to start in each runtime of the worker agent, side by side: from the plan
that places it until its first training step is reported (the emulated job, silod.jobs.emulated).

    .venv/bin/python benchmarks/rank_start.py [--runtimes process contained container] [--repeats 5]
                                              [--warmup 1] [--image IMAGE] [--json F]

One real `silod worker-agent` per runtime (process, contained, container; contained and container
need root, container the Docker Engine) against an in-process metadata service and the tests'
scripted AllocationService, reporting every 50 ms. Each repetition places a fresh one-rank job on
each agent in turn (so a drift of the machine's load touches every runtime alike), measures from
the plan's push until a task report carries the rank's first progress, then takes it off again
and waits for its exit. The container runtime uses ``--image`` (default: the tests' job image,
tests/support/docker_engine.py, built or reused; the Engine is started if none runs), which is
local: no pull is timed. ``--warmup`` launches per runtime come first and are not counted. The
figures are medians (min-max beside them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from silod.launcher import ServiceProcess, start_service  # noqa: E402
from silod.v1 import allocation_pb2, common_pb2, plan_pb2  # noqa: E402
from tests.worker_agent.scripted_allocation import AllocationServer  # noqa: E402

RUNTIMES = ("process", "contained", "container")
REPORT_S = 0.05


def _wait(predicate, timeout: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.005)
    raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")


def _assignment(job: str) -> plan_pb2.TaskAssignment:
    return plan_pb2.TaskAssignment(
        job_id=job, rank=0, world_size=1, gpu_indices=[0], master_addr="127.0.0.1", master_port=29521,
        batch_size=8, generation=1,
        spec=common_pb2.JobSpec(name=job, min_gpus=1, max_gpus=1, batch_size=8, sample_budget=10**9,
                                emulated_step_compute_s=0.01))


class Bench:
    def __init__(self, root: Path, runtimes: list[str], image: str) -> None:
        self.root = root
        self.procs: list[ServiceProcess] = []
        self.allocation = AllocationServer().__enter__()
        metadata = self._start("metadata", "--db", f"sqlite:///{root / 'md.db'}", "--log-level", "warning")
        self.version: dict[str, int] = {}
        for runtime in runtimes:
            extra = ["--default-image", image] if runtime == "container" else []
            self._start("worker-agent", "--metadata-address", metadata.address, "--scheduler-address",
                        self.allocation.address, "--node-name", f"bench-{runtime}", "--gpus", "1",
                        "--work-dir", str(root / runtime), "--heartbeat-s", "0.5", "--report-s", str(REPORT_S),
                        "--checkpoint-deadline-s", "10", "--log-level", "warning", "--runtime", runtime, *extra)
            self.version[runtime] = 0

    def _start(self, *args: str) -> ServiceProcess:
        proc = start_service(*args, workdir=self.root / "logs")
        self.procs.append(proc)
        return proc

    def _reports(self, job: str) -> list[tuple[float, allocation_pb2.TaskReport]]:
        return [(at, t) for at, r in list(self.allocation.servicer.reports) for t in r.tasks if t.job_id == job]

    def start_once(self, runtime: str, job: str) -> float:
        """Seconds from the plan's push to the first report of the rank's progress."""
        node = f"bench-{runtime}"
        self.version[runtime] += 1
        pushed = time.time()
        self.allocation.push(plan_pb2.NodePlan(version=self.version[runtime], node=node, tasks=[_assignment(job)]))

        def first_step() -> float:
            for at, t in self._reports(job):
                if t.progress.samples_done > 0:
                    return at
                if t.phase == allocation_pb2.TASK_PHASE_EXITED:
                    raise RuntimeError(f"{job} on {node} exited with {t.exit_code}: {t.exit_reason}")
            return 0.0

        started = _wait(first_step, 120, f"{job}'s first step on {node}")
        self.version[runtime] += 1
        self.allocation.push(plan_pb2.NodePlan(version=self.version[runtime], node=node))
        _wait(lambda: any(t.phase == allocation_pb2.TASK_PHASE_EXITED for _, t in self._reports(job)), 60,
              f"{job} stopped")
        return started - pushed

    def close(self) -> None:
        for proc in reversed(self.procs):
            proc.close()
        self.allocation.__exit__(None, None, None)


def _job_image() -> tuple[str, object]:
    """The tests' job image (built or reused) and the engine handle to release."""
    from tests.support import docker_engine

    engine = docker_engine.acquire_engine()
    with docker_engine.locked(docker_engine.CACHE / "build.lock"):
        return docker_engine.build_job_image(engine), engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runtimes", nargs="+", choices=RUNTIMES, default=list(RUNTIMES))
    parser.add_argument("--repeats", type=int, default=5, help="counted launches per runtime")
    parser.add_argument("--warmup", type=int, default=1, help="launches per runtime before the counted ones")
    parser.add_argument("--image", default="", help="the container runtime's image (default: the tests' job image)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats: must be 1 or more")
    if args.warmup < 0:
        parser.error("--warmup: must be 0 or more")
    if len(set(args.runtimes)) != len(args.runtimes):
        parser.error("--runtimes: each runtime once")
    if args.image and "container" not in args.runtimes:
        parser.error("--image: only the container runtime uses an image")

    image, engine = args.image, None
    if "container" in args.runtimes and not image:
        image, engine = _job_image()
    spans: dict[str, list[float]] = {r: [] for r in args.runtimes}
    with tempfile.TemporaryDirectory(prefix="silod-rank-start-") as tmp:
        bench = Bench(Path(tmp), args.runtimes, image)
        try:
            for i in range(args.warmup + args.repeats):
                for runtime in args.runtimes:
                    span = bench.start_once(runtime, f"{runtime}-{i}")
                    if i >= args.warmup:
                        spans[runtime].append(span)
        finally:
            bench.close()
            if engine is not None:
                from tests.support import docker_engine

                docker_engine.release_engine(engine)  # type: ignore[arg-type]
    figures = {r: {"median_s": statistics.median(s), "min_s": min(s), "max_s": max(s), "runs": s}
               for r, s in spans.items()}
    print(f"rank start (plan pushed -> first step reported), {args.repeats} runs each, median (min-max):")
    for runtime, f in figures.items():
        print(f"  {runtime:10s} {f['median_s']:.3f} s ({f['min_s']:.3f}-{f['max_s']:.3f})")
    if "container" in figures:
        for other in ("process", "contained"):
            if other in figures:
                extra = figures["container"]["median_s"] - figures[other]["median_s"]
                print(f"  container - {other}: {extra:+.3f} s")
    if args.json:
        args.json.write_text(json.dumps({"image": image, "report_s": REPORT_S, "figures": figures}, indent=2) + "\n")


if __name__ == "__main__":
    main()
