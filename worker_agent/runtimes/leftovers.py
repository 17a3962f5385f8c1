"""Run records of rank process groups, and stopping the groups a killed agent left behind.

Each launched rank leads its own session and process group (pgid == its pid). Its record in
``run/`` holds its pid and start time. The leader itself dies with the agent that started it
(PR_SET_PDEATHSIG), but processes it started stay in its group. The pid of a dead leader cannot
be reused while its group has members, so members of that group are the rank's; a live process
with that pid but another start time is a stranger.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from services.runtime.structured_logging import get_logger

_log = get_logger("silod.worker_agent")


def start_time(pid: int) -> str:
    """The process's start time (Linux /proc), to tell it from a later process reusing the pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[19]


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group ``pgid`` (Linux /proc)."""
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def leftover_group(record: dict[str, Any]) -> bool:
    """Is the process group of a recorded rank still there?"""
    pid = int(record.get("pid", 0))
    if pid <= 0:
        return False
    start = start_time(pid)
    if start and start != record.get("start_time"):
        return False
    return bool(group_members(pid))


async def stop_groups(groups: list[tuple[int, Any]], grace_s: float) -> None:
    """SIGTERM to each process group (the SDK checkpoints), SIGKILL after ``grace_s``; returns
    when they are gone (or one survives SIGKILL for 10 s: stuck in the kernel, nothing to do)."""
    for pgid, what in groups:
        _log.warning("stopping a task left by a previous agent", extra={"task": what, "pgid": pgid})
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for pgid, _ in groups:
        killed_at = 0.0
        while group_members(pgid):
            now = time.monotonic()
            if not killed_at and now >= deadline:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pgid, signal.SIGKILL)
                killed_at = now
            elif killed_at and now - killed_at > 10.0:
                _log.error("a task left by a previous agent survives SIGKILL", extra={"pgid": pgid})
                break
            await asyncio.sleep(0.05)


class RunRecords:
    """``run/<key>.json`` per launched rank, until it is reaped."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir

    def _path(self, launch_key: str) -> Path:
        return self.run_dir / (launch_key.replace("/", "_") + ".json")

    def record(self, launch_key: str, pid: int, **extra: Any) -> None:
        self._path(launch_key).write_text(
            json.dumps({"task": launch_key, "pid": pid, "start_time": start_time(pid), **extra}))

    def forget(self, launch_key: str) -> None:
        self._path(launch_key).unlink(missing_ok=True)

    def read(self) -> list[dict[str, Any]]:
        """Every readable record; unreadable ones are dropped."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        records = []
        for path in self.run_dir.glob("*.json"):
            try:
                records.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                path.unlink(missing_ok=True)
        return records

    def clear(self) -> None:
        for path in self.run_dir.glob("*.json"):
            path.unlink(missing_ok=True)

    async def stop_leftovers(self, grace_s: float) -> None:
        """Stop the process groups of ranks a previous agent on this work_dir left running."""
        groups = [(int(r["pid"]), r.get("task")) for r in self.read() if leftover_group(r)]
        await stop_groups(groups, grace_s)
        self.clear()
