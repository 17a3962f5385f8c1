"""What the container runtime asks the Docker Engine for: a rank's container (the body of
``POST /containers/create``), the registry an image comes from and the operator's credentials
for it. Plain functions of their inputs, tested without an Engine (tests/worker_agent/
test_container_spec.py).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worker_agent.runtimes.base import RankLaunch

LABEL_NODE = "silod.node"  # the agent's node name
LABEL_WORK_DIR = "silod.work_dir"  # the agent's work_dir: two agents on one host keep apart
LABEL_TASK = "silod.task"  # the launch key, job/rank/generation
LABEL_JOB = "silod.job"
DOCKER_HUB = "docker.io"
SHM_WITHOUT_LIMIT = 2 * 2**30  # /dev/shm of a rank without a memory request
LOG_CONFIG = {"Type": "json-file", "Config": {"max-size": "50m", "max-file": "2"}}  # the agent keeps the log


class RegistryAuthError(ValueError):
    pass


@dataclass(frozen=True)
class RankContainer:
    """What the node adds to a launch: who the rank runs as and what the node has."""

    node: str
    agent_work_dir: str
    uid: int
    gid: int
    pids_limit: int
    real_gpus: bool  # the node's GPUs are NVML's (device requests), not emulated
    read_paths: tuple[str, ...] = ()  # host paths mounted read-only besides the launch's own
    network: str = "host"  # NetworkMode: host, or container:NAME (container_network)


def image_registry(image: str) -> str:
    """The registry an image reference points at: its first part when that names a host (holds a
    dot or a port, or is localhost), else Docker Hub."""
    first, sep, _ = image.partition("/")
    if sep and ("." in first or ":" in first or first == "localhost"):
        return first
    return DOCKER_HUB


def load_registry_auth(path: str) -> dict[str, dict[str, str]]:
    """The operator's registry credentials: a JSON object {"host[:port]": {"username": ...,
    "password": ...}}. Raises RegistryAuthError saying what is wrong with the file."""
    if not path:
        return {}
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise RegistryAuthError(f"cannot read {path!r}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise RegistryAuthError(f"{path!r} is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise RegistryAuthError(f"{path!r} must hold an object of registry -> credentials")
    auths: dict[str, dict[str, str]] = {}
    for registry, entry in data.items():
        if not (isinstance(entry, dict) and isinstance(entry.get("username"), str)
                and isinstance(entry.get("password"), str)):
            raise RegistryAuthError(f"{path!r}: {registry!r} must be {{\"username\": ..., \"password\": ...}}")
        auths[registry] = {"username": entry["username"], "password": entry["password"]}
    return auths


def credentials_for(image: str, auths: dict[str, dict[str, str]]) -> dict[str, str] | None:
    """The operator's credentials for the registry ``image`` comes from, if any."""
    registry = image_registry(image)
    names = [registry] + (["index.docker.io", "registry-1.docker.io", "https://index.docker.io/v1/"]
                          if registry == DOCKER_HUB else [])
    return next((auths[n] for n in names if n in auths), None)


def pull_reference(image: str) -> str:
    """The reference to pull ``image`` by, with its registry spelt out (Docker Hub's included), so
    that the credentials go with it."""
    if image_registry(image) != DOCKER_HUB or image.startswith(f"{DOCKER_HUB}/"):
        return image
    return f"{DOCKER_HUB}/{image}" if "/" in image else f"{DOCKER_HUB}/library/{image}"


def container_name(node: str, agent_work_dir: str, key: str) -> str:
    """A name ``docker ps`` shows, in Docker's alphabet: silod-<node>-<job>-r<rank>-g<generation>-
    <hash of the agent's work_dir> (two agents of one node name on a host never collide)."""
    job, rank, generation = (key.split("/") + ["", ""])[:3]
    where = hashlib.sha256(agent_work_dir.encode()).hexdigest()[:6]
    raw = f"silod-{node}-{job}-r{rank}-g{generation}-{where}"
    name = "".join(c if c.isalnum() or c in "_.-" else "_" for c in raw)
    return name[:200]


