"""Docker Engine for the tests that need one: installed when missing, one ``dockerd`` shared by
every test worker of a run, and images built without a registry (docs/containers.md, "Tests").

* Packages: ``docker.io`` (dockerd, containerd, runc, docker-init), ``debootstrap``,
  ``docker-registry`` (Debian's registry, for pull tests), ``apache2-utils`` (htpasswd) and ``tini``
  where docker-init is missing, installed with apt-get as root (log: ``.venv/docker-install.log``).
  A machine where that or the daemon's start fails skips the tests that need it, with the reason,
  and fails them under ``CI=true``.
* The daemon: started by the first test worker that needs it unless one the tests started is
  running (a killed run's is reused); its socket and pidfile are Docker's defaults
  (``/var/run/docker.sock``, ``/var/run/docker.pid``, so the ``docker`` command works as is), its
  data root the default (images and build layers persist between runs); its bridge and every
  network it makes take addresses from 198.19.0.0/16 (``--bip``, ``--default-address-pool``),
  never Docker's 172.17.0.0/16. Its log is ``/run/silod-tests/docker/dockerd.log``. The last
  worker to finish stops it by its pid. A daemon the tests did not start is used and left alone.
* The lab: dockerd sets iptables' FORWARD policy to DROP, and with ``br_netfilter`` the frames the
  multi-host lab bridges between its namespaces (198.18.0.0/24, :mod:`silod.lab.netns`) pass
  FORWARD. Before starting dockerd the fixture inserts, at the top of FORWARD, a rule accepting
  198.18.0.0/24 -> 198.18.0.0/24 (comment ``silod-tests-lab``), so there is no moment the lab's
  traffic is dropped. When it stops the daemon it deletes that rule and restores the FORWARD policy
  and ``net.ipv4.ip_forward`` to what they were before the tests' first daemon (kept in
  ``/run/silod-tests/docker/state.json`` across killed runs). Docker's own chains stay, unused.
* Images (:func:`job_image`): a Debian bookworm base from ``debootstrap --variant=minbase`` (its
  root filesystem cached as a tarball in ``/var/cache/silod-tests``, keyed by the package list)
  with the host's CA bundle, imported with ``docker import``; FROM it, ``silod-test/pydeps``: a
  venv (``/opt/venv``, first on PATH) with the CPU PyTorch and the SDK's dependencies, the wheels
  fetched on the host by ``pip download`` (this machine's pip configuration finds torch 2.13.0+cpu
  on its disk) and carried in the build context; FROM that, ``silod-test/job``: the silod wheel of
  this checkout. Each tag is a hash of its inputs: an image whose inputs are unchanged is reused
  without a build.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOCKET = "/var/run/docker.sock"
PIDFILE = Path("/var/run/docker.pid")
STATE_DIR = Path("/run/silod-tests/docker")
CACHE = Path("/var/cache/silod-tests")
BRIDGE = "198.19.0.1/24"
POOL = "198.19.0.0/16"
LAB_SUBNET = "198.18.0.0/24"  # silod.lab.netns.SUBNET
LAB_RULE = ["-s", LAB_SUBNET, "-d", LAB_SUBNET, "-m", "comment", "--comment", "silod-tests-lab", "-j", "ACCEPT"]
# command that shows a package is present -> the Debian package that brings it
PACKAGES = {"dockerd": "docker.io", "debootstrap": "debootstrap", "docker-registry": "docker-registry",
            "docker-init": "tini", "htpasswd": "apache2-utils", "iptables": "iptables"}
BASE_PACKAGES = ("python3", "python3-venv", "python3-pip", "ca-certificates")
DEBIAN_MIRROR = "http://deb.debian.org/debian"
TORCH = "torch==2.13.0+cpu"  # the job's own PyTorch: the CPU build on this machine's disk
IMAGE_PATH = "/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
TIMINGS: dict[str, float] = {}  # what the builds of this run took (seconds), for reports


class DockerUnavailable(Exception):
    pass


def unavailable(reason: str) -> NoReturn:
    """Skip locally, fail under CI=true: CI must run the Docker tests."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}; CI must run the Docker tests")
    pytest.skip(reason)


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive lock shared by every test worker (and run) on this machine."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def image_lock(step: str) -> contextlib.AbstractContextManager[None]:
    """Held while one of the operator guide's images (tests/deploy/compose_guide.py BUILDS) is built,
    by the compose fixture or tests/support/prebuild.py: one build of an image at a time, so the
    second is a cache hit rather than the same work twice."""
    return locked(CACHE / f"{step}.lock")


