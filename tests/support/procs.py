"""Run silod services as real processes in tests, the way an operator would start them.

``start_service`` binds port 0 and learns the address from the ready file, so tests run in
parallel without port clashes. Extra ``args`` come after the launcher's own flags and
argparse keeps the last occurrence, so ``"--listen", "127.0.0.1:PORT"`` pins a port (e.g. to
restart a killed service where its clients expect it).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A TCP port free right now (another process could take it before use; good enough for tests)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ServiceProcess:
    """A running ``silod <command>``; use as a context manager so it never outlives the test."""

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
        """SIGTERM (a graceful shutdown) and wait; returns the exit code.

        If the process does not exit in time it is killed and TimeoutError (with the log) raised,
        since a service that ignores SIGTERM is itself a bug worth failing on.
        """
        if self.running():
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise TimeoutError(
                f"silod {self.command} did not exit {timeout:g}s after SIGTERM; log:\n{self.log()}"
            ) from None

    def kill(self) -> int:
        """SIGKILL: no shutdown code runs, as in a crash or an OOM kill. Returns the exit code."""
        if self.running():
            self.proc.kill()
        return self.proc.wait()

    def close(self) -> None:
        """Kill if still running and delete the temporary directory the launcher made."""
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
    timeout_s: float = 20,
    workdir: str | os.PathLike[str] | None = None,
) -> ServiceProcess:
    """Start ``python -m silod.cli <command>`` and return once it has written its ready file.

    ``env`` is added to the current environment. The log (stdout and stderr) goes to
    ``<workdir>/<command>-<n>.log``; ``workdir`` defaults to a fresh temporary directory that
    :meth:`ServiceProcess.close` removes. Raises RuntimeError (the process exited) or
    TimeoutError, both with the log in the message.
    """
    own_workdir = workdir is None
    wd = Path(tempfile.mkdtemp(prefix=f"silod-{command}-")) if workdir is None else Path(workdir)
    wd.mkdir(parents=True, exist_ok=True)
    # Unique names, so the same workdir can hold a service and its restarts.
    stem = f"{command}-{time.monotonic_ns()}"
    ready_file = wd / f"{stem}.ready"
    log_path = wd / f"{stem}.log"
    argv = [
        sys.executable, "-m", "silod.cli", command,
        "--listen", "127.0.0.1:0", "--ready-file", str(ready_file), *args,
    ]  # fmt: skip
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=full_env, cwd=REPO_ROOT)
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
            raise RuntimeError(
                f"silod {service.command} exited with code {service.proc.returncode} before it was ready; "
                f"log:\n{service.log()}"
            )
        time.sleep(0.05)
    raise TimeoutError(f"silod {service.command} not ready after {timeout_s:g}s; log:\n{service.log()}")
