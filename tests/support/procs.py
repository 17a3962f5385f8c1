"""Process launcher for tests: the product's own (silod.launcher), plus a free-port helper."""

from __future__ import annotations

import collections
import socket
from pathlib import Path

from silod.launcher import LaunchError, ServiceProcess, start_service

__all__ = ["REPO_ROOT", "LaunchError", "ServiceProcess", "free_port", "start_service"]

REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A TCP port free right now (another process could take it before use; good enough for
    tests), and not one this process handed out lately: the kernel may give the same free port
    to two calls in a row, and a test that asks for two ports before starting anything then
    gets one twice (a CI run's second scheduler met the first one's metrics port)."""
    for _ in range(50):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port not in _HANDED_OUT:
            break
    _HANDED_OUT.append(port)
    return port


_HANDED_OUT: collections.deque[int] = collections.deque(maxlen=256)  # free_port's recent answers
