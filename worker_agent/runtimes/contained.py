"""Ranks as contained processes: the runtime of a bare-metal node whose agent runs as root.

Each job's ranks run under a Unix user and group of their own (:mod:`job_users`), each rank in
a PID, mount and IPC namespace of its own with a root that holds only what it needs
(:mod:`sandbox`), in a control group with the job's memory, CPU and process limits and only
its own GPUs among the devices (:mod:`cgroups`). Its working directory and the job's
checkpoint directory are the job user's, mode 0700; its log is written by the agent outside
them. It gets its own job credential and no other secret of the agent's environment.

The launcher of each rank leads a process group of its own and dies with the agent; the rank's
namespace dies with the launcher. Run records and leftovers work as for plain processes
(:mod:`leftovers`); groups a killed agent left are removed at start.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from services.runtime.structured_logging import get_logger
from worker_agent.runtimes import cgroups, leftovers, sandbox
from worker_agent.runtimes.base import LaunchError, RankExit, RankLaunch, RankProcess, Runtime, note_image_unused
from worker_agent.runtimes.job_users import JobUsers, own_tree
from worker_agent.runtimes.process import GroupProcess, spawn
from worker_agent.warm_start import WarmPool

_log = get_logger("silod.worker_agent")

# Where a rank finds its own directories (its working directory, the job's checkpoints).
WORK, CHECKPOINT = "/silod/work", "/silod/checkpoint"
SYSTEM_READ_ONLY = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/opt", "/sys")
SANDBOX_SCRIPT = sandbox.__file__


def interpreter_paths() -> list[str]:
    """What a rank needs to run this node's Python and the SDK: the interpreter's prefixes and,
    for an install from a source tree, the ``silod`` package's own directory (not the tree)."""
    import silod

    paths = {sys.prefix, sys.base_prefix, os.path.dirname(os.path.realpath(sys.executable))}
    package = os.path.dirname(os.path.abspath(silod.__file__))
    if not any(package.startswith(p.rstrip("/") + "/") for p in paths):
        paths.add(package)
    return sorted(paths)


def passwd_files(directory: Path, uid: int, gid: int) -> dict[str, str]:
    """/etc/passwd and /etc/group naming the job's user, so that tools asking who they are get
    an answer (getpass, ~ expansion)."""
    files = {}
    for name, line in (("passwd", f"silod-job:x:{uid}:{gid}:silod job:/tmp:/usr/sbin/nologin\n"),
                       ("group", f"silod-job:x:{gid}:\n")):
        try:
            host = Path(f"/etc/{name}").read_text()
        except OSError:
            host = ""
        path = directory / name
        path.write_text(host + line)
        path.chmod(0o644)
        files[f"/etc/{name}"] = str(path)
    return files


class ContainedProcess(GroupProcess):
    def __init__(self, proc: asyncio.subprocess.Process, group: cgroups.RankGroup, limits: cgroups.Limits,
                 ended: Callable[[], None], warm: bool = False) -> None:
        super().__init__(proc, warm)
        self.group = group
        self.limits = limits
        self._ended = ended

    async def wait(self) -> RankExit:
        ended = await super().wait()
        reason = ""
        if self.group.oom_killed():
            reason = f"out of memory: the rank passed its limit of {self.limits.memory_bytes / 2**20:.0f} MiB"
        try:
            await self.group.remove()
        except cgroups.CgroupError as exc:
            _log.warning("rank cgroup left behind", extra={"error": str(exc)})
        self._ended()
        return RankExit(ended.code, reason)


