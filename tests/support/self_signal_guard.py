"""Refuse, in a test process, a signal that would kill the test run itself: os.kill to pid 0 or
-1 or to this process's group, os.killpg of this process's group, and SIGKILL to this process.
And keep SIGPIPE ignored, as Python leaves it: code under test that made it fatal (the CLI's
main() once did) left the worker to die of the next write to any closed socket or pipe.

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


def sigpipe_made_fatal() -> bool:
    """True (and SIGPIPE ignored again) if something in this process stopped ignoring it."""
    if not hasattr(signal, "SIGPIPE") or signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN:
        return False
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    return True


def install() -> None:
    os.kill, os.killpg = _kill, _killpg
