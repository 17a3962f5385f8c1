"""The container runtime's requests to the Docker Engine, without an Engine or a GPU: the create
body of a rank's container (GPUs by device request, renumbered from 0; limits; mounts; labels;
environment), the registry an image comes from and the operator's credentials for it, and the
settings choose_runtime refuses (tests/worker_agent/test_container_runtime.py runs it for real)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from services.runtime.settings import ConfigError
from worker_agent.runtimes import container_spec as spec
from worker_agent.runtimes.base import RankLaunch
from worker_agent.runtimes.choose import choose_runtime
from worker_agent.service import Settings


def _launch(tmp_path: Path, gpus: list[int], **kwargs) -> RankLaunch:  # type: ignore[no-untyped-def]
    env = {"PATH": "/host/bin", "SILOD_RANK": "0", "CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus)),
           "SILOD_AUTH_TOKEN": "job-token"}
    env.update(kwargs.pop("env", {}))
    return RankLaunch(key="job-a/0/3", job_id="job-a", command=["python3", "-m", "silod.jobs.emulated"], env=env,
                      work_dir=tmp_path / "jobs" / "job-a", log_path=tmp_path / "jobs" / "job-a" / "rank-0.log",
                      checkpoint_dir=tmp_path / "checkpoints" / "job-a", gpus=gpus, **kwargs)


def _node(real_gpus: bool, read_paths: tuple[str, ...] = ()) -> spec.RankContainer:
    return spec.RankContainer(node="gpu-7", agent_work_dir="/var/lib/silod", uid=1000042, gid=1000042,
                              pids_limit=512, real_gpus=real_gpus, read_paths=read_paths)


def _env(body: dict) -> dict[str, str]:  # type: ignore[type-arg]
    return dict(item.split("=", 1) for item in body["Env"])


def test_a_rank_on_real_gpus_gets_them_by_device_request_renumbered_from_zero(tmp_path: Path) -> None:
    body = spec.container_body(_launch(tmp_path, [2, 5]), "reg.example:5000/team/train:1", _node(real_gpus=True))
    host = body["HostConfig"]
    assert host["DeviceRequests"] == [{"Driver": "nvidia", "DeviceIDs": ["2", "5"], "Capabilities": [["gpu"]]}]
    env = _env(body)
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1"  # what the container sees: its two GPUs, from 0
    assert env["NVIDIA_VISIBLE_DEVICES"] == "2,5"  # an image's NVIDIA_VISIBLE_DEVICES=all cannot widen it
    # A job that set its own CUDA_VISIBLE_DEVICES keeps it.
    own = spec.container_body(_launch(tmp_path, [2, 5], env={"CUDA_VISIBLE_DEVICES": "1"}), "img",
                              _node(real_gpus=True))
    assert _env(own)["CUDA_VISIBLE_DEVICES"] == "1"


def test_emulated_or_no_gpus_get_no_devices(tmp_path: Path) -> None:
    for gpus, real in (([1, 3], False), ([], True)):
        body = spec.container_body(_launch(tmp_path, gpus), "img", _node(real_gpus=real))
        assert "DeviceRequests" not in body["HostConfig"]
        env = _env(body)
        assert env["NVIDIA_VISIBLE_DEVICES"] == "void"
        assert env["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, gpus))  # nothing renumbered: nothing passed


def test_the_container_holds_the_rank_its_limits_mounts_and_labels(tmp_path: Path) -> None:
    reader = tmp_path / "cache-tier"
    reader.mkdir()
    launch = _launch(tmp_path, [0], memory_bytes=3 * 2**30, cpus=2.5,
                     read_paths=[str(reader), str(tmp_path / "absent")])
    body = spec.container_body(launch, "img:1", _node(real_gpus=False, read_paths=(str(reader),)))
    host = body["HostConfig"]
    assert (host["Memory"], host["MemorySwap"], host["NanoCpus"], host["PidsLimit"]) == (3 * 2**30, 3 * 2**30,
                                                                                          2_500_000_000, 512)
    assert host["NetworkMode"] == "host" and host["Init"] is True and host["IpcMode"] == "private"
    assert host["CapDrop"] == ["ALL"] and host["SecurityOpt"] == ["no-new-privileges"]
    assert "Privileged" not in host and "Binds" not in host
    work = str(tmp_path / "jobs" / "job-a" / "work")
    checkpoint = str(tmp_path / "checkpoints" / "job-a")
    assert host["Mounts"] == [  # the same paths as on the host; an absent reader path is left out
        {"Type": "bind", "Source": work, "Target": work, "ReadOnly": False},
        {"Type": "bind", "Source": checkpoint, "Target": checkpoint, "ReadOnly": False},
        {"Type": "bind", "Source": str(reader), "Target": str(reader), "ReadOnly": True},
    ]
    assert body["User"] == "1000042:1000042" and body["WorkingDir"] == work
    assert body["Image"] == "img:1" and body["Entrypoint"] == [] and body["Cmd"] == launch.command
    assert body["Labels"] == {"silod.node": "gpu-7", "silod.work_dir": "/var/lib/silod", "silod.task": "job-a/0/3",
                              "silod.job": "job-a"}
    env = _env(body)
    assert env["HOME"] == "/tmp" and env["SILOD_AUTH_TOKEN"] == "job-token" and env["TINI_KILL_PROCESS_GROUP"] == "1"
    # No limits asked: none set (a /dev/shm of 2 GiB).
    free = spec.container_body(_launch(tmp_path, []), "img", _node(real_gpus=False))["HostConfig"]
    assert "Memory" not in free and "NanoCpus" not in free and free["ShmSize"] == spec.SHM_WITHOUT_LIMIT


def test_container_names_stay_in_dockers_alphabet() -> None:
    name = spec.container_name("gpu-7", "/var/lib/silod", "job-a/0/3")
    assert re.fullmatch(r"silod-gpu-7-job-a-r0-g3-[0-9a-f]{6}", name), name
    assert name != spec.container_name("gpu-7", "/var/lib/silod-2", "job-a/0/3")  # another agent's
    assert re.fullmatch(r"silod-n_1-j_b-r1-g2-[0-9a-f]{6}", spec.container_name("n 1", "/w", "j@b/1/2"))


@pytest.mark.parametrize(("image", "registry", "pull"), [
    ("python:3.11", "docker.io", "docker.io/library/python:3.11"),
    ("team/train:1", "docker.io", "docker.io/team/train:1"),
    ("docker.io/team/train:1", "docker.io", "docker.io/team/train:1"),
    ("127.0.0.1:5999/nope:1", "127.0.0.1:5999", "127.0.0.1:5999/nope:1"),
    ("registry.example/team/train@sha256:abc", "registry.example", "registry.example/team/train@sha256:abc"),
    ("localhost/train", "localhost", "localhost/train"),
])
def test_the_registry_an_image_comes_from(image: str, registry: str, pull: str) -> None:
    assert spec.image_registry(image) == registry
    assert spec.pull_reference(image) == pull


def test_operator_credentials_are_read_checked_and_found_for_their_registry(tmp_path: Path) -> None:
    path = tmp_path / "auth.json"
    path.write_text(json.dumps({"127.0.0.1:5999": {"username": "op", "password": "s3cret"},
                                "docker.io": {"username": "hub", "password": "h"}}))
    auths = spec.load_registry_auth(str(path))
    assert spec.credentials_for("127.0.0.1:5999/team/x:1", auths) == {"username": "op", "password": "s3cret"}
    assert spec.credentials_for("python:3.11", auths) == {"username": "hub", "password": "h"}
    assert spec.credentials_for("other.example/x:1", auths) is None
    assert spec.load_registry_auth("") == {}
    for text, says in (("{", "is not JSON"), ("[]", "must hold an object"),
                       ('{"r": {"username": "u"}}', "'r' must be")):
        path.write_text(text)
        with pytest.raises(spec.RegistryAuthError, match=says):
            spec.load_registry_auth(str(path))
    with pytest.raises(spec.RegistryAuthError, match="cannot read"):
        spec.load_registry_auth(str(tmp_path / "absent.json"))


def test_oom_kill_is_the_reason() -> None:
    assert spec.exit_reason({"OOMKilled": True}, 64 * 2**20) == "out of memory: the rank passed its limit of 64 MiB"
    assert spec.exit_reason({"OOMKilled": False, "ExitCode": 137}, 64 * 2**20) == ""
    assert spec.exit_reason({"OOMKilled": True}, 0).startswith("out of memory: ")


def _settings(tmp_path: Path, **kwargs) -> Settings:  # type: ignore[no-untyped-def]
    return Settings(metadata_address="127.0.0.1:1", work_dir=str(tmp_path), **kwargs)


def _choose(settings: Settings, tmp_path: Path):  # type: ignore[no-untyped-def]
    return choose_runtime(settings, "n1", tmp_path, lambda contained: None, lambda indices: ([], ()))


@pytest.mark.skipif(os.geteuid() != 0, reason="the container runtime needs root; as another user it is refused")
def test_choose_runtime_makes_a_container_runtime_only_when_named(tmp_path: Path) -> None:
    runtime = _choose(_settings(tmp_path, runtime="container", default_image="img:1"), tmp_path)
    assert runtime.name == "container" and runtime.image_env and runtime.python == "python3"
    assert "Docker container per rank" in runtime.describe()
    assert _choose(_settings(tmp_path, runtime="auto"), tmp_path).name != "container"
    (tmp_path / "auth.json").write_text("{")
    with pytest.raises(ConfigError, match="^registry_auth_file: .*is not JSON"):
        _choose(_settings(tmp_path, runtime="container", registry_auth_file=str(tmp_path / "auth.json")), tmp_path)


def test_docker_host_must_be_a_unix_socket_or_tcp(tmp_path: Path) -> None:
    assert _settings(tmp_path, docker_host="tcp://10.0.0.5:2375").docker_host == "tcp://10.0.0.5:2375"
    with pytest.raises(ValueError, match="docker_host"):
        _settings(tmp_path, docker_host="/var/run/docker.sock")


def test_ranks_join_the_network_container_network_names(tmp_path: Path) -> None:
    """container_network: host (the default) or container:NAME, the network namespace of the agent's
    own container (an agent in Docker Compose: its ranks resolve the compose services' names)."""
    assert _settings(tmp_path).container_network == "host"
    named = _settings(tmp_path, container_network="container:silod-agent-0-1")
    body = spec.container_body(_launch(tmp_path, []), "img", spec.RankContainer(
        node="n", agent_work_dir="/w", uid=1, gid=1, pids_limit=64, real_gpus=False,
        network=named.container_network))
    assert body["HostConfig"]["NetworkMode"] == "container:silod-agent-0-1"
    assert "Hostname" not in body and "PortBindings" not in body["HostConfig"]  # the Engine refuses them there
    for wrong in ("bridge", "container:", "container:-x", "none; rm"):
        with pytest.raises(ValueError, match="container_network"):
            _settings(tmp_path, container_network=wrong)


def test_a_non_root_agent_is_refused_the_container_runtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 12345)
    with pytest.raises(ConfigError, match="^runtime: container needs the agent to run as root"):
        _choose(_settings(tmp_path, runtime="container", job_uids="2000000-2000100"), tmp_path)


@pytest.mark.skipif(os.geteuid() != 0, reason="the container runtime needs root; as another user it is refused")
def test_an_agent_that_cannot_reach_the_engine_exits_2_naming_docker_host(tmp_path: Path) -> None:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "silod.cli", "worker-agent", "--metadata-address", "127.0.0.1:1",
                           "--runtime", "container", "--docker-host", f"unix://{tmp_path}/no-docker.sock",
                           "--work-dir", str(tmp_path / "agent"), "--listen", "127.0.0.1:0"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"docker_host: cannot reach the Docker Engine at unix://{tmp_path}/no-docker.sock" in done.stderr
