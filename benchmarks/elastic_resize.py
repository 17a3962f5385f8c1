"""Time from a resize directive to the first optimizer step at the new size, and how long the
job stops training for it: in-place re-form versus checkpoint-restart of the same DDP job.

    python benchmarks/elastic_resize.py                 # 2->4 and 4->2 ranks, 3 runs each, ~10M parameters

Two real worker agents (2 emulated GPUs each) run examples/train_ddp_digits.py (PyTorch DDP,
gloo on CPU) with a ~10M-parameter MLP. The plans come from the scripted AllocationService of
the tests (the scheduler's decision is not what is measured), built with the scheduler's own
convert.node_plan. A run places the job at the first size, waits for it to train, pushes the
plans of the second size, and measures until rank 0 logs its first step at that size:

* in place: the plan carries fast_resize, surviving ranks re-form the process group
  (silod.job.distributed), newcomers are launched and receive the state from rank 0;
* checkpoint-restart: no fast_resize, every rank checkpoints and exits, all ranks of the new
  size are launched and load the checkpoint.

Two numbers per resize: "to new size" (plans pushed -> rank 0's first step at the new size) and
"stall": how much longer than a usual step rank 0's gap between its last step at the old size
and its first at the new size was (the gap minus the median gap between its steps before the
resize), i.e. the training time the resize cost. In place, a grow keeps training at the old
size while its newcomers start, so its stall is only the switch.

No GPU is present here: this measures gloo on CPU only (`make gpu-check` resizes over NCCL where GPUs are).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scheduler.live import convert  # noqa: E402
from silod.launcher import start_service  # noqa: E402
from silod.v1 import allocation_pb2, common_pb2, plan_pb2, worker_agent_pb2, worker_agent_pb2_grpc  # noqa: E402
from tests.worker_agent.scripted_allocation import AllocationServer  # noqa: E402

EXAMPLE = ROOT / "examples" / "train_ddp_digits.py"


def _steps(work_dirs: list[Path], job: str) -> list[dict]:
    found = []
    for work in work_dirs:
        for log in (work / "jobs" / job).glob("rank-*.log"):
            for line in log.read_text(errors="replace").splitlines():
                if line.startswith("step {"):
                    found.append(json.loads(line[5:]))
    return found


def _wait(predicate, timeout: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")


class Lab:
    def __init__(self, root: Path, hidden: int, warm_processes: int, runtime: str = "") -> None:
        self.root = root
        self.procs = []
        self.allocation = AllocationServer().__enter__()
        md = self._start("metadata", "--db", f"sqlite:///{root / 'md.db'}", "--log-level", "warning")
        self.metadata = md.address
        store = root / "digits"
        subprocess.run([sys.executable, str(EXAMPLE), "prepare", str(store)], check=True, capture_output=True)
        subprocess.run([sys.executable, "-m", "silod.cli", "dataset", "register", "digits", f"file://{store}",
                        "--metadata", self.metadata], check=True, capture_output=True)
        self.nodes = []
        for i in range(2):
            work = root / f"n{i}"
            agent = self._start("worker-agent", "--metadata-address", self.metadata, "--scheduler-address",
                                self.allocation.address, "--node-name", f"n{i}", "--gpus", "2", "--work-dir", str(work),
                                "--checkpoint-root", str(root / "checkpoints"), "--heartbeat-s", "0.5",
                                "--report-s", "0.5", "--checkpoint-deadline-s", "60", "--log-level", "warning",
                                "--warm-processes", str(warm_processes),
                                *(("--runtime", runtime) if runtime else ()),
                                "--contained-read-paths", f"{store},{EXAMPLE.parent}")
            self.nodes.append((f"n{i}", agent.address, work))
        self.hidden = hidden
        self.version = 0

    def _start(self, *args: str):  # type: ignore[no-untyped-def]
        proc = start_service(*args, workdir=self.root / "logs")
        self.procs.append(proc)
        return proc

    def place(self, job: str, generation: int, layout: dict[int, list[int]], fast: bool,
              previous: dict[str, plan_pb2.JobAllocation]) -> dict[str, plan_pb2.JobAllocation]:
        spec = common_pb2.JobSpec(
            name=job, min_gpus=1, max_gpus=4, batch_size=64, epochs=1000, dataset="digits", resize_in_place=True,
            command=[sys.executable, str(EXAMPLE)],
            env={"SILOD_EXAMPLE_HIDDEN": str(self.hidden), "SILOD_CHECKPOINT_EVERY_S": "3600"},
        )
        self.version += 1
        plan = plan_pb2.AllocationPlan(version=self.version)
        entry = plan.jobs.add(job_id=job, batch_size=64, generation=generation, fast_resize=fast)
        for i, gpus in sorted(layout.items()):
            entry.placements.add(node=self.nodes[i][0], gpu_indices=gpus)
        convert.assign_master_ports(plan, previous)
        addresses = {name: address for name, address, _ in self.nodes}
        for name, _, _ in self.nodes:
            view = convert.node_plan(plan, name, {job: spec}, addresses)
            self.allocation.push(view)
        return {job: entry}

    def stop(self, job: str, generation: int) -> None:
        self.version += 1
        for name, _, _ in self.nodes:
            self.allocation.push(plan_pb2.NodePlan(version=self.version, node=name))

        def gone() -> bool:
            import grpc

            for _, address, _ in self.nodes:
                with grpc.insecure_channel(address) as channel:
                    status = worker_agent_pb2_grpc.WorkerAgentServiceStub(channel).GetNodeStatus(
                        worker_agent_pb2.GetNodeStatusRequest(), timeout=10)
                if any(t.job_id == job and t.state != "exited" for t in status.tasks):
                    return False
            return True

        _wait(gone, 120, f"{job} stopped")

    def close(self) -> None:
        for proc in reversed(self.procs):
            proc.close()
        self.allocation.__exit__(None, None, None)


LAYOUTS = {2: {0: [0, 1]}, 4: {0: [0, 1], 1: [0, 1]}}


def measure(lab: Lab, run: int, before: int, after: int, fast: bool) -> tuple[float, float]:
    job = f"job-bench-{'inplace' if fast else 'restart'}-{before}to{after}-{run}"
    works = [w for _, _, w in lab.nodes]
    previous = lab.place(job, 1, LAYOUTS[before], fast=False, previous={})
    _wait(lambda: len([s for s in _steps(works, job) if s["world"] == before and s["rank"] == 0]) >= 3, 300,
          f"{job} training at {before}")
    started = time.time()
    lab.place(job, 2, LAYOUTS[after], fast=fast, previous=previous)
    first = _wait(lambda: [s for s in _steps(works, job) if s["world"] == after and s["rank"] == 0], 300,
                  f"{job} training at {after}")
    switched = min(s["t"] for s in first)
    old_times = sorted(s["t"] for s in _steps(works, job) if s["world"] == before and s["rank"] == 0)
    usual_gap = statistics.median(b - a for a, b in zip(old_times, old_times[1:]))
    lab.stop(job, 2)
    return switched - started, max(0.0, switched - old_times[-1] - usual_gap)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=3136, help="MLP width: 64-H-H-10 (3136: 10.0M parameters)")
    parser.add_argument("--warm-processes", type=int, default=2,
                        help="each agent's warm processes (worker_agent.warm_start; 0: every rank starts cold)")
    parser.add_argument("--runtime", choices=("process", "contained"), default="",
                        help="how the agents run the ranks (default: the agent's own default, contained as root)")
    parser.add_argument("--work-dir", type=Path, help="keep the services' and ranks' logs here (default: a temporary "
                        "directory, removed)")
    args = parser.parse_args(argv)
    params = 64 * args.hidden + args.hidden + args.hidden * args.hidden + args.hidden + args.hidden * 10 + 10
    print(f"model: {params / 1e6:.1f}M parameters; backend gloo on CPU (no GPU present); "
          f"{args.warm_processes} warm processes per agent; runtime {args.runtime or 'default'}; "
          f"load {os.getloadavg()[0]:.2f}")
    results: dict[tuple[int, int, bool], list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="silod-resize-bench-") as tmp:
        root = Path(tmp)
        if args.work_dir:
            root = args.work_dir
            root.mkdir(parents=True, exist_ok=True)
        lab = Lab(root, args.hidden, args.warm_processes, args.runtime)
        try:
            for run in range(args.runs):
                for before, after in ((2, 4), (4, 2)):
                    for fast in (True, False):  # side by side in one run: the machine is noisy
                        took, stall = measure(lab, run, before, after, fast)
                        results.setdefault((before, after, fast), []).append((took, stall))
                        print(f"run {run}: {before}->{after} {'in place' if fast else 'checkpoint-restart'}: "
                              f"to new size {took:.2f}s, stall {stall:.2f}s", flush=True)
        finally:
            lab.close()

    def cell(values: list[float]) -> str:
        return f"{statistics.median(values):.2f} s ({min(values):.2f}-{max(values):.2f})"

    print("\n| resize | measure | in place: median (min-max) | checkpoint-restart: median (min-max) | speed-up |")
    print("|---|---|---|---|---|")
    for before, after in ((2, 4), (4, 2)):
        for index, measure_name in ((0, "to new size"), (1, "stall")):
            fast = [r[index] for r in results[(before, after, True)]]
            slow = [r[index] for r in results[(before, after, False)]]
            ratio = (f"{statistics.median(slow) / statistics.median(fast):.1f}x" if statistics.median(fast) >= 0.05
                     else "no stall in place")  # below the steps' own jitter: a ratio would be noise
            print(f"| {before}->{after} | {measure_name} | {cell(fast)} | {cell(slow)} | {ratio} |")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
