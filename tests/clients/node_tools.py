"""Node.js and the npm packages of clients/node (grpc-js, proto-loader, buf) for the contract tests.

``npm ci`` installs exactly the versions in clients/node/package-lock.json the first time (a few
seconds; the registry is reachable here). Node.js missing, or npm unable to install, skips the
tests locally and fails them under CI=true: CI must prove the contracts work for other languages.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NODE_CLIENT = ROOT / "clients" / "node"
BUF = NODE_CLIENT / "node_modules" / ".bin" / "buf"


def _unavailable(reason: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}; CI must check the contracts with Node.js and buf (install nodejs and npm)")
    pytest.skip(reason)


def node_client_ready() -> Path:
    """The client directory with its node_modules installed; skips/fails when that cannot be."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        _unavailable("Node.js (node and npm) is not installed")
    if not (NODE_CLIENT / "node_modules" / "@grpc" / "grpc-js").is_dir() or not BUF.exists():
        done = subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=NODE_CLIENT, capture_output=True,
                              text=True, timeout=600)
        if done.returncode != 0:
            _unavailable(f"npm ci in clients/node failed: {done.stderr.strip()[-500:]}")
    return NODE_CLIENT
