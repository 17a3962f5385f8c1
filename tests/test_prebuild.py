"""tests/support/prebuild.py without Docker: when a run starts it, and how the run ends it (its
builds are the fixtures' own, exercised by every whole-suite run)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.support import prebuild


def _config(args_source: str = "TESTPATHS", **options: object) -> SimpleNamespace:
    option = SimpleNamespace(**{"keyword": "", "markexpr": "", "lf": False, "stepwise": False, **options})
    return SimpleNamespace(args_source=getattr(pytest.Config.ArgsSource, args_source), ArgsSource=pytest.Config.ArgsSource,
                           option=option)


@pytest.mark.parametrize(("switch", "config", "expected"), [
    ("", _config(), True), ("", _config("ARGS"), False), ("", _config(keyword="compose"), False),
    ("", _config(markexpr="slow"), False), ("", _config(lf=True), False), ("", _config(stepwise=True), False),
    ("0", _config(), False), ("1", _config("ARGS"), True)])
def test_a_whole_suite_run_starts_it_unless_switched_off(monkeypatch: pytest.MonkeyPatch, switch: str,
                                                         config: SimpleNamespace, expected: bool) -> None:
    monkeypatch.setenv(prebuild.SWITCH, switch)
    assert prebuild.wanted(config) is expected


# build_all in a process of its own, the engine's steps replaced by ones that note what they did.
_BUILD_ALL = """
import sys, time
from pathlib import Path
from tests.support import docker_engine as engines, prebuild
notes = Path(sys.argv[1])
def note(what):
    with notes.open("a") as f:
        f.write(what + "\\n")
class Engine:
    def docker(self, *args, **kwargs):
        pass
def acquire():
    note("acquiring"); print("acquiring", flush=True); time.sleep(float(sys.argv[2])); note("acquired")
    return Engine()
def base_image(engine):
    note("base"); print("base", flush=True); time.sleep(float(sys.argv[3])); note("base done")
    return "base:tag"
def job_image(engine):
    note("job"); print("building", flush=True); time.sleep(60); note("job done")
engines.acquire_engine, engines.base_image, engines.build_job_image = acquire, base_image, job_image
engines.release_engine = lambda engine: note("released")
engines.CACHE = notes.parent
prebuild.SERVICE_BUILDS = []
sys.exit(prebuild.build_all())
"""


def _build_all(tmp_path, install_s: float, base_s: float) -> tuple[subprocess.Popen[str], Path]:  # type: ignore[no-untyped-def]
    notes = tmp_path / "notes"
    proc = subprocess.Popen([sys.executable, "-c", _BUILD_ALL, str(notes), str(install_s), str(base_s)],
                            cwd=prebuild.ROOT, stdout=subprocess.PIPE, text=True)
    return proc, notes


def test_a_stop_waits_for_the_install_and_the_base_image(tmp_path) -> None:  # type: ignore[no-untyped-def]
    proc, notes = _build_all(tmp_path, install_s=1.0, base_s=1.0)
    assert proc.stdout is not None and proc.stdout.readline().endswith("acquiring\n")
    proc.send_signal(signal.SIGTERM)  # while "apt-get" runs
    assert proc.wait(timeout=30) == 1
    assert notes.read_text().split("\n")[:-1] == ["acquiring", "acquired", "base", "base done", "released"]


def test_a_stop_while_images_build_ends_it_and_gives_the_engine_back(tmp_path) -> None:  # type: ignore[no-untyped-def]
    proc, notes = _build_all(tmp_path, install_s=0, base_s=0)
    assert proc.stdout is not None
    while not proc.stdout.readline().endswith("building\n"):
        pass
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert notes.read_text().split("\n")[:-1] == ["acquiring", "acquired", "base", "base done", "job", "released"]


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