class ContainedRuntime(Runtime):
    name = "contained"
    inherits_agent_env = False

    def __init__(self, node: str, run_dir: Path, users: JobUsers, read_paths: list[str], pids_limit: int,
                 gpu_devices: Callable[[list[int]], tuple[list[str], tuple[str, ...]]],
                 warm: WarmPool | None = None) -> None:
        self.records = leftovers.RunRecords(run_dir)
        self.run_dir = run_dir
        self.sandboxes = run_dir.parent / "sandboxes"
        self.users = users
        self.cgroups = cgroups.Cgroups(cgroups.agent_group_name(node, run_dir))
        self.read_paths = [*SYSTEM_READ_ONLY, *interpreter_paths(), *read_paths]
        self.pids_limit = pids_limit
        self.gpu_devices = gpu_devices  # GPU indices -> (device files, cgroup rules)
        self.warm = warm

    async def prepare(self, grace_s: float) -> None:
        await self.records.stop_leftovers(grace_s)
        busy = self.cgroups.remove_stale()
        if busy:
            _log.warning("cgroups of an earlier agent still hold processes", extra={"groups": busy})
        self.sandboxes.mkdir(parents=True, exist_ok=True)
        os.chmod(self.sandboxes, 0o700)
        if self.warm is not None:
            await self.warm.fill()

    async def start(self, launch: RankLaunch) -> RankProcess:
        uid = self.users.take(launch.job_id)
        try:
            return await self._start(launch, uid)
        except BaseException:
            self.users.give_back(launch.job_id)
            raise

    async def _start(self, launch: RankLaunch, uid: int) -> RankProcess:
        name = launch.key.replace("/", "_")
        work = launch.work_dir / "work"  # the rank's; its log stays in the agent's directory above it
        try:
            own_tree(work, uid, uid)
            own_tree(launch.checkpoint_dir, uid, uid)
        except OSError as exc:
            raise LaunchError(f"cannot give job uid {uid} its directories: {exc}") from None
        devices, rules = self.gpu_devices(launch.gpus)
        limits = cgroups.Limits(memory_bytes=launch.memory_bytes, cpus=launch.cpus, pids=self.pids_limit,
                                device_rules=rules)
        try:
            group = self.cgroups.create(name, limits)
        except cgroups.CgroupError as exc:
            raise LaunchError(str(exc)) from None
        box = self.sandboxes / name
        (box / "root").mkdir(parents=True, exist_ok=True)
        config = {
            "cgroups": group.join, "root": str(box / "root"), "uid": uid, "gid": uid, "cwd": WORK,
            "read_only": [*self.read_paths, *launch.read_paths],
            "read_write": {str(work): WORK, str(launch.checkpoint_dir): CHECKPOINT},
            # A read path that holds the agent's work directory or the checkpoints (a `silod up`
            # started where its state lives) shows them empty.
            "hide": [str(self.run_dir.parent), str(launch.checkpoint_dir.parent)],
            "devices": devices, "files": passwd_files(box, uid, uid), "command": launch.command,
            "env": {"HOME": "/tmp", "USER": "silod-job", "LOGNAME": "silod-job", **launch.env,
                    "SILOD_CHECKPOINT_DIR": CHECKPOINT},
        }
        rank: GroupProcess | None = None
        try:
            with open(launch.log_path, "ab") as log:
                note_image_unused(log, launch, self.name)
                if self.warm is not None and launch.resize_in_place:
                    proc = await self.warm.take(launch.command, config["env"], WORK, launch.log_path,
                                                sandbox=config)
                    if proc is not None:
                        rank = ContainedProcess(proc, group, limits, lambda: self._ended(launch, box), warm=True)
                if rank is None:
                    config_path = self.run_dir / f"{name}.sandbox.json"
                    fd = os.open(config_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                    with os.fdopen(fd, "w") as f:
                        json.dump(config, f)
                    proc = await spawn(SANDBOX_SCRIPT, str(os.getpid()), str(config_path), trampoline=False,
                                       stdin=asyncio.subprocess.DEVNULL, stdout=log,
                                       stderr=asyncio.subprocess.STDOUT, env=launcher_env(), cwd="/")
                    rank = ContainedProcess(proc, group, limits, lambda: self._ended(launch, box))
        except OSError as exc:
            await group.remove(wait_s=0)
            raise LaunchError(f"cannot launch {launch.command!r}: {exc}") from None
        self.records.record(launch.key, rank.pid)
        return rank

    def _ended(self, launch: RankLaunch, box: Path) -> None:
        self.users.give_back(launch.job_id)
        for leftover in (box / "passwd", box / "group"):
            leftover.unlink(missing_ok=True)
        for directory in (box / "root", box):
            try:
                directory.rmdir()
            except OSError:
                pass

    def forget(self, launch_key: str) -> None:
        self.records.forget(launch_key)

    async def close(self) -> None:
        if self.warm is not None:
            await self.warm.close()
        self.cgroups.remove_base()

    def describe(self) -> str:
        return (f"contained: a uid per job ({self.users.start}-{self.users.end}), PID/mount/IPC namespaces, "
                f"cgroup v{self.cgroups.version} limits")


def launcher_env() -> dict[str, str]:
    """The launcher's own environment, which its namespace's init keeps (``/proc/1/environ`` in
    the rank's view): nothing but a path."""
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
