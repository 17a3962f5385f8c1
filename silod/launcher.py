"""Start silod services as child processes on loopback: the demo and `silod up` use it.

Each service is started with ``--listen HOST:0 --ready-file F`` so the OS picks a free
port and the service writes the address it actually bound once it is serving; nothing
has to guess ports or poll with sleeps.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path


class LaunchError(RuntimeError):
    """A service exited or did not become ready; the message includes its log tail."""


@dataclass
class ServiceProcess:
    command: str
    proc: subprocess.Popen[bytes]
    address: str
    log_path: Path
    _log_file: object = field(repr=False, default=None)

    def terminate(self, timeout_s: float = 15.0) -> int:
        """SIGTERM (graceful shutdown), then SIGKILL if it overstays; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._close_log()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL: no chance to clean up (what durability tests want)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._close_log()

    def log_tail(self, max_bytes: int = 4000) -> str:
        try:
            return self.log_path.read_bytes()[-max_bytes:].decode(errors="replace")
        except OSError:
            return ""

    def _close_log(self) -> None:
        if self._log_file is not None:
            self._log_file.close()  # type: ignore[attr-defined]
            self._log_file = None

    def __enter__(self) -> "ServiceProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.terminate()


def start_service(
    command: str,
    *args: str,
    host: str = "127.0.0.1",
    log_dir: str | os.PathLike[str] | None = None,
    env: dict[str, str] | None = None,
    timeout_s: float = 30.0,
) -> ServiceProcess:
    """Run ``silod COMMAND --listen HOST:0 ... ARGS`` and return once it is serving."""
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="silod-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    ready = log_dir / f"{command}.{os.getpid()}.{time.monotonic_ns()}.ready"
    log_path = log_dir / f"{command}.log"
    log_file = open(log_path, "ab")
    argv = [sys.executable, "-m", "silod.cli", command, "--listen", f"{host}:0", "--ready-file", str(ready), *args]
    proc = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    service = ServiceProcess(command, proc, "", log_path, log_file)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready.exists() and ready.stat().st_size > 0:
            service.address = ready.read_text().strip()
            ready.unlink(missing_ok=True)
            return service
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    service.kill()
    state = f"exited with {proc.returncode}" if proc.returncode is not None else f"not ready after {timeout_s:.0f} s"
    raise LaunchError(f"silod {command} {state}; log {log_path}:\n{service.log_tail()}")
