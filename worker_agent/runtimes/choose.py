"""Which runtime a node's agent uses, and refusing to run uncontained where that is unsafe.

``runtime: auto`` (the default) contains ranks whenever the agent can: as root it runs them as
contained processes; otherwise they run as the agent's own user, uncontained, and the agent
says so when it starts. ``runtime: container`` (Docker containers of the job's image) is only
ever chosen by name. With auth on, an agent that would run ranks uncontained refuses to
start unless the operator passes ``allow_uncontained``: any such rank could read the node's
credential and signal other tenants' ranks.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from services.runtime.auth import auth_enabled
from services.runtime.settings import ConfigError
from services.runtime.structured_logging import get_logger
from worker_agent.runtimes.base import Runtime
from worker_agent.runtimes.cgroups import CgroupError
from worker_agent.runtimes.contained import ContainedRuntime
from worker_agent.runtimes.job_users import JobUsers, parse_range
from worker_agent.runtimes.process import ProcessRuntime
from worker_agent.warm_start import WarmPool

_log = get_logger("silod.worker_agent")

GpuDevices = Callable[[list[int]], tuple[list[str], tuple[str, ...]]]


def choose_runtime(settings: Any, node: str, work_dir: Path, warm: Callable[[bool], WarmPool | None],
                   gpu_devices: GpuDevices) -> Runtime:
    """The node's runtime. ``warm(contained)``: the warm pool for it (None = none kept).
    Raises ConfigError naming the setting when the choice cannot work or is unsafe."""
    wanted = settings.runtime
    run_dir = work_dir / "run"
    if wanted == "container":
        return _container_runtime(settings, node, work_dir, gpu_devices)
    why_not_contained = ""
    if wanted in ("auto", "contained"):
        if os.geteuid() != 0:
            why_not_contained = "the agent does not run as root"
        else:
            try:
                start, end = parse_range(settings.job_uids)
                read = [p.strip() for p in settings.contained_read_paths.split(",") if p.strip()]
                return ContainedRuntime(node, run_dir, JobUsers(start, end), read, settings.rank_pids_limit,
                                        gpu_devices, warm(True))
            except CgroupError as exc:
                why_not_contained = str(exc)
        if wanted == "contained":
            raise ConfigError(f"runtime: cannot contain ranks: {why_not_contained}")
    if auth_enabled(settings) and not settings.allow_uncontained:
        reason = f" ({why_not_contained})" if why_not_contained else ""
        raise ConfigError(
            f"runtime: ranks would run uncontained, as the agent's user{reason}, where any of them could read this "
            "node's credential and signal other tenants' ranks; run the agent as root to contain them, or pass "
            "--allow-uncontained to accept that")
    _log.warning("ranks run uncontained, as the agent's user", extra={
        "reason": why_not_contained or "runtime: process", "see": "docs/operators.md, 'Job containment'"})
    return ProcessRuntime(run_dir, warm(False))


def _container_runtime(settings: Any, node: str, work_dir: Path, gpu_devices: GpuDevices) -> Runtime:
    """``runtime: container`` (never chosen by auto): ranks in Docker containers of their image."""
    from worker_agent.runtimes.container import ContainerRuntime
    from worker_agent.runtimes.container_spec import RegistryAuthError, load_registry_auth

    if os.geteuid() != 0:
        raise ConfigError("runtime: container needs the agent to run as root (it gives each job's uid its "
                          "directories)")
    try:
        load_registry_auth(settings.registry_auth_file)  # refused now rather than at the first pull
    except RegistryAuthError as exc:
        raise ConfigError(f"registry_auth_file: {exc}") from None
    start, end = parse_range(settings.job_uids)
    read = [p.strip() for p in settings.container_read_paths.split(",") if p.strip()]
    return ContainerRuntime(node, work_dir, JobUsers(start, end), settings.docker_host, settings.default_image,
                            settings.registry_auth_file, read, settings.rank_pids_limit,
                            lambda indices: bool(gpu_devices(indices)[0]), settings.image_pull_timeout_s,
                            settings.container_network)
