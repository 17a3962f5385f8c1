"""A contained rank's control group (worker_agent/runtimes/cgroups.py) on this machine's cgroups, as
root: only the rank's own GPUs open, its memory limit kills it alone and says so, its pids limit
holds, and the group goes once empty."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from worker_agent.runtimes.cgroups import Cgroups, Limits, agent_group_name, gpu_device_rules

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="cgroups need root")

OPEN = """
import errno, os, sys
for path in sys.argv[1:]:
    try:
        os.close(os.open(path, os.O_RDONLY))
        print(path, "OK")
    except OSError as exc:
        print(path, errno.errorcode[exc.errno])
"""


def _in_group(group, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:  # type: ignore[no-untyped-def]
    """Run ``argv`` inside ``group`` (its shell joins every controller's group, then execs)."""
    joins = " && ".join(f"echo $$ > {path}/cgroup.procs" for path in group.join)
    return subprocess.run(["/bin/sh", "-c", f'{joins} && exec "$@"', "sh", *argv], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture
def cgroups() -> Iterator[Cgroups]:
    made = Cgroups(f"test-{uuid.uuid4().hex[:8]}")
    yield made
    made.remove_base()
    assert not any(base.exists() for base in made.bases.values())


def test_only_the_ranks_own_gpus_open(cgroups: Cgroups, tmp_path: Path) -> None:
    if cgroups.version != 1:
        pytest.skip("the devices controller is cgroup v1's")
    for minor in (0, 1):  # what /dev/nvidia0 and /dev/nvidia1 would be
        os.mknod(tmp_path / f"nvidia{minor}", 0o666 | 0o020000, os.makedev(195, minor))
    group = cgroups.create("rank", Limits(device_rules=gpu_device_rules([0], None)))
    try:
        done = _in_group(group, sys.executable, "-c", OPEN, str(tmp_path / "nvidia0"), str(tmp_path / "nvidia1"),
                         "/dev/null")
        seen = dict(line.split() for line in done.stdout.splitlines())
        # Its own GPU passes the controller (no driver here: ENXIO); the other does not (EPERM).
        assert seen == {str(tmp_path / "nvidia0"): "ENXIO", str(tmp_path / "nvidia1"): "EPERM", "/dev/null": "OK"}, \
            done.stdout + done.stderr
    finally:
        asyncio.run(group.remove())


def test_past_its_memory_limit_a_rank_is_killed_and_the_group_says_so(cgroups: Cgroups) -> None:
    group = cgroups.create("hog", Limits(memory_bytes=64 << 20, pids=64))
    try:
        assert not group.oom_killed()
        done = _in_group(group, sys.executable, "-c", "x = bytearray(512 << 20)")
        assert done.returncode == -9, (done.returncode, done.stderr)
        assert group.oom_killed()
    finally:
        asyncio.run(group.remove())
    assert not any(Path(p).exists() for p in group.join)


def test_a_fork_bomb_stops_at_the_pids_limit(cgroups: Cgroups) -> None:
    bomb = ("import errno, os, time\nn = 0\nwhile True:\n    try:\n        pid = os.fork()\n"
            "    except OSError as exc:\n        print(n, errno.errorcode[exc.errno]); break\n"
            "    if pid == 0:\n        time.sleep(30); os._exit(0)\n    n += 1\nos.killpg(0, 9)")
    group = cgroups.create("bomb", Limits(pids=32))
    try:
        done = _in_group(group, "/usr/bin/setsid", sys.executable, "-c", bomb)
        count, code = done.stdout.split()
        assert code == "EAGAIN" and int(count) < 32, done.stdout
    finally:
        asyncio.run(group.remove())


def test_agents_of_one_node_name_keep_their_groups_apart(tmp_path: Path) -> None:
    # Two clusters on one host (or two tests side by side) may both have a "node-1": an agent
    # clearing its predecessor's empty groups must not remove the other's, which it once did
    # between the other's mkdir and its limits (ENOENT failed that job's rank).
    node = f"test-{uuid.uuid4().hex[:8]}"
    assert agent_group_name(node, tmp_path / "a") == agent_group_name(node, tmp_path / "x" / ".." / "a")
    first = Cgroups(agent_group_name(node, tmp_path / "a"))
    second = Cgroups(agent_group_name(node, tmp_path / "b"))
    try:
        assert not set(first.bases.values()) & set(second.bases.values())
        group = second.create("rank", Limits(memory_bytes=64 << 20))
        assert first.remove_stale() == []
        first.remove_base()
        assert all(path.is_dir() for path in group.paths.values())
    finally:
        for made in (first, second):
            for base in made.bases.values():
                for path in base.iterdir() if base.is_dir() else ():
                    if path.is_dir():
                        path.rmdir()
            made.remove_base()
