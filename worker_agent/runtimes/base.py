"""The seam between what the agent decides and how a rank runs.

The agent decides *what* runs where and when: plans, generations, resizes, stops, reports. A
runtime decides *how* one rank runs: it starts it, signals it, waits for it and finds what a
previous agent left behind. Kubernetes' kubelet talks to any container runtime through the CRI
in the same way; Slurm's task plugins play the part for its ranks.

The agent holds one :class:`Runtime` and, per launched rank, the :class:`RankProcess` its
``start`` returned. Everything a runtime needs to start a rank is in :class:`RankLaunch`, worked
out by the agent before it asks: a runtime never reads plans or talks to the scheduler.
"""

from __future__ import annotations

import abc
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class LaunchError(Exception):
    """The rank could not be started; the message says why (it goes to the rank's log and the
    job's state), naming what was wrong: the command, the image, the user range, ..."""


@dataclass(frozen=True)
class RankLaunch:
    """One rank to start: what the agent has worked out from its assignment."""

    key: str  # "job/rank/generation" it is launched as: names its leftovers' records
    job_id: str
    command: list[str]
    env: dict[str, str]  # its whole environment (the runtime adds nothing a job could misuse)
    work_dir: Path  # its working directory, also where the agent keeps its logs
    log_path: Path  # its standard output and error are appended here
    checkpoint_dir: Path
    gpus: list[int] = field(default_factory=list)
    resize_in_place: bool = False  # may run in a warm process where the runtime keeps them
    read_paths: list[str] = field(default_factory=list)  # host paths it may read besides the runtime's own
    image: str = ""  # the job's container image ("" = none asked for)
    cpus: float = 0.0  # cores it may use (0 = no limit)
    memory_bytes: int = 0  # memory it may use (0 = no limit)


@dataclass(frozen=True)
class RankExit:
    """How a rank ended: its exit status (128 + N for signal N) and, where the runtime knows
    more than the status says, why (``"out of memory: ..."``)."""

    code: int
    reason: str = ""


class RankProcess(abc.ABC):
    """A started rank, as long as it runs."""

    pid: int = 0  # its process on this host, for status and logs (0 where it has none yet)
    warm: bool = False  # it runs in a process started ahead of need

    @abc.abstractmethod
    def signal(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the rank and every process it started; nothing if it has ended."""

    @abc.abstractmethod
    async def wait(self) -> RankExit:
        """Wait until the rank and what it started have ended."""


class Runtime(abc.ABC):
    """How this node runs ranks."""

    name: str = ""  # "process", "contained", "container": what `silod nodes` shows
    # Ranks start from the agent's environment (less its settings) rather than from a minimal
    # one: only where they run as the agent's user anyway.
    inherits_agent_env: bool = False
    # Ranks see the agent's process (the same PID namespace): the SDK then watches it, for the
    # processes a rank started that would outlive a killed agent. Where every process of a rank
    # dies with its namespace (and so with the agent), there is nothing to watch.
    sees_agent_process: bool = False
    # Ranks see only what is mounted for them: they need the cache server's reader paths.
    own_root: bool = True
    # Ranks run in an image whose own PATH, LANG, ... apply: the agent's are not passed on (only
    # the variables the operator lets through, rank_env_passthrough).
    image_env: bool = False
    # The interpreter a job without a command runs ``-m silod.jobs.emulated`` with ("" = the
    # agent's own, sys.executable; an image's is its own ``python3``).
    python: str = ""

    async def prepare(self, grace_s: float) -> None:
        """Before the first plan: stop ranks a previous agent on this work_dir left running (it
        was killed, not stopped), SIGTERM then SIGKILL after ``grace_s``; their GPUs are in no
        table, so they must be gone first. Then get ready to start ranks."""

    @abc.abstractmethod
    async def start(self, launch: RankLaunch) -> RankProcess:
        """Start the rank; raise :class:`LaunchError` when it cannot be."""

    def forget(self, launch_key: str) -> None:
        """The rank launched as ``launch_key`` has ended and been reaped: drop what records it
        (a later agent must not stop it as a leftover)."""

    async def close(self) -> None:
        """The agent is shutting down and every rank has ended: release what the runtime holds."""

    def describe(self) -> str:
        """One line on what this runtime isolates, for the agent's start-up log."""
        return self.name


def note_image_unused(log: Any, launch: RankLaunch, runtime: str) -> None:
    """A job that names an image, on a node that runs no containers: its log says so."""
    if launch.image:
        log.write(f"--- silod: this node runs no containers (runtime {runtime}): image {launch.image} is not used\n"
                  .encode())
        log.flush()
