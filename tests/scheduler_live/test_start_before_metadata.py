"""A scheduler started before its metadata service (a host booting every unit at once, `docker
compose up` with the services side by side): it waits, saying so with the address, and serves once
the metadata service is up; SIGTERM while it waits stops it cleanly. A refusal that waiting cannot
mend (a wrong token) still ends it at once, in one line."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from tests.e2e.harness import wait_until
from tests.support.procs import free_port, start_service


def _scheduler(tmp_path: Path, metadata_address: str, *args: str) -> tuple[subprocess.Popen[bytes], Path, Path]:
    ready, log = tmp_path / "scheduler.ready", tmp_path / "scheduler.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "silod.cli", "scheduler", "--listen", "127.0.0.1:0",
                                 "--metadata-address", metadata_address, "--ready-file", str(ready),
                                 "--log-level", "info", *args], stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path)
    return proc, ready, log


def test_the_scheduler_waits_for_its_metadata_service_and_then_serves(tmp_path: Path) -> None:
    port = free_port()
    proc, ready, log = _scheduler(tmp_path, f"127.0.0.1:{port}")
    metadata = None
    try:
        wait_until(lambda: log.read_text().count("metadata service not answering") >= 2, 60,
                  "the scheduler saying twice that it waits")
        assert proc.poll() is None and not ready.exists(), log.read_text()
        assert f'"metadata": "127.0.0.1:{port}"' in log.read_text()
        metadata = start_service("metadata", "--db", f"sqlite:///{tmp_path / 'md.db'}", "--log-level", "warning",
                                 workdir=tmp_path / "metadata", port=port)
        address = wait_until(lambda: ready.exists() and ready.read_text().strip(), 30, "the scheduler serving")
        health = subprocess.run([sys.executable, "-m", "silod.cli", "health", address], capture_output=True,
                                text=True, timeout=60)
        assert health.returncode == 0, health.stdout + health.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        if metadata is not None:
            metadata.close()
    assert code == 0, log.read_text()


def test_sigterm_while_it_waits_stops_it_cleanly(tmp_path: Path) -> None:
    proc, ready, log = _scheduler(tmp_path, f"127.0.0.1:{free_port()}")
    wait_until(lambda: "metadata service not answering" in log.read_text(), 60, "the scheduler waiting")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0, log.read_text()
    assert "stopped before serving" in log.read_text() and not ready.exists()


def test_a_refusal_waiting_cannot_mend_ends_it_in_one_line(tmp_path: Path) -> None:
    metadata = start_service("metadata", "--db", f"sqlite:///{tmp_path / 'md.db'}", "--log-level", "warning",
                             "--auth-token", "the-right-token", workdir=tmp_path / "metadata")
    try:
        proc, ready, log = _scheduler(tmp_path, metadata.address, "--auth-token", "a-wrong-token")
        code = proc.wait(timeout=60)
    finally:
        metadata.close()
    lines = [line for line in log.read_text().splitlines() if line.startswith("silod scheduler:")]
    assert code == 1 and len(lines) == 1, log.read_text()
    assert lines[0].startswith("silod scheduler: cannot start: on_start failed: a call was refused: UNAUTHENTICATED: ")
    assert "debug_error_string" not in log.read_text() and not ready.exists()
