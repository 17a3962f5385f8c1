"""The suite's guard against code under test signalling the pytest process itself
(tests/support/self_signal_guard.py, installed by tests/conftest.py)."""

from __future__ import annotations

import os
import signal

import pytest

from tests.support import self_signal_guard


def test_signals_that_would_end_the_test_process_are_refused_and_others_pass() -> None:
    for call in (lambda: os.killpg(os.getpgrp(), signal.SIGKILL), lambda: os.killpg(0, signal.SIGTERM),
                 lambda: os.kill(0, signal.SIGTERM), lambda: os.kill(-1, signal.SIGKILL),
                 lambda: os.kill(-os.getpgrp(), signal.SIGTERM), lambda: os.kill(os.getpid(), signal.SIGKILL)):
        with pytest.raises(AssertionError, match="would signal the test process itself"):
            call()
    os.kill(os.getpid(), 0)  # a liveness probe is no signal
    received = []
    previous = signal.signal(signal.SIGUSR1, lambda *_: received.append(True))
    try:
        os.kill(os.getpid(), signal.SIGUSR1)  # a handled signal to itself still arrives
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert received == [True]


def test_a_fatal_sigpipe_is_found_and_ignored_again() -> None:
    assert not self_signal_guard.sigpipe_made_fatal()
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    assert self_signal_guard.sigpipe_made_fatal()
    assert signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN
