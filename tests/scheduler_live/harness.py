"""Helpers shared by the live scheduler tests."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest


def wait_for(condition: Callable[[], object], timeout: float = 10.0, what: str = "condition") -> object:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)