def _run(*argv: str, timeout: float = 120, check: bool = True, **kwargs) -> subprocess.CompletedProcess:  # type: ignore[no-untyped-def]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kwargs)
    if check and done.returncode != 0:
        raise DockerUnavailable(f"{' '.join(argv[:3])} ...: exit {done.returncode}: "
                                f"{(done.stderr or done.stdout).strip()[-800:]}")
    return done


# ---- packages -------------------------------------------------------------------------------
def missing_packages() -> list[str]:
    return sorted({pkg for command, pkg in PACKAGES.items() if shutil.which(command) is None
                   and not (command == "iptables" and Path("/usr/sbin/iptables").exists())})


def ensure_packages() -> None:
    """apt-get install what is missing (as root), in the spirit of ensure_debian_package.sh."""
    with locked(CACHE / "install.lock"):
        missing = missing_packages()
        if not missing:
            return
        if os.geteuid() != 0 or shutil.which("apt-get") is None:
            raise DockerUnavailable(f"{', '.join(missing)} missing and cannot be installed here (needs root and "
                                    "apt-get)")
        log = ROOT / ".venv" / "docker-install.log" if (ROOT / ".venv").is_dir() else CACHE / "docker-install.log"
        print(f"installing Debian's {', '.join(missing)} for the Docker tests (log: {log})", file=sys.stderr)
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        with open(log, "a") as out:
            ok = subprocess.run(["apt-get", "update"], stdout=out, stderr=subprocess.STDOUT, env=env).returncode == 0
            ok = ok and subprocess.run(["apt-get", "install", "-y", "--no-install-recommends", *missing], stdout=out,
                                       stderr=subprocess.STDOUT, env=env).returncode == 0
        if not ok or missing_packages():
            raise DockerUnavailable(f"installing {', '.join(missing)} failed (log: {log})")


def docker_cli() -> str:
    """Debian's docker command (the engine's own version) where installed, else the one on PATH."""
    return "/usr/bin/docker" if Path("/usr/bin/docker").exists() else (shutil.which("docker") or "docker")


# ---- the daemon -----------------------------------------------------------------------------
def ping(host: str = SOCKET, timeout: float = 2.0) -> bool:
    import http.client
    import socket

    class UnixConnection(http.client.HTTPConnection):
        def connect(self) -> None:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(timeout)
            self.sock.connect(host)

    try:
        conn = UnixConnection("localhost", timeout=timeout)
        conn.request("GET", "/_ping")
        ok = conn.getresponse().status == 200
        conn.close()
        return ok
    except OSError:
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split(")")[-1][:3]


def _read_state() -> dict:
    try:
        return json.loads((STATE_DIR / "state.json").read_text())
    except (OSError, ValueError):
        return {}


def _write_state(state: dict) -> None:
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    tmp = STATE_DIR / "state.json.tmp"
    tmp.write_text(json.dumps(state))
    tmp.replace(STATE_DIR / "state.json")


def forward_policy() -> str:
    for line in _run("iptables", "-S", "FORWARD", timeout=30).stdout.splitlines():
        if line.startswith("-P FORWARD "):
            return line.split()[2]
    return "ACCEPT"


def forward_rules() -> list[str]:
    return _run("iptables", "-S", "FORWARD", timeout=30).stdout.splitlines()


def _lab_rule(action: str) -> bool:
    return _run("iptables", action, "FORWARD", *(["1"] if action == "-I" else []), *LAB_RULE, check=False,
                timeout=30).returncode == 0


