"""Check 5 of benchmarks/gpu_check.py: the SDK's time per step against plain DDP, one rank.

    python benchmarks/gpu_check_steps.py                  # on the GPU: 100.7M-parameter MLP, batch 512
    python benchmarks/gpu_check_steps.py --cpu            # a small model over gloo: a smoke run

The same model (``--depth`` Linear layers ``--width`` wide, ReLU between them; 6 x 4096 =
100.7M parameters) trains on random data in four variants:

* plain DDP: ``init_process_group("nccl")`` (gloo on the CPU) and
  ``DistributedDataParallel(model, device_ids=[0])``, with and without
  ``find_unused_parameters``, the loop ``forward; backward; optimizer.step()``;
* the SDK: ``silod.job.init()`` (off the cluster: a LocalContext, rank 0 of 1) and
  ``ctx.distributed(model, optimizer)``, with ``reproducible`` False and True (True asks DDP
  for find_unused_parameters), the loop ``trainer.step_boundary(); forward; backward;
  optimizer.step(); trainer.step_done(n)``.

A process has one default process group and the SDK's trainer owns it, so each variant runs in
a worker process of its own (all four started once, models built, warm-up steps taken). The
parent then asks them for their repetitions in turn, one at a time, the order rotated every
repetition: the variants see the same GPU, clocks and neighbours, and drift in the machine's
speed falls on all of them alike. A repetition is ``--steps`` steps timed with CUDA events (the
first step's start to the last step's end, over the steps: what the GPU's timeline shows, gaps
included), on the CPU with the wall clock; each variant's figure is the median over
``--reps`` repetitions.

World size 1 is what is compared: the all-reduce of DDP is then a copy, and the SDK's extra
work per step is its step-boundary flags (one all-reduce of 4 CPU numbers over gloo, which does
not wait for the GPU) and its counters. Its gradient-noise hooks are registered but return at
once: with one rank there is nothing to measure (``GradientNoise.active`` is False), which the
workers report.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

TARGET_OVERHEAD = 0.02  # the SDK may cost at most 2 % a step over plain DDP (issue 27)
GPU_SHAPE = {"width": 4096, "depth": 6, "batch": 512}  # 100.7M parameters
CPU_SHAPE = {"width": 256, "depth": 3, "batch": 64}  # a smoke run: seconds on a busy 2-core machine
WORKER_START_TIMEOUT_S = 300.0  # four processes importing torch and making CUDA contexts at once
REPLY_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Variant:
    name: str
    label: str
    sdk: bool
    unused: bool  # find_unused_parameters for plain DDP, reproducible for the SDK


VARIANTS = (
    Variant("plain", "plain DDP", sdk=False, unused=False),
    Variant("plain-fu", "plain DDP, find_unused_parameters=True", sdk=False, unused=True),
    Variant("sdk", "SDK, reproducible=False", sdk=True, unused=False),
    Variant("sdk-reproducible", "SDK, reproducible=True", sdk=True, unused=True),
)
# The SDK against the plain DDP that does the same DDP work.
PAIRS = (("sdk", "plain"), ("sdk-reproducible", "plain-fu"))


# ---- the worker: one variant in a process of its own ------------------------------------------

def _build_model(width: int, depth: int) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)  # every variant trains the same model
    layers: list[nn.Module] = []
    for i in range(depth):
        layers.append(nn.Linear(width, width))
        if i < depth - 1:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Worker:
    """One variant's model, optimizer, process group and training step."""

    def __init__(self, variant: Variant, device_type: str, width: int, depth: int, batch: int) -> None:
        import torch

        self.torch = torch
        self.variant = variant
        self.batch = batch
        model = _build_model(width, depth)
        self.params = sum(p.numel() for p in model.parameters())
        self.device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
        if variant.sdk:
            self._setup_sdk(model)
        else:
            self._setup_plain(model)
        generator = torch.Generator().manual_seed(1)
        self.inputs = torch.randn(batch, width, generator=generator).to(self.device)
        self.labels = torch.randint(0, width, (batch,), generator=generator).to(self.device)

    def _setup_plain(self, model: Any) -> None:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        # What torchrun gives a one-rank job.
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                          LOCAL_RANK="0")
        if self.device.type == "cuda":
            self.torch.cuda.set_device(self.device)
            dist.init_process_group("nccl")
            model.to(self.device)
            self.model = DistributedDataParallel(model, device_ids=[0], find_unused_parameters=self.variant.unused)
        else:
            dist.init_process_group("gloo")
            self.model = DistributedDataParallel(model, find_unused_parameters=self.variant.unused)
        self.optimizer = self.torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        self.backend = dist.get_backend()
        self.trainer = None
        self.noise_active = None

    def _setup_sdk(self, model: Any) -> None:
        import silod.job

        # A fresh checkpoint directory: the trainer resumes from any checkpoint it finds.
        self._checkpoints = tempfile.TemporaryDirectory(prefix="silod-gpu-check-")
        ctx = silod.job.init(self._checkpoints.name)
        if self.device.type == "cuda":
            model.to(self.device)  # before the optimizer, as a job does (the trainer would move it too)
        self.optimizer = self.torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        self.trainer = ctx.distributed(model, self.optimizer, reproducible=self.variant.unused)
        self.model = self.trainer.model
        self.backend = self.trainer.backend
        self.noise_active = self.trainer.noise.active

    def step(self) -> None:
        import torch.nn.functional as F

        trainer = self.trainer
        if trainer is not None:
            event = trainer.step_boundary()
            assert event.value == "continue", f"an off-cluster trainer said {event}"
        self.optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.model(self.inputs), self.labels)
        loss.backward()
        self.optimizer.step()
        if trainer is not None:
            trainer.step_done(self.batch)

    def timed_steps(self, steps: int) -> float:
        """Milliseconds a step over ``steps`` steps: CUDA events on the GPU, the wall clock on the CPU."""
        torch = self.torch
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(steps):
                self.step()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / steps
        began = time.perf_counter()
        for _ in range(steps):
            self.step()
        return (time.perf_counter() - began) * 1000 / steps

    def close(self) -> None:
        import torch.distributed as dist

        if self.trainer is not None:
            self.trainer.close()
            self._checkpoints.cleanup()
        elif dist.is_initialized():
            dist.destroy_process_group()


