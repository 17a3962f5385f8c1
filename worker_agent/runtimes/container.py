"""Ranks in Docker containers of their job's image (``runtime: container``; docs/containers.md).

Each rank runs in a container of its own, made through the Docker Engine API (aiodocker, over
``docker_host``) from the job's image (``JobSpec.image``, else the node's ``default_image``),
pulled from its registry with the operator's credentials (``registry_auth_file``) when the node
does not have it. The container (:func:`container_spec.container_body`):

* runs the rank's command (a job without one: the image's ``python3 -m silod.jobs.emulated``)
  under its job's uid and gid (``job_uids``, as the contained runtime), docker-init as PID 1 in a
  PID namespace of its own, with no capability, no-new-privileges, the host's network (gloo and
  NCCL across nodes as for processes; or, ``container_network: container:NAME``, the network
  namespace of the agent's own container) and a private IPC namespace;
* holds the job's memory (no swap), CPU and process limits, and only its own GPUs (NVIDIA's
  container runtime, by device request), which it sees numbered from 0;
* sees of the host only its work directory and the job's checkpoint directory (read-write, at
  their host paths, owned by the job's uid, 0700) and the cache server's reader paths and
  ``container_read_paths`` (read-only);
* gets the rank's environment (its own variables and its job's credential, nothing of the agent's
  but what ``rank_env_passthrough`` names) over the image's, and HOME=/tmp.

Its output is followed from the Engine into the rank's log. A signal is a container kill; its exit
is the container's exit code (128 + N for signal N, docker-init's), with the reason where the
kernel's OOM killer ended it; the container is removed once reaped.

A container is the Engine's child: it outlives a killed agent unless something stops it. A
watchdog process (:mod:`container_watchdog`), which the kernel tells when the agent dies, kills the
agent's containers then; killed together with the agent it cannot, and they run until the next
agent on the node and work_dir stops and removes them (labels ``silod.node`` and
``silod.work_dir``) in :meth:`ContainerRuntime.prepare`, before its first plan.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiodocker
import aiohttp

from services.runtime.settings import ConfigError
from services.runtime.structured_logging import get_logger
from worker_agent.runtimes import container_spec, container_watchdog
from worker_agent.runtimes.base import LaunchError, RankExit, RankLaunch, RankProcess, Runtime
from worker_agent.runtimes.job_users import JobUsers, own_tree

_log = get_logger("silod.worker_agent")

API_TIMEOUT_S = 60.0  # one Engine call but a pull, a wait or a log stream
MIN_API = (1, 40)  # DeviceRequests
ENGINE_ERRORS = (aiodocker.DockerError, aiohttp.ClientError, OSError, asyncio.TimeoutError)


def _why(exc: BaseException) -> str:
    if isinstance(exc, aiodocker.DockerError):
        return str(exc.message).strip()
    if isinstance(exc, asyncio.TimeoutError):
        return f"the Docker Engine did not answer within {API_TIMEOUT_S:.0f} s"
    return str(exc) or type(exc).__name__


class ContainerRank(RankProcess):
    """A rank's container, from its start until it has been reaped and removed."""

    def __init__(self, runtime: ContainerRuntime, container_id: str, pid: int, launch: RankLaunch,
                 logs: asyncio.Task[None]) -> None:
        self.runtime = runtime
        self.id = container_id
        self.pid = pid
        self.launch = launch
        self.logs = logs
        self.ended = False
        self._signals: set[asyncio.Task[None]] = set()

    def signal(self, sig: signal.Signals) -> None:
        if self.ended:
            return
        task = asyncio.ensure_future(self.runtime.kill(self.id, sig))
        self._signals.add(task)
        task.add_done_callback(self._signals.discard)

    async def wait(self) -> RankExit:
        try:
            code, state = await self.runtime.wait_exit(self.id)
            self.ended = True
            with contextlib.suppress(asyncio.TimeoutError):  # the log's tail, which the Engine still sends
                await asyncio.wait_for(asyncio.shield(self.logs), 10)
            self.logs.cancel()
            await self.runtime.remove(self.id)
        finally:
            self.ended = True
            self.runtime.users.give_back(self.launch.job_id)
        return RankExit(code, container_spec.exit_reason(state, self.launch.memory_bytes))


