"""The lab cluster: deploy/compose.yaml's services, each in its own network namespace.

``Lab(...).up()`` creates one namespace per compose service (the service name is its host
name), starts the services in depends_on order, waits for each condition the compose file
states (``service_healthy`` runs the service's own health check inside its namespace,
``service_completed_successfully`` waits for exit 0) and raises :class:`LabError` with the
service's log if a command, variable or health check is wrong. ``down()`` stops everything and
removes every namespace and link, whatever state ``up()`` got to.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Mapping

from silod.lab import compose, netns

BIN = Path(sys.executable).parent


class LabError(RuntimeError):
    pass


def _pg_bin(name: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    if not found:
        raise LabError(f"PostgreSQL's {name} is not installed (/usr/lib/postgresql/*/bin)")
    return found[-1]


class Lab:
    def __init__(self, state_dir: str | Path, nodes: int = 2, env: Mapping[str, str] | None = None,
                 prefix: str = netns.PREFIX, health_timeout_s: float = 90.0,
                 compose_file: Path = compose.COMPOSE_FILE, inference_nodes: int = 1):
        self.state_dir = Path(state_dir).resolve()
        self.env = dict(env or {})
        self.services = compose.load(nodes, self.env, compose_file, inference_nodes=inference_nodes)
        self.net = netns.Network(list(self.services), prefix)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.health_timeout_s = health_timeout_s
        self._pg_dir = ""

    # --- addresses -------------------------------------------------------------------------
    def address(self, service: str, port: int | None = None) -> str:
        """``HOST_ADDRESS:PORT`` of a service (its first compose port unless given)."""
        s = self.services[service]
        return f"{self.net.hosts[service].address}:{port if port is not None else s.ports[0]}"

    def hosts(self) -> dict[str, str]:
        return {name: h.address for name, h in self.net.hosts.items()}

    def describe(self) -> dict[str, object]:
        """What ``lab.json`` tells other commands (``silod lab workload``) about the running lab;
        the object store credentials are the lab's own compose values, not an operator's."""
        s3_env = {k: v for svc in self.services.values() if svc.kind == "silod"
                  for k, v in svc.environment.items() if k.startswith("AWS_")}
        return {"prefix": self.net.prefix, "hosts": self.hosts(),
                "ports": {n: s.ports for n, s in self.services.items() if s.ports},
                "s3_env": s3_env, "pids": {n: p.pid for n, p in self.procs.items()}}

    # --- lifecycle -------------------------------------------------------------------------
    def up(self) -> "Lab":
        netns.remove_leftovers(self.net.prefix)
        (self.state_dir / "logs").mkdir(parents=True, exist_ok=True)
        try:
            self.net.create()
            for name, svc in self.services.items():
                for dep, condition in svc.depends_on.items():
                    self._wait_condition(dep, condition)
                self.start(name)
            for name, svc in self.services.items():
                if svc.healthcheck:
                    self._wait_condition(name, "service_healthy")
            (self.state_dir / "lab.json").write_text(json.dumps(self.describe(), indent=2))
        except BaseException:
            self.down()
            raise
        return self

    def __enter__(self) -> "Lab":
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    def start(self, name: str) -> None:
        svc = self.services[name]
        argv = self._argv(svc)
        env = {"PATH": f"{BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}", "HOME": str(self.state_dir),
               "LANG": "C.UTF-8", "PYTHONUNBUFFERED": "1"}
        env.update({k: self._paths(v, svc) for k, v in svc.environment.items()})
        log = open(self.state_dir / "logs" / f"{name}.log", "ab")
        self.procs[name] = subprocess.Popen(self.net.exec_prefix(name) + argv, env=env, stdout=log,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True, cwd=self.state_dir)
        log.close()

    def stop(self, name: str, timeout: float = 30.0) -> int | None:
        proc = self.procs.get(name)
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        return proc.returncode

    def down(self) -> None:
        for name in reversed(list(self.procs)):
            try:
                self.stop(name, timeout=20.0)
            except Exception:  # noqa: BLE001 - cleanup continues whatever one process did
                pass
        self.net.close()
        (self.state_dir / "lab.json").unlink(missing_ok=True)   # `silod lab workload` must not find a lab that is gone
        if self._pg_dir:
            shutil.rmtree(self._pg_dir, ignore_errors=True)

    def link(self, name: str, up: bool) -> None:
        self.net.link(name, up)

    def log(self, name: str) -> str:
        p = self.state_dir / "logs" / f"{name}.log"
        return p.read_text(errors="replace") if p.exists() else ""

    def run(self, name: str, argv: list[str], timeout: float = 30.0,
            env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """Run a command inside ``name``'s namespace (its host names resolve there)."""
        return subprocess.run(self.net.exec_prefix(name) + argv, capture_output=True, text=True, timeout=timeout,
                              env={"PATH": f"{BIN}:/usr/bin:/bin", "HOME": str(self.state_dir), **(env or {})})

    def healthy(self, name: str) -> bool:
        check = self._check_argv(self.services[name])
        try:
            return self.run(name, check, timeout=15).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    # --- internals -------------------------------------------------------------------------
    def _wait_condition(self, name: str, condition: str) -> None:
        proc = self.procs[name]
        deadline = time.monotonic() + self.health_timeout_s
        while time.monotonic() < deadline:
            code = proc.poll()
            if condition == "service_completed_successfully":
                if code == 0:
                    return
                if code is not None:
                    raise LabError(f"{name} exited {code} (compose: {' '.join(self.services[name].command)}); "
                                   f"log:\n{self.log(name)[-3000:]}")
            else:
                if code is not None:
                    raise LabError(f"{name} exited {code} before it was healthy; log:\n{self.log(name)[-3000:]}")
                if condition == "service_started" or not self.services[name].healthcheck or self.healthy(name):
                    return
            time.sleep(0.3)
        raise LabError(f"{name}: not {condition} after {self.health_timeout_s:g}s; log:\n{self.log(name)[-3000:]}")

    def work_dir(self, agent: str) -> Path:
        """The directory agent ``agent``'s ``--work-dir`` is in this lab (its volume's, under the
        state dir): its task logs are in jobs/JOB/."""
        svc = self.services[agent]
        return Path(self._paths(svc.command[svc.command.index("--work-dir") + 1], svc))

    def _paths(self, value: str, svc: compose.Service) -> str:
        return compose.map_volumes([value], svc.volumes, self.state_dir / "volumes")[0]

    def _argv(self, svc: compose.Service) -> list[str]:
        for target, source in svc.volumes.items():
            (self.state_dir / "volumes" / source).mkdir(parents=True, exist_ok=True)
        if svc.kind == "silod":
            return [str(BIN / "silod"), *compose.map_volumes(svc.command, svc.volumes, self.state_dir / "volumes")]
        if svc.kind == "objectstore":
            return [str(BIN / "moto_server"), "-H", "0.0.0.0", "-p", str(svc.ports[0] if svc.ports else 5000)]
        return self._postgres_argv(svc)

    def _postgres_argv(self, svc: compose.Service) -> list[str]:
        """The postgres image's entrypoint: initdb with POSTGRES_USER/PASSWORD/DB, then the server
        on every address of its host. Its data dir is outside the state dir, which the
        postgres user may not be able to enter."""
        if not self._pg_dir:
            self._pg_dir = tempfile.mkdtemp(prefix=f"{self.net.prefix}-pg-")
            shutil.chown(self._pg_dir, "postgres", "postgres")
            user = svc.environment.get("POSTGRES_USER", "postgres")
            password = svc.environment.get("POSTGRES_PASSWORD", "")
            pwfile = Path(self._pg_dir) / "pw"
            pwfile.write_text(password + "\n")
            shutil.chown(pwfile, "postgres", "postgres")
            data = f"{self._pg_dir}/data"
            init = subprocess.run(["runuser", "-u", "postgres", "--", _pg_bin("initdb"), "-D", data, "-U", user,
                                   f"--pwfile={pwfile}", "--auth-local=trust", "--auth-host=scram-sha-256"],
                                  capture_output=True, text=True)
            if init.returncode != 0:
                raise LabError(f"initdb failed: {init.stderr}")
            with open(f"{data}/pg_hba.conf", "a") as hba:
                hba.write(f"host all all {netns.SUBNET} scram-sha-256\n")
            db = svc.environment.get("POSTGRES_DB", user)
            boot = subprocess.run(["runuser", "-u", "postgres", "--", _pg_bin("postgres"), "--single", "-D", data,
                                   "-c", "listen_addresses=", "postgres"], input=f'CREATE DATABASE "{db}";\n',
                                  capture_output=True, text=True)
            if boot.returncode != 0:
                raise LabError(f"creating database {db} failed: {boot.stderr}")
        port = svc.ports[0] if svc.ports else 5432
        return ["runuser", "-u", "postgres", "--", _pg_bin("postgres"), "-D", f"{self._pg_dir}/data",
                "-c", "listen_addresses=*", "-c", f"port={port}", "-c", f"unix_socket_directories={self._pg_dir}"]

    def _check_argv(self, svc: compose.Service) -> list[str]:
        argv = list(svc.healthcheck)
        if argv[0] == "pg_isready":
            argv[0] = _pg_bin("pg_isready")
        elif argv[0] in ("python", "python3"):
            argv[0] = sys.executable
        elif argv[0] == "silod":
            argv[0] = str(BIN / "silod")
        return argv