def gpu_environment(launch: RankLaunch, real_gpus: bool) -> dict[str, str]:
    """What the rank is told of its GPUs inside the container. Given devices (real GPUs), it sees
    them renumbered from 0, so CUDA_VISIBLE_DEVICES counts from 0 where the agent set it (a job's
    own value stays); NVIDIA_VISIBLE_DEVICES names its GPUs, or ``void`` for none, so that an
    image's ``NVIDIA_VISIBLE_DEVICES=all`` can never open the node's other GPUs."""
    if not real_gpus or not launch.gpus:
        return {"NVIDIA_VISIBLE_DEVICES": "void"}
    env = {"NVIDIA_VISIBLE_DEVICES": ",".join(str(i) for i in launch.gpus)}
    if launch.env.get("CUDA_VISIBLE_DEVICES") == ",".join(str(i) for i in launch.gpus):
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(len(launch.gpus)))
    return env


def _mount(path: str, read_only: bool) -> dict[str, Any]:
    return {"Type": "bind", "Source": path, "Target": path, "ReadOnly": read_only}


def container_body(launch: RankLaunch, image: str, node: RankContainer) -> dict[str, Any]:
    """The create body of the rank's container (Engine API 1.41)."""
    work = str(launch.work_dir / "work")
    env = {**launch.env, "HOME": "/tmp", "USER": "silod-job", "LOGNAME": "silod-job",
           # docker-init (tini) passes a signal to the rank's whole process group, not its leader alone
           "TINI_KILL_PROCESS_GROUP": "1", **gpu_environment(launch, node.real_gpus)}
    read_only = [p for p in dict.fromkeys([*launch.read_paths, *node.read_paths])
                 if p and os.path.exists(p) and p not in (work, str(launch.checkpoint_dir))]
    host: dict[str, Any] = {
        # host: gloo and NCCL reach the other nodes' ranks as processes would; container:NAME (an
        # agent in a container names its own): the rank sees the network the agent sees
        "NetworkMode": node.network,
        "Init": True,  # docker-init as PID 1: signals reach the rank, zombies are reaped
        "IpcMode": "private",
        "CapDrop": ["ALL"],
        "SecurityOpt": ["no-new-privileges"],
        "PidsLimit": node.pids_limit,
        "ShmSize": launch.memory_bytes or SHM_WITHOUT_LIMIT,
        "Mounts": [_mount(work, False), _mount(str(launch.checkpoint_dir), False),
                   *(_mount(p, True) for p in read_only)],
        "LogConfig": LOG_CONFIG,
    }
    if launch.memory_bytes > 0:
        host["Memory"] = host["MemorySwap"] = launch.memory_bytes  # no escape into swap
    if launch.cpus > 0:
        host["NanoCpus"] = int(launch.cpus * 1e9)
    if node.real_gpus and launch.gpus:
        host["DeviceRequests"] = [{"Driver": "nvidia", "DeviceIDs": [str(i) for i in launch.gpus],
                                   "Capabilities": [["gpu"]]}]
    return {
        "Image": image,
        "Entrypoint": [],  # the rank's command is what runs, whatever the image's ENTRYPOINT
        "Cmd": list(launch.command),
        "Env": [f"{k}={v}" for k, v in env.items()],
        "User": f"{node.uid}:{node.gid}",
        "WorkingDir": work,
        "Labels": {LABEL_NODE: node.node, LABEL_WORK_DIR: node.agent_work_dir, LABEL_TASK: launch.key,
                   LABEL_JOB: launch.job_id},
        "AttachStdin": False, "OpenStdin": False, "Tty": False,
        "HostConfig": host,
    }


def exit_reason(state: dict[str, Any], memory_bytes: int) -> str:
    """Why the container ended, beyond its exit code: the kernel's OOM killer."""
    if not state.get("OOMKilled"):
        return ""
    if memory_bytes:
        return f"out of memory: the rank passed its limit of {memory_bytes / 2**20:.0f} MiB"
    return "out of memory: the kernel killed the rank (it had no memory limit: the node ran short)"
