"""Process launcher for tests: the product's own (silod.launcher), plus a free-port helper."""

from __future__ import annotations

import socket
from pathlib import Path

from silod.launcher import LaunchError, ServiceProcess, start_service

__all__ = ["REPO_ROOT", "LaunchError", "ServiceProcess", "free_port", "start_service"]

REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A TCP port free right now (another process could take it before use; good enough for tests)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
