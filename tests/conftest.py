"""Suite-wide settings for every process the tests start.

Every DDP job in the suite (examples, fidelity runs, resize and crash tests) names the
``cudaonly`` backend (tests/support/cudaonly_backend.py) for its accelerator, as a GPU job names
NCCL: a silod collective on a CPU tensor that reached it would fail as it does on a GPU. The
ranks import the module through PYTHONPATH, which the agents pass on to them (contained ranks
because SILOD_RANK_ENV_PASSTHROUGH names it).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.support import leftovers, prebuild, self_signal_guard

ROOT = Path(__file__).resolve().parents[1]
self_signal_guard.install()

os.environ.setdefault("SILOD_DIST_BACKEND", "cudaonly")
os.environ.setdefault("SILOD_DIST_BACKEND_MODULE", "tests.support.cudaonly_backend")
# Agents that contain their ranks (as root: the default) let them read the job code of the
# repository and get the variables above, as an operator's node settings would.
os.environ.setdefault("SILOD_CONTAINED_READ_PATHS", ",".join(str(ROOT / d) for d in ("examples", "tests", "benchmarks")))
os.environ.setdefault("SILOD_RANK_ENV_PASSTHROUGH", "PYTHONPATH,SILOD_DIST_*")
_paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
if str(ROOT) not in _paths:
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *_paths])


@pytest.fixture(autouse=True)
def _sigpipe_stays_ignored():  # type: ignore[no-untyped-def]
    """The test that made SIGPIPE fatal in this process fails, rather than a later one dying."""
    yield
    if self_signal_guard.sigpipe_made_fatal():
        pytest.fail("SIGPIPE is no longer ignored in the test process: a write to a closed socket "
                    "would kill it (tests/support/self_signal_guard.py)")


@pytest.hookimpl(optionalhook=True)  # a venv without pytest-xdist runs the suite in one process
def pytest_xdist_make_scheduler(config, log):  # type: ignore[no-untyped-def]
    """`make test` runs on pytest-xdist workers: whole test modules go to one worker (their tests
    share module-scoped service processes, started once, and some follow from the one before),
    and all of tests/lab to one worker, since its hosts are namespaces of fixed names."""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "tests/lab" if nodeid.startswith("tests/lab/") else nodeid.split("::", 1)[0]

    return ModuleScheduling(config, log)


_NETWORK_BEFORE: list[leftovers.HostNetwork] = []
_PREBUILD: list[subprocess.Popen[bytes]] = []
_RUN_OWNER = "SILOD_TEST_RUN_PID"


def _outermost_run(session: pytest.Session) -> bool:
    """The process that started the run, not an xdist worker nor a pytest run by a test (which
    would count the outer run's processes as its own leftovers)."""
    return not hasattr(session.config, "workerinput") and os.environ.get(_RUN_OWNER) == str(os.getpid())


def pytest_sessionstart(session: pytest.Session) -> None:
    if not hasattr(session.config, "workerinput"):
        os.environ.setdefault(_RUN_OWNER, str(os.getpid()))  # inherited: a nested run sees the outer's
    if _outermost_run(session):
        _NETWORK_BEFORE.append(leftovers.host_network())
        # A whole-suite run builds the Docker images meanwhile (tests/support/prebuild.py).
        if prebuild.wanted(session.config):
            _PREBUILD.extend(filter(None, [prebuild.start()]))


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The run fails if it leaves a process of this checkout running (tests/support/leftovers.py),
    each named and killed, or the host's network changed (a namespace left, iptables' FORWARD
    policy not put back), each named. Looked for once, by the process that started the run, after
    its xdist workers have ended (each a worker's own processes stopped as it ended)."""
    if not _outermost_run(session):
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    for proc in _PREBUILD:
        line = prebuild.finish(proc)
        if reporter is not None:
            reporter.write_line(line)
    left = leftovers.wait_for_none(ROOT, grace_s=20)
    leftovers.kill(left)
    problems = [f"process of this checkout still running (killed now): pid {leftover.pid}: {leftover.command[:300]}"
                for leftover in left]
    if _NETWORK_BEFORE:
        problems += leftovers.network_changes(_NETWORK_BEFORE[0], leftovers.host_network())
    if not problems:
        return
    message = "the run did not stop what it started:\n" + "\n".join(f"  {problem}" for problem in problems)
    if reporter is not None:
        reporter.write("\n")
        reporter.write_line(message, red=True)
    else:
        print(message)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
