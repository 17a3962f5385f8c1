"""Ranks as plain processes of the agent's user: the runtime of a node without containment.

Each rank leads a process group of its own, started through a trampoline that sets
PR_SET_PDEATHSIG=SIGKILL, so it dies with its agent as it would with the machine: the scheduler
requeues the job once the node's heartbeats stop, and a rank orphaned instead would keep running
unsupervised and write the job's checkpoint directory concurrently with the requeued generation.
Processes a rank started itself (same process group) do not inherit the death signal: the SDK in
them sees its agent gone (``SILOD_AGENT_PID``), writes no more checkpoints and asks the job to
exit; and the next agent on the same work_dir stops whole process groups it finds recorded in
``run/`` (:mod:`worker_agent.runtimes.leftovers`).

Signals go to the rank's whole process group. Where the agent keeps warm processes
(:mod:`worker_agent.warm_start`), a rank of a job that resizes in place takes one when it can.

What this isolates: nothing. A rank runs as the agent's user, sees every process of the node
and reads what the agent reads (docs/operators.md, "Job containment").
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from pathlib import Path
from typing import Any

from worker_agent.runtimes import leftovers
from worker_agent.runtimes.base import LaunchError, RankExit, RankLaunch, RankProcess, Runtime, note_image_unused
from worker_agent.warm_start import WarmPool

# Run as ``python -S -c DIE_WITH_AGENT AGENT_PID COMMAND...``: sets PR_SET_PDEATHSIG and execs
# the task's command (the death signal survives exec). A separate exec rather than Popen's
# preexec_fn because the agent has gRPC threads, and code run between fork and exec in a
# threaded process can deadlock. If the agent died before prctl took effect, exit at once.
# Without prctl (not Linux; /proc is needed elsewhere too) tasks outlive a killed agent.
DIE_WITH_AGENT = (
    "import ctypes, os, signal, sys\n"
    "PR_SET_PDEATHSIG = 1\n"
    "prctl = getattr(ctypes.CDLL(None, use_errno=True), 'prctl', None)\n"
    "if prctl is not None and prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:\n"
    "    sys.exit('silod: prctl(PR_SET_PDEATHSIG) failed: ' + os.strerror(ctypes.get_errno()))\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(137)\n"
    "try:\n"
    "    os.execvp(sys.argv[2], sys.argv[2:])\n"
    "except OSError as exc:\n"
    "    print(f'--- silod: cannot launch {sys.argv[2:]!r}: {exc}', flush=True)\n"
    "    os._exit(127)\n"
)


async def spawn(*argv: str, trampoline: bool = True, **kwargs: Any) -> asyncio.subprocess.Process:
    """Start ``argv`` as the leader of a new process group that dies with the agent (through
    the trampoline; without it, ``argv`` is a Python script run with ``-S`` that sees to that
    itself, as the contained runtime's sandbox does)."""
    prefix = ("-c", DIE_WITH_AGENT, str(os.getpid())) if trampoline else ()
    return await asyncio.create_subprocess_exec(sys.executable, "-S", *prefix, *argv, start_new_session=True,
                                                **kwargs)


def exit_status(returncode: int) -> int:
    """asyncio's returncode (-N for signal N) as a shell's exit status (128 + N)."""
    return returncode if returncode >= 0 else 128 - returncode


class GroupProcess(RankProcess):
    """A rank that leads its own process group."""

    def __init__(self, proc: asyncio.subprocess.Process, warm: bool = False) -> None:
        self.proc = proc
        self.pid = proc.pid
        self.warm = warm

    def signal(self, sig: signal.Signals) -> None:
        if self.proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    async def wait(self) -> RankExit:
        return RankExit(exit_status(await self.proc.wait()))


class ProcessRuntime(Runtime):
    name = "process"
    inherits_agent_env = True
    sees_agent_process = True
    own_root = False

    def __init__(self, run_dir: Path, warm: WarmPool | None = None) -> None:
        self.records = leftovers.RunRecords(run_dir)
        self.warm = warm

    async def prepare(self, grace_s: float) -> None:
        await self.records.stop_leftovers(grace_s)
        if self.warm is not None:
            await self.warm.fill()

    async def start(self, launch: RankLaunch) -> RankProcess:
        rank: RankProcess | None = None
        try:
            with open(launch.log_path, "ab") as log:
                note_image_unused(log, launch, self.name)
                if self.warm is not None and launch.resize_in_place:
                    proc = await self.warm.take(launch.command, launch.env, str(launch.work_dir), launch.log_path)
                    if proc is not None:
                        rank = GroupProcess(proc, warm=True)
                if rank is None:
                    rank = GroupProcess(await spawn(
                        *launch.command, stdin=asyncio.subprocess.DEVNULL, stdout=log,
                        stderr=asyncio.subprocess.STDOUT, env=launch.env, cwd=str(launch.work_dir)))
        except OSError as exc:
            raise LaunchError(f"cannot launch {launch.command!r}: {exc}") from None
        self.records.record(launch.key, rank.pid)
        return rank

    def forget(self, launch_key: str) -> None:
        self.records.forget(launch_key)

    async def close(self) -> None:
        if self.warm is not None:
            await self.warm.close()

    def describe(self) -> str:
        return "process: ranks run as the agent's user, uncontained"
