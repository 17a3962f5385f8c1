"""tests/support/prebuild.py without Docker: when a run starts it, and how the run ends it (its
builds are the fixtures' own, exercised by every whole-suite run)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.support import prebuild


@pytest.mark.parametrize(("switch", "whole_suite", "expected"), [
    ("", True, True), ("", False, False), ("0", True, False), ("1", False, True)])
def test_a_whole_suite_run_starts_it_unless_switched_off(monkeypatch: pytest.MonkeyPatch, switch: str,
                                                         whole_suite: bool, expected: bool) -> None:
    monkeypatch.setenv(prebuild.SWITCH, switch)
    assert prebuild.wanted(whole_suite) is expected


def test_a_run_that_ends_first_stops_it_with_sigterm(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    marker = tmp_path / "terminated"
    monkeypatch.setattr(prebuild, "log_path", lambda: tmp_path / "prebuild.log")
    # Stands in for a prebuild busy building: notes the SIGTERM it gets (the real one gives the
    # engine back in build_all's finally), then exits.
    proc = subprocess.Popen([sys.executable, "-c", (
        "import signal, sys, time\n"
        f"signal.signal(signal.SIGTERM, lambda *_: (open({str(marker)!r}, 'w').close(), sys.exit(143)))\n"
        "print('ready', flush=True)\n"
        "time.sleep(120)\n")], stdout=subprocess.PIPE, start_new_session=True)
    assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
    started = time.monotonic()
    line = prebuild.finish(proc)
    assert proc.returncode == 143 and marker.exists(), (proc.returncode, line)
    assert time.monotonic() - started < 30 and "stopped, the run ended first" in line


def test_a_finished_prebuild_is_summed_up_by_its_last_line(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    log = tmp_path / "prebuild.log"
    log.write_text("12:00:00 engine ready in 1.0 s\n12:03:00 every image built (180.0 s in all; {})\n")
    monkeypatch.setattr(prebuild, "log_path", lambda: log)
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert prebuild.finish(proc) == f"image prebuild: 12:03:00 every image built (180.0 s in all; {{}}) (log: {log})"
