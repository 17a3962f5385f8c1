"""Start silod services as child processes on loopback: the demo, `silod up` and the tests use it.

Each service is started with ``--listen HOST:0 --ready-file F``: the OS picks a free port and
the service writes the address it bound once it is serving, so nothing guesses ports or
sleeps. Extra ``args`` come after these flags and argparse keeps the last occurrence, so
``"--listen", "127.0.0.1:PORT"`` pins a port (to restart a service where clients expect it).

A service started here stops, as on SIGTERM, once the process that started it is gone: a
launcher killed with SIGKILL (a test run cut off, `silod up` killed) cannot stop what it started,
and nothing else would. The service is told its launcher's process id in ``LAUNCHER_PID_ENV``
and watches its parent (services.runtime.server); processes started some other way (systemd,
compose, Kubernetes) are not told and do not watch.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LAUNCHER_PID_ENV = "SILOD_LAUNCHER_PID"  # set for each service started here; read (and removed) by the service


class LaunchError(RuntimeError):
    """The service exited before it was ready; the message includes its log."""


class ServiceProcess:
    """A running ``silod <command>``; use as a context manager so it never outlives its user."""

    def __init__(self, command: str, proc: subprocess.Popen[bytes], log_path: Path, workdir: Path, own_workdir: bool):
        self.command = command
        self.proc = proc
        self.log_path = log_path
        self.workdir = workdir
        self.address = ""
        self._own_workdir = own_workdir

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def running(self) -> bool:
        return self.proc.poll() is None

    def terminate(self, timeout: float = 15.0) -> int:
        """SIGTERM (graceful shutdown) and wait; returns the exit code.

        A service that ignores SIGTERM is a bug worth failing on: it is killed and
        TimeoutError (with the log) raised.
        """
        if self.running():
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise TimeoutError(f"silod {self.command} did not exit {timeout:g}s after SIGTERM; log:\n{self.log()}") from None

    def kill(self) -> int:
        """SIGKILL: no shutdown code runs, as in a crash or an OOM kill. Returns the exit code."""
        if self.running():
            self.proc.kill()
        return self.proc.wait()

    def close(self) -> None:
        """Kill if still running and delete the working directory if the launcher made it."""
        self.kill()
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> ServiceProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_service(
    command: str,
    *args: str,
    env: dict[str, str] | None = None,
    timeout_s: float = 30,
    workdir: str | os.PathLike[str] | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
) -> ServiceProcess:
    """Start ``python -m silod.cli <command>`` and return once it has written its ready file.

    ``port`` 0 lets the OS pick a free one. ``env`` is added to the current environment. The log (stdout and stderr) goes to
    ``<workdir>/<command>-<n>.log``; ``workdir`` defaults to a fresh temporary directory that
    :meth:`ServiceProcess.close` removes. Raises LaunchError (the process exited) or
    TimeoutError, both with the log in the message.
    """
    own_workdir = workdir is None
    wd = Path(tempfile.mkdtemp(prefix=f"silod-{command}-")) if workdir is None else Path(workdir)
    wd.mkdir(parents=True, exist_ok=True)
    stem = f"{command}-{time.monotonic_ns()}"  # unique: one workdir can hold a service and its restarts
    ready_file = wd / f"{stem}.ready"
    log_path = wd / f"{stem}.log"
    argv = [sys.executable, "-m", "silod.cli", command, "--listen", f"{host}:{port}", "--ready-file", str(ready_file), *args]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {}), LAUNCHER_PID_ENV: str(os.getpid())}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=full_env)
    service = ServiceProcess(command, proc, log_path, wd, own_workdir)
    try:
        service.address = _wait_for_ready_file(service, ready_file, timeout_s)
    except BaseException:
        service.close()
        raise
    return service


def _wait_for_ready_file(service: ServiceProcess, ready_file: Path, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready_file.exists():  # written by rename, so never seen half-written
            return ready_file.read_text().strip()
        if not service.running():
            raise LaunchError(
                f"silod {service.command} exited with code {service.proc.returncode} before it was ready; "
                f"log:\n{service.log()}"
            )
        time.sleep(0.05)
    raise TimeoutError(f"silod {service.command} not ready after {timeout_s:g}s; log:\n{service.log()}")
