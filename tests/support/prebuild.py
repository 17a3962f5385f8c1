"""The suite's Docker images, built while its other tests run.

On a machine that has never run the suite, the first test that needs Docker installs Debian's
Docker packages and builds every image (a Debian root from debootstrap, the job image with the CPU
PyTorch, the deployment's images: tests/support/docker_engine.py, tests/deploy/test_compose_docker.py):
minutes in which its worker runs nothing else, much of it waiting on downloads. A whole-suite run
starts this module at once, in a process of its own (tests/conftest.py), so that the wait overlaps
the tests that need no image. It builds with the fixtures' own functions and the operator guide's
own commands, under the same locks: a fixture that comes first waits for the image being built and
then finds it unchanged, and what is built here is what the fixtures would have built. A failure is
only logged; the fixture that needs the image tries again and reports it.

    .venv/bin/python -m tests.support.prebuild      # by hand: the log goes to stdout

``SILOD_TEST_PREBUILD=0`` keeps a whole-suite run from starting it, ``=1`` starts it for any run.
A run that ends before it does stops it (SIGTERM), once it has installed Debian's packages and
made the base image (an install or a debootstrap cut short would leave the machine in a mess).
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from tests.deploy.compose_guide import BASE, BUILDS, TORCH
from tests.support import docker_engine as engines

ROOT = Path(__file__).resolve().parents[2]
SWITCH = "SILOD_TEST_PREBUILD"
SERVICE_BUILDS = [step for step in BUILDS if step != "build-digits-job"]


def run_guide_build(engine: engines.Engine, step: str) -> None:
    """The guide's ``docker build`` of ``step``, as the compose fixture runs it (same engine, same
    builder, same context), so its layers are the ones the fixture's build finds."""
    argv = [engine.cli, *shlex.split(BUILDS[step])[1:]]
    with engines.image_lock(step):
        done = subprocess.run(argv, cwd=ROOT, env=engine.env(), capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise engines.DockerUnavailable(f"{step} exited {done.returncode}: {(done.stderr or done.stdout)[-1500:]}")


def _log(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {message}", flush=True)


def _timed(name: str, work: Callable[[], object], failures: list[str]) -> None:
    started = time.monotonic()
    try:
        work()
    except Exception as exc:  # noqa: BLE001 - logged; the fixture that needs it reports it
        failures.append(name)
        _log(f"{name} failed after {time.monotonic() - started:.1f} s: {exc}")
        return
    _log(f"{name} done in {time.monotonic() - started:.1f} s")


def build_all() -> int:
    """Every image the suite builds; 0 if all were built (or found), 1 if any failed."""
    started = time.monotonic()
    failures: list[str] = []
    # A SIGTERM while apt-get installs would leave dpkg half done ("dpkg was interrupted"), and
    # one while debootstrap runs its root's /proc mounted: those and the daemon's start finish
    # first, then the stop is honoured (docker builds may be cut short).
    stop_asked: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stop_asked.append(signum))
    try:
        engine = engines.acquire_engine()  # installs Debian's packages and starts dockerd if needed
    except (engines.DockerUnavailable, OSError, subprocess.TimeoutExpired) as exc:
        _log(f"no Docker Engine, nothing built: {exc}")
        return 1
    _log(f"engine ready in {time.monotonic() - started:.1f} s")
    try:
        def base() -> None:
            with engines.locked(engines.CACHE / "build.lock"):
                engine.docker("tag", engines.base_image(engine), BASE)

        _timed("base image", base, failures)
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
        if stop_asked:
            _log("stopped after the base image: the run ended first")
            return 1
        if failures:
            return 1

        def training() -> None:
            with engines.locked(engines.CACHE / "build.lock"):
                engine.docker("tag", engines.build_job_image(engine), TORCH)
            run_guide_build(engine, "build-digits-job")

        # As the compose fixture does: the services' images side by side, the training images meanwhile.
        threads = [threading.Thread(target=_timed, args=(name, work, failures), daemon=True)
                   for name, work in [("job images", training),
                                      *((step, lambda s=step: run_guide_build(engine, s)) for step in SERVICE_BUILDS)]]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        engines.release_engine(engine)
    _log(f"{'failed: ' + ', '.join(failures) if failures else 'every image built'} "
         f"({time.monotonic() - started:.1f} s in all; {engines.TIMINGS})")
    return 1 if failures else 0


# ---- started by the run's controller ----------------------------------------------------------
def wanted(config: Any) -> bool:
    """A run of the whole suite (no paths, no -k, -m, --lf or --sw) unless the switch says otherwise."""
    option = config.option
    whole_suite = (config.args_source == config.ArgsSource.TESTPATHS and not option.keyword and not option.markexpr
                   and not option.lf and not option.stepwise)
    return {"0": False, "1": True}.get(os.environ.get(SWITCH, ""), whole_suite)


def log_path() -> Path:
    return ROOT / ".venv" / "prebuild.log" if (ROOT / ".venv").is_dir() else engines.CACHE / "prebuild.log"


def start() -> subprocess.Popen[bytes] | None:
    """This module in a process of its own, logging to :func:`log_path`; None if it cannot start."""
    try:
        log: IO[bytes] = open(log_path(), "wb")
    except OSError:
        return None
    with log:
        return subprocess.Popen([sys.executable, "-m", "tests.support.prebuild"], cwd=ROOT, stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def finish(proc: subprocess.Popen[bytes]) -> str:
    """A line for the run's summary. A run that ended before the builds did (one that stopped at its
    first failure) stops it: SIGTERM, so that it gives the engine back."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=600)  # an install of Debian's packages goes on to its end
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        return f"image prebuild: stopped, the run ended first (log: {log_path()})"
    lines = log_path().read_text(errors="replace").splitlines() if log_path().exists() else []
    return f"image prebuild: {lines[-1] if lines else 'no output'} (log: {log_path()})"


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # through build_all's finally: the engine given back


if __name__ == "__main__":
    sys.exit(build_all())
