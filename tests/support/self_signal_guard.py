"""Refuse, in a test process, a signal that would kill the test run itself: os.kill to pid 0 or
-1 or to this process's group, os.killpg of this process's group, and SIGKILL to this process.

Code under test that computes a pid or group wrongly (a record's pid 0, a rank started in the
agent's group) would otherwise take the pytest worker down with it, and xdist reports only
"node down: Not properly terminated" for the test it was running, whichever test sent it. Here
the sender fails, with its stack, and the worker lives on.
"""

from __future__ import annotations

import os
import signal

_real_kill, _real_killpg = os.kill, os.killpg


def _refuse(call: str) -> None:
    raise AssertionError(f"{call} would signal the test process itself (tests/support/self_signal_guard.py)")


def _kill(pid: int, sig: int) -> None:
    if sig != 0 and (pid in (0, -1) or pid == -os.getpgrp() or (pid == os.getpid() and sig == signal.SIGKILL)):
        _refuse(f"os.kill({pid}, {sig})")
    _real_kill(pid, sig)


def _killpg(pgid: int, sig: int) -> None:
    if sig != 0 and pgid in (0, os.getpgrp()):
        _refuse(f"os.killpg({pgid}, {sig})")
    _real_killpg(pgid, sig)


def install() -> None:
    os.kill, os.killpg = _kill, _killpg
