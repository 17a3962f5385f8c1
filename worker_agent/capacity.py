"""What the node offers ranks besides GPUs: CPU cores and memory (read from the machine unless
configured), and the device files and cgroup rules of given GPUs."""

from __future__ import annotations

import os
from pathlib import Path

from worker_agent.runtimes.cgroups import char_major, gpu_device_rules


def machine_cpus() -> float:
    """Cores this process may run on (its affinity), less where its cgroup's CPU quota is lower."""
    cores = float(len(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else float(os.cpu_count() or 1)
    for quota_file, period_file in (("/sys/fs/cgroup/cpu.max", None),
                                    ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us")):
        try:
            text = Path(quota_file).read_text().split()
            if period_file is None:
                quota, period = text[0], text[1]
            else:
                quota, period = text[0], Path(period_file).read_text().strip()
        except (OSError, IndexError):
            continue
        if quota not in ("max", "-1") and int(period) > 0:
            cores = min(cores, int(quota) / int(period))
    return cores


def machine_memory_bytes() -> int:
    """The machine's memory (MemTotal), less where this process's memory cgroup limit is lower."""
    total = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                total = int(line.split()[1]) * 1024
    except OSError:
        pass
    for path in _own_memory_limit_files():
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < total:
            total = int(text)
    return total


def _own_memory_limit_files() -> list[str]:
    files = []
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return files
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            files.append(f"/sys/fs/cgroup/memory{path}/memory.limit_in_bytes")
        elif not controllers:
            files.append(f"/sys/fs/cgroup{path}/memory.max")
    return files


def gpu_devices(indices: list[int], minors: dict[int, int] | None = None) -> tuple[list[str], tuple[str, ...]]:
    """The device files a rank on GPUs ``indices`` needs (``/dev/nvidiaN`` by minor number, the
    driver's control devices) and the cgroup rules that open them and nothing else."""
    if not indices:
        return [], ()
    numbers = [(minors or {}).get(i, i) for i in indices]
    files = [f"/dev/nvidia{m}" for m in numbers] + ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools",
                                                     "/dev/nvidia-modeset"]
    return [f for f in files if os.path.exists(f)], gpu_device_rules(numbers, char_major("nvidia-uvm"))