def _serve(args: argparse.Namespace) -> int:
    """The worker's side of the protocol: one JSON line when ready, then one per ``run N``."""
    sys.path.insert(0, str(ROOT))
    variant = next(v for v in VARIANTS if v.name == args.worker)
    worker = Worker(variant, "cpu" if args.cpu else "cuda", args.width, args.depth, args.batch)
    for _ in range(args.warmup):  # DDP's first steps rebuild its buckets; CUDA picks its kernels
        worker.step()
    worker.timed_steps(1)
    _reply({"ready": True, "params": worker.params, "device": str(worker.device), "backend": worker.backend,
            "noise_active": worker.noise_active})
    for line in sys.stdin:
        command = line.split()
        if command[:1] == ["run"]:
            _reply({"ms_per_step": worker.timed_steps(int(command[1]))})
        elif command[:1] == ["quit"]:
            break
    worker.close()
    return 0


def _reply(message: dict[str, Any]) -> None:
    print(json.dumps(message), flush=True)


# ---- the parent: start the workers, interleave their repetitions --------------------------------

class WorkerProcess:
    """A worker started for one variant; its replies arrive through a thread (a pipe has no timeout)."""

    def __init__(self, variant: Variant, options: argparse.Namespace, log_dir: Path) -> None:
        self.variant = variant
        self.log_path = log_dir / f"{variant.name}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("SILOD_")}  # the SDK's defaults
        if options.cpu:
            env["CUDA_VISIBLE_DEVICES"] = ""  # the SDK would otherwise pick the GPU
            env["OMP_NUM_THREADS"] = "1"  # a small model: threads would only fight over a busy machine's cores
        argv = [sys.executable, str(Path(__file__).resolve()), "--worker", variant.name,
                "--width", str(options.width), "--depth", str(options.depth), "--batch", str(options.batch),
                "--warmup", str(options.warmup), *(["--cpu"] if options.cpu else [])]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                         text=True, env=env, cwd=str(log_dir))
        self._replies: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                self._replies.put(line)
        self._replies.put(None)  # the worker exited

    def reply(self, timeout: float) -> dict[str, Any]:
        try:
            line = self._replies.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"{self.variant.label}: no answer within {timeout:g}s; log: {self._tail()}") from None
        if line is None:
            raise RuntimeError(f"{self.variant.label}: the worker exited ({self.proc.wait()}); log: {self._tail()}")
        return json.loads(line)

    def run(self, steps: int) -> float:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"run {steps}\n")
        self.proc.stdin.flush()
        return float(self.reply(REPLY_TIMEOUT_S)["ms_per_step"])

    def _tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-1500:]
        except OSError:
            return "(none)"

    def close(self) -> None:
        try:
            if self.proc.poll() is None and self.proc.stdin is not None:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
            self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