def _ensure_lab_rule() -> None:
    if not _lab_rule("-C"):
        _lab_rule("-I")


@dataclass
class Engine:
    host: str = f"unix://{SOCKET}"
    cli: str = field(default_factory=docker_cli)
    pid: int = 0  # the dockerd the tests started (0: one they did not)

    def env(self) -> dict[str, str]:
        return {**os.environ, "DOCKER_HOST": self.host, "DOCKER_BUILDKIT": "0"}

    def docker(self, *args: str, timeout: float = 300, check: bool = True, **kwargs) -> subprocess.CompletedProcess:  # type: ignore[no-untyped-def]
        return _run(self.cli, *args, timeout=timeout, check=check, env=self.env(), **kwargs)

    def inspect_existing(self, *ids: str) -> list[dict]:  # type: ignore[type-arg]
        """docker inspect of the containers of ``ids`` that still exist: one listed by docker ps
        may be removed before it is inspected (a rank ending, an agent clearing its predecessor's),
        and docker then prints the others and exits 1 naming each one gone."""
        if not ids:
            return []
        done = self.docker("inspect", *ids, check=False)
        gone = [line for line in done.stderr.splitlines() if line.strip()]
        if done.returncode != 0 and not all(line.startswith("Error: No such object") for line in gone):
            raise DockerUnavailable(f"docker inspect: exit {done.returncode}: {done.stderr.strip()[-800:]}")
        return json.loads(done.stdout) if done.stdout.strip() else []

    def has_image(self, tag: str) -> bool:
        return self.docker("image", "inspect", "--format", "{{.Id}}", tag, check=False, timeout=30).returncode == 0


