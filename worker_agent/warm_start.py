"""Warm processes: Python interpreters the agent starts ahead of need, so that a new rank of an
elastic job skips the seconds of interpreter start-up and ``import torch``.

When silod grows a job in place, the surviving ranks train on while the newcomers start, and
the job switches to its new size once the last newcomer is ready (silod.job.distributed): the
newcomers' start-up is the resize's critical path. A node keeps ``warm_processes`` processes of
its own interpreter that have imported ``warm_preload`` and wait (worker_agent.warm_process); a
rank that qualifies takes one instead of being started cold, and the pool starts a replacement.

A rank qualifies (:func:`eligible`) when its job resizes in place, its command is
``<python> script.py ...`` or ``<python> -m module ...`` with this node's interpreter, and its
environment agrees with the warm processes' on every variable read while the interpreter and
its native libraries start (PYTHON*, LD_*, OpenMP/BLAS thread settings, ...): such a variable is
applied too late in a warm process, so the rank is started cold instead.

The cost: each idle warm process holds an interpreter with PyTorch imported (about 280 MB of
resident memory on this machine). It is off by default (``warm_processes: 0``); the deployment
files turn it on for GPU nodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from services.runtime.structured_logging import get_logger

_log = get_logger("silod.worker_agent.warm_start")

# Variables read while the interpreter, its site packages and native libraries (OpenMP, BLAS,
# the allocator, the dynamic linker) start: too late to set in a warm process.
STARTUP_PREFIXES = ("PYTHON", "LD_", "OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "GOTO_", "MALLOC_", "TORCH_")
# Runs ``argv`` as a process of its own group that dies with the agent (the agent's trampoline).
Spawn = Callable[..., Awaitable[asyncio.subprocess.Process]]


# Start-up variables a warm process can still apply when it becomes a rank (warm_process.become):
# the thread count, through torch.set_num_threads. Set by the agent for ranks sharing a node.
RUNTIME_SETTABLE = ("OMP_NUM_THREADS",)


def startup_variables(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items()
            if k.startswith(STARTUP_PREFIXES) and not (k in RUNTIME_SETTABLE and v.isdigit() and int(v) > 0)}


def eligible(command: Sequence[str], env: Mapping[str, str], cwd: str, warm_env: Mapping[str, str],
             interpreter: str = sys.executable) -> bool:
    """Whether a rank running ``command`` with ``env`` in ``cwd`` may run in a warm process."""
    if len(command) < 2:
        return False
    if command[1] == "-m":
        if len(command) < 3:
            return False
    elif command[1].startswith("-"):  # other interpreter options: not what a warm process started with
        return False
    program = command[0]
    found = os.path.join(cwd, program) if os.sep in program else shutil.which(program, path=env.get("PATH"))
    if not found:
        return False
    try:
        # The same interpreter of the same environment: a venv's python is a link to the base
        # interpreter, so the directory must match too.
        same = os.path.samefile(found, interpreter) and (
            os.path.dirname(os.path.abspath(found)) == os.path.dirname(os.path.abspath(interpreter)))
    except OSError:
        return False
    return same and startup_variables(env) == startup_variables(warm_env)


class WarmPool:
    """Up to ``size`` idle warm processes; :meth:`take` hands one a task."""

    def __init__(self, size: int, preload: Sequence[str], env: Mapping[str, str], work_dir: Path,
                 spawn: Spawn) -> None:
        self.size = size
        self.preload = list(preload)
        self.env = dict(env)
        self.work_dir = work_dir
        self._spawn = spawn
        self._idle: list[asyncio.subprocess.Process] = []
        self._starting = 0
        self._refills: set[asyncio.Task[None]] = set()  # held: the event loop keeps only weak references
        self._closed = False
        self.served = 0  # tasks that ran in a warm process

    async def fill(self) -> None:
        """Start processes until ``size`` are idle or starting."""
        while not self._closed and len(self._idle) + self._starting < self.size:
            self._starting += 1
            try:
                with open(self.work_dir / "warm-processes.log", "ab") as log:
                    proc = await self._spawn(
                        sys.executable, "-m", "worker_agent.warm_process", *self.preload,
                        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.DEVNULL, stderr=log,
                        env=self.env, cwd=str(self.work_dir))
            except OSError as exc:
                _log.warning("cannot start a warm process; ranks start cold", extra={"error": str(exc)})
                return
            finally:
                self._starting -= 1
            if self._closed:
                await self._discard(proc)
                return
            self._idle.append(proc)

    async def take(self, command: Sequence[str], env: Mapping[str, str], cwd: str,
                   log_path: Path, sandbox: Mapping[str, Any] | None = None) -> asyncio.subprocess.Process | None:
        """A warm process now running ``command`` (its pid and exit status are the task's), or
        None: start it cold (not eligible, or no warm process left). ``sandbox``: the contained
        runtime's configuration, which the warm process applies to itself first
        (worker_agent.runtimes.sandbox.contain)."""
        if not eligible(command, env, cwd, self.env):
            return None
        order = {"argv": list(command[1:]), "env": dict(env), "cwd": cwd, "log": str(log_path)}
        if sandbox is not None:
            order["sandbox"] = {**sandbox, "agent_pid": os.getpid()}
        line = json.dumps(order)
        while self._idle:
            proc = self._idle.pop(0)
            if proc.returncode is not None or proc.stdin is None:
                continue
            try:
                proc.stdin.write(line.encode() + b"\n")
                await proc.stdin.drain()
                proc.stdin.close()
            except (BrokenPipeError, ConnectionResetError):  # it died while idle: try the next one
                await self._discard(proc)
                continue
            self.served += 1
            self._refill()
            return proc
        self._refill()
        return None

    def _refill(self) -> None:
        task = asyncio.ensure_future(self.fill())
        self._refills.add(task)
        task.add_done_callback(self._refills.discard)

    async def close(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        await asyncio.gather(*(self._discard(p) for p in idle))

    @staticmethod
    async def _discard(proc: asyncio.subprocess.Process) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # idle: nothing to save
        with contextlib.suppress(Exception):
            await proc.wait()