def compare(options: argparse.Namespace) -> dict[str, Any]:
    """Every variant's median ms a step, the SDK's overheads, and what the workers said of themselves."""
    with tempfile.TemporaryDirectory(prefix="silod-gpu-check-steps-") as tmp:
        workers = [WorkerProcess(v, options, Path(tmp)) for v in VARIANTS]
        try:
            ready = {w.variant.name: w.reply(WORKER_START_TIMEOUT_S) for w in workers}
            times: dict[str, list[float]] = {w.variant.name: [] for w in workers}
            for rep in range(options.reps):
                shift = rep % len(workers)  # a different variant goes first each repetition
                for worker in workers[shift:] + workers[:shift]:
                    times[worker.variant.name].append(worker.run(options.steps))
        finally:
            for worker in workers:
                worker.close()
    return summarize(options, ready, times)


def summarize(options: argparse.Namespace, ready: dict[str, dict[str, Any]],
              times: dict[str, list[float]]) -> dict[str, Any]:
    medians = {name: statistics.median(values) for name, values in times.items()}
    sdk = ready["sdk"]
    return {
        "device": sdk["device"],
        "params": sdk["params"],
        "shape": {"width": options.width, "depth": options.depth, "batch": options.batch},
        "steps": options.steps, "reps": options.reps, "warmup": options.warmup,
        "timing": "CUDA events" if sdk["device"].startswith("cuda") else "wall clock",
        "variants": {v.name: {"label": v.label, "backend": ready[v.name]["backend"], "ms_per_step": medians[v.name],
                              "reps_ms": times[v.name]} for v in VARIANTS},
        "overhead": {f"{a}/{b}": medians[a] / medians[b] - 1 for a, b in PAIRS},
        "noise_hooks_active": {name: ready[name]["noise_active"] for name in ("sdk", "sdk-reproducible")},
        "target_overhead": TARGET_OVERHEAD,
    }


def summary_line(result: dict[str, Any]) -> str:
    """One line: the SDK's default against plain DDP, the reproducible pair, the noise hooks."""
    v, overhead = result["variants"], result["overhead"]
    noise = ("gradient-noise hooks idle at world size 1" if not any(result["noise_hooks_active"].values())
             else "gradient-noise hooks ACTIVE at world size 1")
    return (f"SDK {v['sdk']['ms_per_step']:.2f} vs plain DDP {v['plain']['ms_per_step']:.2f} ms a step "
            f"({overhead['sdk/plain'] * 100:+.1f} %); reproducible=True {v['sdk-reproducible']['ms_per_step']:.2f} vs "
            f"find_unused_parameters {v['plain-fu']['ms_per_step']:.2f} ({overhead['sdk-reproducible/plain-fu'] * 100:+.1f} %); "
            f"{result['params'] / 1e6:.1f}M parameters, batch {result['shape']['batch']}, {result['device']}, "
            f"median of {result['reps']} x {result['steps']} steps ({result['timing']}); {noise}")


def table(result: dict[str, Any]) -> str:
    rows = ["| variant | backend | ms a step: median | repetitions (ms) |", "|---|---|---|---|"]
    for variant in VARIANTS:
        entry = result["variants"][variant.name]
        reps = ", ".join(f"{t:.2f}" for t in entry["reps_ms"])
        rows.append(f"| {entry['label']} | {entry['backend']} | {entry['ms_per_step']:.2f} | {reps} |")
    return "\n".join(rows)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags gpu_check.py shares with this script."""
    parser.add_argument("--cpu", action="store_true",
                        help="compare on the CPU over gloo with a small model (a smoke run; the 2 %% target is "
                             "for the GPU)")
    parser.add_argument("--steps", type=int, default=0, help="timed steps per repetition (default 50 on a GPU, 30 on the CPU)")
    parser.add_argument("--reps", type=int, default=0, help="repetitions per variant (default 7 on a GPU, 5 on the CPU)")
    parser.add_argument("--warmup", type=int, default=0, help="untimed steps first (default 10 on a GPU, 5 on the CPU)")
    parser.add_argument("--width", type=int, default=0, help="layer width (default 4096 on a GPU, 256 on the CPU)")
    parser.add_argument("--depth", type=int, default=0, help="Linear layers (default 6 on a GPU, 3 on the CPU)")
    parser.add_argument("--batch", type=int, default=0, help="samples a step (default 512 on a GPU, 64 on the CPU)")


def fill_defaults(options: argparse.Namespace) -> argparse.Namespace:
    shape = CPU_SHAPE if options.cpu else GPU_SHAPE
    counts = {"steps": 30, "reps": 5, "warmup": 5} if options.cpu else {"steps": 50, "reps": 7, "warmup": 10}
    for key, value in {**shape, **counts}.items():
        if not getattr(options, key):
            setattr(options, key, value)
    return options


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(parser)
    parser.add_argument("--worker", choices=[v.name for v in VARIANTS], help=argparse.SUPPRESS)
    options = fill_defaults(parser.parse_args(argv))
    if options.worker:
        return _serve(options)
    result = compare(options)
    print(summary_line(result))
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