def _start_daemon() -> int:
    """Start dockerd (the caller holds the lock); its pid."""
    state = _read_state()
    if "forward_policy_before" not in state:  # a killed run's record keeps the values from before it
        state["forward_policy_before"] = forward_policy()
        state["ip_forward_before"] = Path("/proc/sys/net/ipv4/ip_forward").read_text().strip()
    _ensure_lab_rule()  # before dockerd's DROP: the lab never loses a frame
    state["lab_rule"] = True
    log = open(STATE_DIR / "dockerd.log", "ab")
    proc = subprocess.Popen(["dockerd", "--bip", BRIDGE, "--default-address-pool", f"base={POOL},size=24",
                             "--pidfile", str(PIDFILE), "-H", f"unix://{SOCKET}"],
                            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    state.update(pid=proc.pid, users=[])
    _write_state(state)
    deadline = time.monotonic() + 60
    while not ping():
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = (STATE_DIR / "dockerd.log").read_text(errors="replace")[-1500:]
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            _restore(state)
            raise DockerUnavailable(f"dockerd did not start (log {STATE_DIR / 'dockerd.log'}):\n{tail}")
        time.sleep(0.2)
    return proc.pid


def _stop_daemon(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


def _restore(state: dict) -> None:
    """Put back what the tests' daemon changed: the lab rule out, the FORWARD policy, ip_forward."""
    if state.get("lab_rule"):
        while _lab_rule("-C"):
            _lab_rule("-D")
    if state.get("forward_policy_before"):
        _run("iptables", "-P", "FORWARD", state["forward_policy_before"], check=False, timeout=30)
    if state.get("ip_forward_before") in ("0", "1"):
        Path("/proc/sys/net/ipv4/ip_forward").write_text(state["ip_forward_before"])
    (STATE_DIR / "state.json").unlink(missing_ok=True)


def _remove_stale_containers(engine: Engine) -> None:
    """Containers of earlier runs' agents (label silod.work_dir) whose work_dir is gone."""
    listed = engine.docker("ps", "-a", "--filter", "label=silod.work_dir", "--format",
                           '{{.ID}} {{.Label "silod.work_dir"}}', check=False, timeout=60).stdout.split("\n")
    stale = [line.split(" ", 1)[0] for line in listed if " " in line and not Path(line.split(" ", 1)[1]).exists()]
    if stale:
        engine.docker("rm", "-f", *stale, check=False, timeout=120)


def acquire_engine() -> Engine:
    """The run's daemon, started if needed; this process counted as one of its users."""
    ensure_packages()
    with locked(STATE_DIR / "lock"):
        state = _read_state()
        ours = int(state.get("pid", 0))
        if ours and _alive(ours) and ping():
            engine = Engine(pid=ours)
        elif ping():
            return Engine(pid=0)  # a daemon the tests did not start: used, never stopped
        else:
            if os.geteuid() != 0:
                raise DockerUnavailable("starting dockerd needs root")
            engine = Engine(pid=_start_daemon())
            state = _read_state()
            _remove_stale_containers(engine)
        _ensure_lab_rule()
        state["users"] = [p for p in state.get("users", []) if _alive(p) and p != os.getpid()] + [os.getpid()]
        _write_state(state)
        return engine


def release_engine(engine: Engine) -> None:
    """This process is done with the daemon; the last user stops it and restores the host."""
    if not engine.pid:
        return
    with locked(STATE_DIR / "lock"):
        state = _read_state()
        if int(state.get("pid", 0)) != engine.pid:
            return
        state["users"] = [p for p in state.get("users", []) if _alive(p) and p != os.getpid()]
        if state["users"]:
            _write_state(state)
            return
        _stop_daemon(engine.pid)
        _restore(state)


@pytest.fixture(scope="session")
def docker_engine() -> Iterator[Engine]:
    """The Docker Engine (skipped with the reason where there is none, failed under CI=true)."""
    try:
        engine = acquire_engine()
    except (DockerUnavailable, OSError, subprocess.TimeoutExpired) as exc:
        unavailable(f"no Docker Engine: {exc}")
    try:
        yield engine
    finally:
        release_engine(engine)


# ---- images ---------------------------------------------------------------------------------
def _digest(*parts: str | bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part if isinstance(part, bytes) else part.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def _rootfs_tarball() -> Path:
    """debootstrap's minbase bookworm with Python, as a tarball cached by its package list."""
    key = _digest("bookworm", "minbase", DEBIAN_MIRROR, *BASE_PACKAGES)
    tarball = CACHE / f"rootfs-bookworm-{key}.tar"
    if tarball.exists():
        return tarball
    work = CACHE / f"rootfs-{key}.tmp"
    shutil.rmtree(work, ignore_errors=True)
    started = time.monotonic()
    _run("debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}", "bookworm", str(work),
         DEBIAN_MIRROR, timeout=900)
    _run("tar", "-C", str(work), "-cf", str(tarball) + ".part", ".", timeout=300)
    os.replace(str(tarball) + ".part", tarball)
    shutil.rmtree(work, ignore_errors=True)
    TIMINGS["debootstrap_s"] = time.monotonic() - started
    return tarball


def base_image(engine: Engine) -> str:
    """silod-test/base:<hash>: the rootfs with the host's CA bundle, imported."""
    tarball = _rootfs_tarball()
    ca = Path("/etc/ssl/certs/ca-certificates.crt").read_bytes()
    tag = f"silod-test/base:{_digest(tarball.name, ca)}"
    if engine.has_image(tag):
        return tag
    started = time.monotonic()
    importer = subprocess.Popen([engine.cli, "import", "-c", f"ENV PATH={IMAGE_PATH}", "-", tag], env=engine.env(),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert importer.stdin is not None and importer.stdout is not None
    with tarfile.open(tarball) as src, tarfile.open(fileobj=importer.stdin, mode="w|") as dst:
        for member in src:  # the rootfs as debootstrap made it, but the host's CA bundle
            if member.name.lstrip("./") == "etc/ssl/certs/ca-certificates.crt":
                member = tarfile.TarInfo(member.name)
                member.size, member.mode = len(ca), 0o644
                dst.addfile(member, io.BytesIO(ca))
            else:
                dst.addfile(member, src.extractfile(member) if member.isfile() else None)
    importer.stdin.close()
    output = importer.stdout.read().decode(errors="replace")
    if importer.wait(timeout=600) != 0:
        raise DockerUnavailable(f"docker import {tag}: {output.strip()[-800:]}")
    TIMINGS["import_s"] = time.monotonic() - started
    return tag


def sdk_requirements() -> list[str]:
    """The SDK's own dependencies (pyproject's [project] dependencies) and the job's torch."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [*project["dependencies"], TORCH]


def _build(engine: Engine, tag: str, context: Path, dockerfile: str) -> None:
    (context / "Dockerfile").write_text(dockerfile)
    try:
        engine.docker("build", "-q", "-t", tag, str(context), timeout=1200)
    except DockerUnavailable as exc:
        raise DockerUnavailable(f"building {tag}: {exc}") from None


def pydeps_image(engine: Engine) -> str:
    """silod-test/pydeps:<hash>: the base with a venv holding torch and the SDK's dependencies."""
    base = base_image(engine)
    requirements = sdk_requirements()
    constraints = Path("/etc/xdg/pip/constraints.txt")
    tag = f"silod-test/pydeps:{_digest(base, *requirements, constraints.read_text() if constraints.exists() else '')}"
    if engine.has_image(tag):
        return tag
    started = time.monotonic()
    context = CACHE / "build" / tag.replace("/", "_").replace(":", "_")
    shutil.rmtree(context, ignore_errors=True)
    (context / "wheels").mkdir(parents=True)
    _run(sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "-d", str(context / "wheels"),
         *requirements, timeout=900)
    quoted = " ".join(f"'{r}'" for r in requirements)
    _build(engine, tag, context, (
        f"FROM {base}\n"
        "COPY wheels /tmp/wheels\n"
        "RUN python3 -m venv /opt/venv && /opt/venv/bin/pip install -q --no-cache-dir --no-index "
        f"--find-links /tmp/wheels {quoted} && rm -rf /tmp/wheels\n"
        f"ENV PATH={IMAGE_PATH}\n"))
    shutil.rmtree(context, ignore_errors=True)
    TIMINGS["pydeps_build_s"] = time.monotonic() - started
    _prune(engine, "silod-test/pydeps")
    return tag


def _prune(engine: Engine, repository: str, keep: int = 3) -> None:
    """Drop all but the ``keep`` newest tags of one of the tests' repositories (an image a container
    still uses stays: the Engine refuses)."""
    listed = engine.docker("images", repository, "--format", "{{.CreatedAt}}\t{{.Repository}}:{{.Tag}}",
                           check=False, timeout=60).stdout.splitlines()
    old = [line.split("\t")[1] for line in sorted(listed, reverse=True)[keep:] if "\t" in line]
    if old:
        engine.docker("rmi", *old, check=False, timeout=300)


def sdk_sources_digest() -> str:
    """What the job image's silod wheel is built from: the silod package and pyproject.toml."""
    h = hashlib.sha256((ROOT / "pyproject.toml").read_bytes())
    for path in sorted((ROOT / "silod").rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
            h.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def build_job_image(engine: Engine) -> str:
    """silod-test/job:<hash>: python3 (a venv first on PATH) with torch and this checkout's silod."""
    pydeps = pydeps_image(engine)
    tag = f"silod-test/job:{_digest(pydeps, sdk_sources_digest())}"
    if engine.has_image(tag):
        return tag
    started = time.monotonic()
    context = CACHE / "build" / tag.replace("/", "_").replace(":", "_")
    shutil.rmtree(context, ignore_errors=True)
    context.mkdir(parents=True)
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(context), str(ROOT), timeout=600)
    wheel = next(context.glob("silod-*.whl")).name
    _build(engine, tag, context, (
        f"FROM {pydeps}\n"
        f"COPY {wheel} /tmp/\n"
        f"RUN /opt/venv/bin/pip install -q --no-cache-dir --no-deps /tmp/{wheel} && rm /tmp/{wheel}\n"))
    shutil.rmtree(context, ignore_errors=True)
    TIMINGS["job_build_s"] = time.monotonic() - started
    _prune(engine, "silod-test/job")
    return tag


@pytest.fixture(scope="session")
def job_image(docker_engine: Engine) -> str:
    """The job image of this checkout (built or reused; see the module's docstring)."""
    started = time.monotonic()
    try:
        with locked(CACHE / "build.lock"):
            tag = build_job_image(docker_engine)
    except (DockerUnavailable, OSError, subprocess.TimeoutExpired) as exc:
        unavailable(f"cannot build the job image: {exc}")
    TIMINGS["job_image_s"] = time.monotonic() - started
    return tag


def registry_reachable(address: str, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://{address}/v2/", timeout=1)
            return True
        except urllib.error.HTTPError:
            return True  # 401: up, asking for credentials
        except OSError:
            time.sleep(0.1)
    return False


def tiny_image(engine: Engine) -> str:
    """silod-test/tiny:<hash>: docker-init's static tini as ``/tini`` and nothing else (about 1 MB):
    an image to push and pull in no time. ``/tini --version`` prints its version and exits 0."""
    binary = Path("/usr/bin/tini-static").read_bytes() if Path("/usr/bin/tini-static").exists() \
        else Path(os.path.realpath(shutil.which("docker-init") or "/usr/bin/docker-init")).read_bytes()
    tag = f"silod-test/tiny:{_digest(binary)}"
    if engine.has_image(tag):
        return tag
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        member = tarfile.TarInfo("tini")
        member.size, member.mode = len(binary), 0o755
        tar.addfile(member, io.BytesIO(binary))
        for directory in ("tmp", "etc"):
            info = tarfile.TarInfo(directory)
            info.type, info.mode = tarfile.DIRTYPE, 0o1777 if directory == "tmp" else 0o755
            tar.addfile(info)
    done = subprocess.run([engine.cli, "import", "-", tag], input=buffer.getvalue(), capture_output=True,
                          env=engine.env(), timeout=120)
    if done.returncode != 0:
        raise DockerUnavailable(f"docker import {tag}: {done.stderr.decode(errors='replace').strip()}")
    return tag


@dataclass
class Registry:
    """Debian's docker-registry on loopback, with basic auth (htpasswd, bcrypt)."""

    address: str
    username: str
    password: str
    proc: subprocess.Popen  # type: ignore[type-arg]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextlib.contextmanager
def registry(directory: Path, port: int) -> Iterator[Registry]:
    """A registry on 127.0.0.1:``port`` storing under ``directory``; stopped by its pid."""
    import secrets

    username, password = "silod-operator", secrets.token_hex(12)
    hashed = _run("htpasswd", "-Bbn", username, password, timeout=30).stdout.strip()
    (directory / "htpasswd").write_text(hashed + "\n")
    (directory / "config.yml").write_text(json.dumps({  # YAML is a superset of JSON
        "version": 0.1, "log": {"level": "info"},
        "storage": {"filesystem": {"rootdirectory": str(directory / "data")}},
        "http": {"addr": f"127.0.0.1:{port}"},
        "auth": {"htpasswd": {"realm": "silod-tests", "path": str(directory / "htpasswd")}},
    }))
    log_path = directory / "registry.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(["docker-registry", "serve", str(directory / "config.yml")], stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        if not registry_reachable(f"127.0.0.1:{port}"):
            raise DockerUnavailable(f"docker-registry did not start: {log_path.read_text(errors='replace')[-800:]}")
        yield Registry(f"127.0.0.1:{port}", username, password, proc, log_path)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def push(engine: Engine, image: str, target: str, reg: Registry, config_dir: Path) -> None:
    """Tag ``image`` as ``target`` in the registry, push it with the registry's credentials (a
    docker config of the test's own, not root's), then drop the local tag: a rank must pull it."""
    engine.docker("tag", image, target)
    engine.docker("--config", str(config_dir), "login", "-u", reg.username, "--password-stdin", reg.address,
                  input=reg.password, timeout=60)
    engine.docker("--config", str(config_dir), "push", target, timeout=300)
    engine.docker("rmi", target, timeout=60)
