"""A Python process that has already imported what a training rank needs, waiting for its rank.

    python -m worker_agent.warm_process torch torch.distributed silod.job ...

A new rank of a DDP job spends seconds before its first step just starting Python and importing
PyTorch: on a loaded node, most of the time a grow takes (benchmarks/elastic_resize.py). The
worker agent keeps a few of these processes started ahead of need (worker_agent.warm_start):
each imports the modules named on its command line, then blocks on one line on standard input,
the order to become a rank:

    {"argv": ["train.py", "--lr", "0.1"], "env": {...}, "cwd": "...", "log": ".../rank-2.log"}

It then looks to the script exactly as ``python train.py --lr 0.1`` would (``argv`` may also be
``["-m", "module", ...]``): its output goes to the log, its environment and working directory
are the task's, ``sys.argv``/``sys.path[0]`` are what the interpreter would have set, the
script runs as ``__main__``, and its exit status is the process's. The agent launches it only
when nothing read at interpreter start-up differs (see warm_start.eligible).

What differs, for someone looking from outside: the command line (``ps``) stays the warm
process's, and ``/proc/PID/environ`` shows the environment it started with (the task's is in
effect inside). Idle, the process is named ``silod-warm`` (``pgrep silod-warm``).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import runpy
import sys


IDLE_NAME = "silod-warm"  # an idle warm process's name in ps -o comm, top, pgrep


def set_name(name: str) -> None:
    """The process name tools show (not its command line, which stays as started)."""
    try:
        with open("/proc/self/comm", "w") as comm:
            comm.write(name[:15])
    except OSError:  # not Linux: names are cosmetic
        pass


def apply_thread_count(value: str | None) -> None:
    """What OMP_NUM_THREADS would have done at start-up: PyTorch's intra-op thread count (it
    sets OpenMP's and MKL's). The agent sends only positive integers here (warm_start.eligible);
    without it, or without PyTorch loaded, the process keeps what it started with, as a cold one
    would."""
    torch = sys.modules.get("torch")
    if value and value.isdigit() and int(value) > 0 and torch is not None:
        torch.set_num_threads(int(value))


def become(order: dict) -> None:
    """Turn this process into the task ``order`` describes and run it (returns when it ends)."""
    set_name(os.path.basename(sys.executable))  # what a cold start shows
    log = os.open(order["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    if "sandbox" in order:  # the contained runtime's rank: into its sandbox before anything runs
        from worker_agent.runtimes.sandbox import SandboxError, contain

        try:
            contain(order["sandbox"])
        except (SandboxError, OSError) as exc:
            print(f"--- silod: cannot contain the rank: {exc}", flush=True)
            os._exit(127)
    os.chdir(order["cwd"])
    os.environ.clear()
    os.environ.update(order["env"])
    os.environ["SILOD_WARM_START"] = "1"  # the one addition: the SDK says so when the rank is ready
    apply_thread_count(os.environ.get("OMP_NUM_THREADS"))
    argv = list(order["argv"])
    # What the interpreter says and does when there is nothing to run, as a cold start would.
    if argv[0] == "-m":
        # As `python -m`: the working directory first on the path; runpy sets argv[0] to the
        # module's file.
        sys.argv = argv[1:]
        sys.path[0] = os.getcwd()
        if importlib.util.find_spec(argv[1]) is None:
            print(f"{sys.executable}: No module named {argv[1]}", file=sys.stderr)
            raise SystemExit(1)
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        script = os.path.abspath(argv[0])
        sys.path[0] = os.path.dirname(script)
        if not os.path.isfile(script):
            print(f"{sys.executable}: can't open file {script!r}: [Errno 2] No such file or directory", file=sys.stderr)
            raise SystemExit(2)
        runpy.run_path(argv[0], run_name="__main__")


def main() -> int:
    set_name(IDLE_NAME)
    for name in sys.argv[1:]:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - not in this interpreter: the task imports what it needs itself
            pass
    line = sys.stdin.buffer.readline()
    if not line.strip():  # the agent closed the pool: nothing to run
        return 0
    become(json.loads(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
