"""What the client-install tests share: the silod wheel (built once a run), the Pythons the
package metadata names, and one small cluster started from the full install (the suite's own
Python), on which jobs of the client environments run.

The client environments must use what they installed and nothing of this checkout: the suite
puts the checkout on PYTHONPATH for the processes it starts (tests/conftest.py), so the
commands, and the worker agent that launches the client jobs, run without it."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.cache_server.harness import make_dataset, register
from tests.client_install.boundary import ROOT
from tests.support.procs import ServiceProcess, free_port, start_service

# The Python the suite (and the services) run on; the other versions pyproject.toml's classifiers
# name are tested by installing the wheel into an environment of their own (test_sdk_pythons).
SUITE_PYTHON = f"{sys.version_info[0]}.{sys.version_info[1]}"


def classified_pythons() -> list[str]:
    """The "Programming Language :: Python :: 3.N" classifiers of pyproject.toml, oldest first."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found = [m.group(1) for c in project.get("classifiers", [])
             if (m := re.fullmatch(r"Programming Language :: Python :: (3\.\d+)", c))]
    return sorted(found, key=lambda v: tuple(int(p) for p in v.split(".")))


def find_python(version: str) -> Path | None:
    """An interpreter of ``version`` ("3.12") that can make virtual environments: ``python3.12``
    on PATH, else pyenv's newest 3.12.x (pyenv's shim on PATH answers only for the versions pyenv
    has activated, so it is tried but not trusted)."""
    candidates = [found] if (found := shutil.which(f"python{version}")) else []
    pyenv = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv") / "versions"
    builds = [p for p in pyenv.glob(f"{version}.*") if re.fullmatch(rf"{re.escape(version)}\.\d+", p.name)]
    for build in sorted(builds, key=lambda p: int(p.name.rsplit(".", 1)[1]), reverse=True):
        candidates.append(str(build / "bin" / f"python{version}"))
    probe = "import sys, venv, ensurepip; print(sys.executable); print('%d.%d' % sys.version_info[:2])"
    for candidate in candidates:
        try:
            done = subprocess.run([candidate, "-c", probe], capture_output=True, text=True, timeout=60,
                                  env=client_env())
        except OSError:
            continue
        lines = done.stdout.split()
        if done.returncode == 0 and len(lines) == 2 and lines[1] == version:
            return Path(lines[0])
    return None


def client_env(**extra: str) -> dict[str, str]:
    """This process's environment without the checkout on PYTHONPATH and without silod's settings."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("SILOD_")}
    return {**env, **extra}


def pip_install(python: Path, *requirements: str, timeout_s: float = 600) -> None:
    done = subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *requirements],
                          capture_output=True, text=True, timeout=timeout_s, env=client_env())
    assert done.returncode == 0, done.stderr[-3000:]


def installed_distributions(python: Path) -> set[str]:
    out = subprocess.run([str(python), "-m", "pip", "list", "--format", "json", "--disable-pip-version-check"],
                         check=True, capture_output=True, text=True, timeout=120, env=client_env()).stdout
    return {p["name"].lower().replace("_", "-") for p in json.loads(out)}


@pytest.fixture(scope="session")
def silod_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The silod wheel of this checkout (what `pip install silod` installs), built once a run."""
    out = tmp_path_factory.mktemp("wheel")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(ROOT)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return next(out.glob("silod-*.whl"))


def order_free_digest(blobs: Any) -> int:
    """XOR of the blobs' SHA-256 prefixes: the same whatever order a job reads them in."""
    digest = 0
    for data in blobs:
        digest ^= int.from_bytes(hashlib.sha256(data).digest()[:8], "big")
    return digest


@dataclass
class Cluster:
    """Metadata, scheduler, one node (a cache server and a worker agent with one GPU)."""

    root: Path
    metadata: str
    scheduler: str
    cache: str
    procs: list[ServiceProcess] = field(default_factory=list)

    def dataset(self, name: str, count: int, size: int, seed: int) -> int:
        """Register ``count`` files of ``size`` bytes as ``name``; returns their order-free digest.
        One dataset per job: the cache statistics a test checks are then that job's alone."""
        files = make_dataset(self.root / "store" / name, count, size, seed=seed)
        register(self.metadata, name, f"file://{self.root / 'store' / name}")
        return order_free_digest(files.values())

    def rank_log(self, job_id: str, rank: int = 0) -> str:
        return (self.root / "work" / "jobs" / job_id / f"rank-{rank}.log").read_text()


@pytest.fixture(scope="session")
def sdk_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("sdk-cluster")
    procs: list[ServiceProcess] = []

    def start(*args: str, **kw: Any) -> ServiceProcess:
        proc = start_service(*args, workdir=root / "logs", timeout_s=60, **kw)
        procs.append(proc)
        return proc

    try:
        md = start("metadata", "--db", f"sqlite:///{root / 'md.db'}", "--log-level", "warning")
        scheduler = f"127.0.0.1:{free_port()}"
        start("scheduler", "--metadata-address", md.address, "--policy", "fifo", "--interval-s", "0.5",
              "--log-level", "warning", port=int(scheduler.rsplit(":", 1)[1]))
        cache = start("cache-server", "--metadata-address", md.address, "--node", "n0",
                      "--disk-cache-dir", str(root / "disk"), "--memory-cache-bytes", "0", "--no-fsync",
                      "--log-level", "warning")
        # PYTHONPATH empty: the agent passes its environment on to the jobs it launches, and a
        # client job must import the silod it installed, not this checkout. The process runtime:
        # the jobs run the interpreters of the tests' own client installs, made in temporary
        # directories after the node starts (a contained rank reads only what its agent names).
        start("worker-agent", "--metadata-address", md.address, "--scheduler-address", scheduler,
              "--node-name", "n0", "--gpus", "1", "--work-dir", str(root / "work"),
              "--heartbeat-s", "0.5", "--report-s", "0.5", "--cache-address", cache.address,
              "--runtime", "process", "--log-level", "warning", env={"PYTHONPATH": ""})
        yield Cluster(root, md.address, scheduler, cache.address, procs)
    finally:
        for proc in reversed(procs):
            proc.close()
