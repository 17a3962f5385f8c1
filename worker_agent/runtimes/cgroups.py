"""A control group per contained rank: its memory, CPU and process limits, and its devices.

Each rank gets a group of its own under the agent's own groups (``<agent's group>/silod/<node>-
<instance>/<rank>``, the instance a digest of the agent's state directory: stable across the
agent's restarts, which find their predecessor's leftovers there, and apart from any other agent
of the same node name on the host, whose groups it must never remove), so that a rank past its memory limit is killed alone, by the kernel, in its group,
and its neighbours never see the OOM killer. Limits:

* memory: ``memory_bytes`` (0 = none), swap included;
* CPU: ``cpus`` cores a period (CFS quota; 0 = none);
* processes and threads: ``pids`` (a fork bomb stops there);
* devices (cgroup v1's devices controller): only the harmless character devices and the rank's
  own GPUs may be opened, whatever device nodes it finds.

cgroup v1 (one hierarchy per controller, as on this project's test machines) is used where its
controllers are mounted; otherwise the unified hierarchy (v2), where there is no devices
controller (the sandbox's ``/dev`` then holds only the rank's own GPUs) and the agent needs a
delegated group (systemd: ``Delegate=yes``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

V1_CONTROLLERS = ("memory", "cpu", "pids", "devices")
CFS_PERIOD_US = 100_000
# Character devices every rank may open: null, zero, full, random, urandom, tty, ptmx, pts.
BASE_DEVICE_RULES = ("c 1:3 rwm", "c 1:5 rwm", "c 1:7 rwm", "c 1:8 rwm", "c 1:9 rwm", "c 5:0 rwm", "c 5:2 rwm",
                     "c 136:* rwm")
NVIDIA_MAJOR = 195  # /dev/nvidiaN (minor N), nvidiactl (255), nvidia-modeset (254)


class CgroupError(Exception):
    pass


@dataclass(frozen=True)
class Limits:
    memory_bytes: int = 0
    cpus: float = 0.0
    pids: int = 0
    device_rules: tuple[str, ...] = ()  # extra "c MAJOR:MINOR rwm" rules (the rank's GPUs)


def _mounts() -> dict[str, str]:
    """Controller ("memory", ..., "unified") -> where its hierarchy is mounted."""
    found: dict[str, str] = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        if tail[0] == "cgroup2":
            found.setdefault("unified", fields[4])
        elif tail[0] == "cgroup":
            for option in tail[2].split(","):
                if option in V1_CONTROLLERS:
                    found.setdefault(option, fields[4])
    return found


def _own_groups() -> dict[str, str]:
    """Controller -> this process's group path in that hierarchy ("unified" for v2)."""
    groups: dict[str, str] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if not controllers:
            groups["unified"] = path
        for controller in controllers.split(","):
            groups[controller] = path
    return groups


def gpu_device_rules(minors: list[int], uvm_major: int | None) -> tuple[str, ...]:
    """Rules opening the rank's own GPUs (``/dev/nvidiaN`` by minor number) and the driver's
    control devices, nothing of the other GPUs."""
    if not minors:
        return ()
    rules = [f"c {NVIDIA_MAJOR}:{m} rwm" for m in minors] + [f"c {NVIDIA_MAJOR}:255 rwm", f"c {NVIDIA_MAJOR}:254 rwm"]
    if uvm_major is not None:
        rules.append(f"c {uvm_major}:* rwm")
    return tuple(rules)


def char_major(name: str) -> int | None:
    """The major number of a character driver from /proc/devices (e.g. "nvidia-uvm")."""
    try:
        text = Path("/proc/devices").read_text()
    except OSError:
        return None
    block = text.split("Block devices:")[0]
    for line in block.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1] == name and parts[0].isdigit():
            return int(parts[0])
    return None


class RankGroup:
    """The groups of one rank: what its launcher joins, how it ended, removal."""

    def __init__(self, paths: dict[str, Path], version: int) -> None:
        self.paths = paths  # controller (or "unified") -> directory
        self.version = version

    @property
    def join(self) -> list[str]:
        return sorted({str(p) for p in self.paths.values()})

    def oom_killed(self) -> bool:
        """Did the kernel kill a process of this group for passing its memory limit?"""
        memory = self.paths.get("memory" if self.version == 1 else "unified")
        if memory is None:
            return False
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        try:
            text = (memory / name).read_text()
        except OSError:
            return False
        found = re.search(r"^oom_kill (\d+)$", text, re.M)
        return bool(found and int(found.group(1)) > 0)

    async def remove(self, wait_s: float = 10.0) -> None:
        """Remove the groups once their last process has gone (the kernel kills the namespace's
        processes as its init exits, which takes a moment)."""
        import asyncio

        deadline = time.monotonic() + wait_s
        for path in sorted(set(self.paths.values()), key=lambda p: -len(str(p))):
            while True:
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise CgroupError(f"cannot remove {path}: processes remain") from None
                    await asyncio.sleep(0.05)