class ContainerRuntime(Runtime):
    name = "container"
    inherits_agent_env = False
    sees_agent_process = False
    own_root = True
    image_env = True
    python = "python3"

    def __init__(self, node: str, work_dir: Path, users: JobUsers, docker_host: str, default_image: str,
                 registry_auth_file: str, read_paths: list[str], pids_limit: int,
                 real_gpus: Callable[[list[int]], bool], pull_timeout_s: float, network: str = "host") -> None:
        self.node = node
        self.work_dir = work_dir
        self.users = users
        self.docker_host = docker_host
        self.default_image = default_image
        self.registry_auth_file = registry_auth_file
        self.read_paths = tuple(read_paths)
        self.pids_limit = pids_limit
        self.real_gpus = real_gpus  # GPU indices -> are they NVML's (not emulated)?
        self.pull_timeout_s = pull_timeout_s
        self.network = network  # container_network: host, or container:NAME
        self._docker: aiodocker.Docker | None = None
        self._pulls: dict[str, asyncio.Future[None]] = {}  # image -> its pull in flight, shared
        self._watchdog: asyncio.subprocess.Process | None = None

    # ---- the Engine ------------------------------------------------------------------------
    @property
    def docker(self) -> aiodocker.Docker:
        if self._docker is None:  # long-lived waits and log streams: no cap on connections
            if self.docker_host.startswith("unix://"):
                connector: aiohttp.BaseConnector = aiohttp.UnixConnector(self.docker_host[len("unix://"):], limit=0)
                self._docker = aiodocker.Docker(url="unix://localhost", connector=connector)
            else:
                connector = aiohttp.TCPConnector(limit=0)
                self._docker = aiodocker.Docker(url="http://" + self.docker_host.split("://", 1)[1],
                                                connector=connector)
            self._connector = connector
        return self._docker

    def _labels(self) -> list[str]:
        return [f"{container_spec.LABEL_NODE}={self.node}", f"{container_spec.LABEL_WORK_DIR}={self.work_dir}"]

    async def prepare(self, grace_s: float) -> None:
        try:
            async with asyncio.timeout(API_TIMEOUT_S):
                version = await self.docker.version()
        except ENGINE_ERRORS as exc:
            raise ConfigError(f"docker_host: cannot reach the Docker Engine at {self.docker_host}: {_why(exc)}") from None
        api = tuple(int(p) for p in str(version.get("ApiVersion", "0.0")).split(".")[:2])
        if api < MIN_API:
            raise ConfigError(f"docker_host: the Docker Engine at {self.docker_host} speaks API {version.get('ApiVersion')}"
                              f"; the container runtime needs {'.'.join(map(str, MIN_API))} or later (Docker 19.03+)")
        await self._stop_leftovers(grace_s)
        self._watchdog = await asyncio.create_subprocess_exec(
            sys.executable, "-S", container_watchdog.__file__, str(os.getpid()), self.docker_host, self.node,
            str(self.work_dir), stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            start_new_session=True)

    async def _stop_leftovers(self, grace_s: float) -> None:
        """Stop (SIGTERM, SIGKILL after ``grace_s``) and remove the containers a killed agent of
        this node and work_dir left."""
        async with asyncio.timeout(API_TIMEOUT_S):
            found = await self.docker.containers.list(all=True, filters=json.dumps({"label": self._labels()}))
        if not found:
            return
        running = [c.id for c in found if c["State"] == "running"]
        _log.warning("stopping containers an earlier agent left", extra={
            "containers": [(c["Labels"] or {}).get(container_spec.LABEL_TASK, c.id) for c in found],
            "running": len(running)})
        for cid in running:
            await self.kill(cid, signal.SIGTERM)
        deadline = asyncio.get_running_loop().time() + grace_s
        while running and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.1)
            running = [cid for cid in running if await self._running(cid)]
        for cid in running:
            await self.kill(cid, signal.SIGKILL)
        for c in found:
            await self.remove(c.id)

    async def _running(self, cid: str) -> bool:
        try:
            async with asyncio.timeout(API_TIMEOUT_S):
                info = await self.docker.containers.container(cid).show()
        except ENGINE_ERRORS:
            return False
        return bool(info.get("State", {}).get("Running"))

    async def kill(self, cid: str, sig: signal.Signals) -> None:
        try:
            async with asyncio.timeout(API_TIMEOUT_S):
                await self.docker.containers.container(cid).kill(signal=sig.name)
        except ENGINE_ERRORS as exc:  # 409: it has just ended; 404: it is gone
            if not (isinstance(exc, aiodocker.DockerError) and exc.status in (404, 409)):
                _log.warning("cannot signal a container", extra={"container": cid[:12], "signal": sig.name,
                                                                  "error": _why(exc)})

    async def remove(self, cid: str) -> None:
        try:
            async with asyncio.timeout(API_TIMEOUT_S):
                await self.docker.containers.container(cid).delete(force=True)
        except ENGINE_ERRORS as exc:
            if not (isinstance(exc, aiodocker.DockerError) and exc.status == 404):
                _log.warning("cannot remove a container", extra={"container": cid[:12], "error": _why(exc)})

    async def wait_exit(self, cid: str) -> tuple[int, dict[str, Any]]:
        """The container's exit code and final state, once it has ended (the Engine restarting in
        between is waited out)."""
        container = self.docker.containers.container(cid)
        while True:
            try:
                await container.wait()
                async with asyncio.timeout(API_TIMEOUT_S):
                    state = (await container.show()).get("State", {})
                if not state.get("Running"):
                    return int(state.get("ExitCode", 137)), state
            except ENGINE_ERRORS as exc:
                if isinstance(exc, aiodocker.DockerError) and exc.status == 404:
                    _log.warning("a rank's container vanished", extra={"container": cid[:12]})
                    return 137, {}
                _log.warning("waiting for a container failed; retrying", extra={"container": cid[:12],
                                                                                 "error": _why(exc)})
                await asyncio.sleep(1.0)

    # ---- images ----------------------------------------------------------------------------
    async def ensure_image(self, image: str) -> None:
        """The image is on this node: pulled unless present (one pull per image at a time)."""
        try:
            async with asyncio.timeout(API_TIMEOUT_S):
                await self.docker.images.inspect(image)
            return
        except ENGINE_ERRORS as exc:
            if not (isinstance(exc, aiodocker.DockerError) and exc.status == 404):
                raise LaunchError(f"cannot look up image {image}: {_why(exc)}") from None
        pull = self._pulls.get(image)
        if pull is None:
            pull = self._pulls[image] = asyncio.ensure_future(self._pull(image))
            pull.add_done_callback(lambda _: self._pulls.pop(image, None))
        await asyncio.shield(pull)  # a launch given up on does not end another's pull

    async def _pull(self, image: str) -> None:
        try:
            credentials = container_spec.credentials_for(
                image, container_spec.load_registry_auth(self.registry_auth_file))
        except container_spec.RegistryAuthError as exc:
            raise LaunchError(f"cannot pull image {image}: registry_auth_file: {exc}") from None
        reference = container_spec.pull_reference(image)
        _log.info("pulling image", extra={"image": image, "with_credentials": credentials is not None})
        try:
            async with asyncio.timeout(self.pull_timeout_s):
                await self.docker.images.pull(reference, auth=credentials)
        except asyncio.TimeoutError:
            raise LaunchError(f"cannot pull image {image}: not done within {self.pull_timeout_s:.0f} s "
                              "(image_pull_timeout_s)") from None
        except ENGINE_ERRORS as exc:
            raise LaunchError(f"cannot pull image {image}: {_why(exc)}") from None

    # ---- ranks -----------------------------------------------------------------------------
    async def start(self, launch: RankLaunch) -> RankProcess:
        image = launch.image or self.default_image
        if not image:
            raise LaunchError("no image: the job names none and this node has no default_image (runtime: container)")
        uid = self.users.take(launch.job_id)
        try:
            return await self._start(launch, image, uid)
        except BaseException:
            self.users.give_back(launch.job_id)
            raise

    async def _start(self, launch: RankLaunch, image: str, uid: int) -> RankProcess:
        try:
            own_tree(launch.work_dir / "work", uid, uid)
            own_tree(launch.checkpoint_dir, uid, uid)
        except OSError as exc:
            raise LaunchError(f"cannot give job uid {uid} its directories: {exc}") from None
        await self.ensure_image(image)
        body = container_spec.container_body(launch, image, container_spec.RankContainer(
            node=self.node, agent_work_dir=str(self.work_dir), uid=uid, gid=uid, pids_limit=self.pids_limit,
            real_gpus=bool(launch.gpus) and self.real_gpus(launch.gpus), read_paths=self.read_paths,
            network=self.network))
        name = container_spec.container_name(self.node, str(self.work_dir), launch.key)
        try:
            container = await self._create(body, name)
        except ENGINE_ERRORS as exc:
            raise LaunchError(f"cannot create a container of image {image}: {_why(exc)}") from None
        try:
            async with asyncio.timeout(API_TIMEOUT_S):
                await container.start()
                info = await container.show()
        except ENGINE_ERRORS as exc:
            await self.remove(container.id)
            raise LaunchError(f"cannot start the container of image {image}: {_why(exc)}") from None
        logs = asyncio.ensure_future(self._follow_logs(container, launch.log_path))
        return ContainerRank(self, container.id, int(info.get("State", {}).get("Pid", 0)), launch, logs)

    async def _create(self, body: dict[str, Any], name: str) -> aiodocker.containers.DockerContainer:
        for attempt in (1, 2):
            try:
                async with asyncio.timeout(API_TIMEOUT_S):
                    return await self.docker.containers.create(body, name=name)
            except aiodocker.DockerError as exc:
                if exc.status != 409 or attempt == 2 or not await self._remove_stale(name):
                    raise
        raise AssertionError("unreachable")

    async def _remove_stale(self, name: str) -> bool:
        """A container of this name left by this node's agent (a launch of the same rank whose
        agent died before removing it): removed. Another's is not touched."""
        try:
            async with asyncio.timeout(API_TIMEOUT_S):
                info = await self.docker.containers.container(name).show()
        except ENGINE_ERRORS:
            return False
        labels = info.get("Config", {}).get("Labels") or {}
        if labels.get(container_spec.LABEL_NODE) != self.node or labels.get(container_spec.LABEL_WORK_DIR) != str(
                self.work_dir):
            return False
        await self.remove(info["Id"])
        return True

    async def _follow_logs(self, container: aiodocker.containers.DockerContainer, log_path: Path) -> None:
        try:
            with open(log_path, "ab", buffering=0) as log:
                async for chunk in container.log(stdout=True, stderr=True, follow=True):
                    log.write(chunk.encode())
        except ENGINE_ERRORS as exc:
            _log.warning("following a container's output failed", extra={"container": container.id[:12],
                                                                          "error": _why(exc)})

    async def close(self) -> None:
        if self._watchdog is not None and self._watchdog.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._watchdog.kill()  # every rank has ended: nothing is left to kill
            await self._watchdog.wait()
        if self._docker is not None:
            await self._docker.close()
            await self._connector.close()

    def describe(self) -> str:
        return (f"container: a Docker container per rank (Engine at {self.docker_host}), of its job's image "
                f"(default {self.default_image or 'none'}); a uid per job ({self.users.start}-{self.users.end}), "
                f"own PID/mount/IPC/UTS namespaces, {self.network} network, no capabilities, no-new-privileges, "
                "memory/CPU/pids limits, only its own GPUs")
