"""Processes a test run left running: started after the run began, from this checkout (its path
in their command line), and not the run's own. The suite's last step looks for them (tests/conftest.py):
a leftover is a test, or the product, that did not stop what it started (one was a contained rank
whose init outlived its stopped agent, worker_agent/runtimes/sandbox.py).

Linux /proc only; elsewhere nothing is found."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Leftover:
    pid: int
    command: str


def _start_ticks(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] in ("Z", "X"):  # ended, not yet reaped: nothing left to stop
        return None
    return int(fields[19])  # field 22, starttime: after the name and state, the 20th


def _ancestors(pid: int) -> set[int]:
    seen = set()
    while pid > 1 and pid not in seen:
        seen.add(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return seen


def find(root: Path) -> list[Leftover]:
    """Processes whose command line names ``root`` and that started after this process did, other
    than it and its ancestors."""
    me = os.getpid()
    since = _start_ticks(me)
    if since is None or not Path("/proc").is_dir():
        return []
    mine = _ancestors(me)
    needle = str(root).encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in mine:
            continue
        pid = int(entry.name)
        try:
            command = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        started = _start_ticks(pid)
        if needle in command and started is not None and started >= since:
            found.append(Leftover(pid, command.replace(b"\0", b" ").decode(errors="replace").strip()))
    return sorted(found, key=lambda leftover: leftover.pid)


def wait_for_none(root: Path, grace_s: float) -> list[Leftover]:
    """The leftovers still there after up to ``grace_s`` (processes still shutting down end meanwhile)."""
    deadline = time.monotonic() + grace_s
    while True:
        left = find(root)
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.5)


def kill(leftovers: list[Leftover]) -> None:
    for leftover in leftovers:
        try:
            os.kill(leftover.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


# ---- the host's network, as the lab and the tests' Docker daemon change it ------------------
@dataclass(frozen=True)
class HostNetwork:
    namespaces: frozenset[str]  # named network namespaces (ip netns)
    forward_policy: str | None  # iptables' FORWARD policy; None where it cannot be read


def host_network() -> HostNetwork:
    try:
        namespaces = frozenset(entry.name for entry in Path("/var/run/netns").iterdir())
    except OSError:
        namespaces = frozenset()
    return HostNetwork(namespaces, _forward_policy())


def _forward_policy() -> str | None:
    import shutil
    import subprocess

    from tests.support import docker_engine  # it reads the policy to put it back after its daemon

    if os.geteuid() != 0 or shutil.which("iptables") is None:
        return None
    try:
        return docker_engine.forward_policy()
    except (docker_engine.DockerUnavailable, OSError, subprocess.SubprocessError):
        return None


def network_changes(before: HostNetwork, after: HostNetwork) -> list[str]:
    """What a run left changed of the host's network, in words (empty: nothing)."""
    changes = [f"network namespace {name!r} left behind" for name in sorted(after.namespaces - before.namespaces)]
    if before.forward_policy and after.forward_policy and before.forward_policy != after.forward_policy:
        changes.append(f"iptables' FORWARD policy is {after.forward_policy}, was {before.forward_policy} "
                       "(a Docker daemon's DROP cuts the lab's hosts off)")
    return changes