def agent_group_name(node: str, state_dir: Path) -> str:
    """``<node>-<8 hex digits of the state directory's path>``: one agent's groups, kept apart
    from those of another agent of the same node name (another cluster, or a test beside it)."""
    digest = hashlib.sha256(str(Path(state_dir).resolve()).encode()).hexdigest()[:8]
    return f"{node}-{digest}"


class Cgroups:
    """Creates rank groups under ``<agent's group>/silod/<name>`` (:func:`agent_group_name`)."""

    def __init__(self, node: str) -> None:
        mounts, own = _mounts(), _own_groups()
        self.version = 1 if all(c in mounts for c in V1_CONTROLLERS) else 2
        controllers = V1_CONTROLLERS if self.version == 1 else ("unified",)
        if self.version == 2 and "unified" not in mounts:
            raise CgroupError("no cgroup hierarchy is mounted (neither v1's memory, cpu, pids and devices nor v2)")
        self.bases: dict[str, Path] = {}
        for controller in controllers:
            relative = own.get(controller, "/").lstrip("/")
            self.bases[controller] = Path(mounts[controller]) / relative / "silod" / node
        for base in self.bases.values():
            try:
                base.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise CgroupError(f"cannot create {base}: {exc.strerror}") from None
        if self.version == 2:
            self._enable_v2_controllers()

    def _enable_v2_controllers(self) -> None:
        base = self.bases["unified"]
        for directory in (base.parent, base):
            try:
                (directory / "cgroup.subtree_control").write_text("+memory +cpu +pids")
            except OSError as exc:
                raise CgroupError(f"cannot enable the memory, cpu and pids controllers in {directory}: "
                                  f"{exc.strerror} (the agent needs a delegated cgroup)") from None

    def create(self, name: str, limits: Limits) -> RankGroup:
        paths = {c: base / name for c, base in self.bases.items()}
        try:
            for path in paths.values():
                path.mkdir(exist_ok=True)
            if self.version == 1:
                self._limit_v1(paths, limits)
            else:
                self._limit_v2(paths["unified"], limits)
        except OSError as exc:
            raise CgroupError(f"cannot set the limits of cgroup {name}: {exc}") from None
        return RankGroup(paths, self.version)

    @staticmethod
    def _limit_v1(paths: dict[str, Path], limits: Limits) -> None:
        memory = paths["memory"]
        if limits.memory_bytes > 0:
            (memory / "memory.limit_in_bytes").write_text(str(limits.memory_bytes))
            swap = memory / "memory.memsw.limit_in_bytes"
            if swap.exists():  # no escape into swap
                swap.write_text(str(limits.memory_bytes))
        if limits.cpus > 0:
            (paths["cpu"] / "cpu.cfs_period_us").write_text(str(CFS_PERIOD_US))
            (paths["cpu"] / "cpu.cfs_quota_us").write_text(str(max(1000, round(limits.cpus * CFS_PERIOD_US))))
        if limits.pids > 0:
            (paths["pids"] / "pids.max").write_text(str(limits.pids))
        devices = paths["devices"]
        (devices / "devices.deny").write_text("a")
        for rule in (*BASE_DEVICE_RULES, *limits.device_rules):
            (devices / "devices.allow").write_text(rule)

    @staticmethod
    def _limit_v2(path: Path, limits: Limits) -> None:
        if limits.memory_bytes > 0:
            (path / "memory.max").write_text(str(limits.memory_bytes))
            with contextlib.suppress(OSError):
                (path / "memory.swap.max").write_text("0")
        if limits.cpus > 0:
            (path / "cpu.max").write_text(f"{max(1000, round(limits.cpus * CFS_PERIOD_US))} {CFS_PERIOD_US}")
        if limits.pids > 0:
            (path / "pids.max").write_text(str(limits.pids))

    def remove_base(self) -> None:
        """The agent stops: its node's groups go if no rank's is left in them."""
        for base in self.bases.values():
            with contextlib.suppress(OSError):
                base.rmdir()

    def remove_stale(self) -> list[str]:
        """Remove empty groups a killed agent left; the names of those still holding processes."""
        busy = []
        for base in self.bases.values():
            for path in base.iterdir() if base.is_dir() else ():
                if path.is_dir():
                    try:
                        path.rmdir()
                    except OSError:
                        busy.append(path.name)
        return sorted(set(busy))


def cgroup_procs(path: Path) -> list[int]:
    try:
        return [int(p) for p in (path / "cgroup.procs").read_text().split()]
    except OSError:
        return []


def kill_group(group: RankGroup) -> None:
    """SIGKILL every process of the group (a leftover of a killed agent)."""
    import signal

    for path in group.paths.values():
        for pid in cgroup_procs(path):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
