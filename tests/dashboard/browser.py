"""Headless Chromium for the dashboard's browser test (tests/cli_cluster/test_up_and_jobs.py runs
it on the `silod up` cluster that module starts anyway)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tests.support.procs import REPO_ROOT

TOKEN = "dash-token"
ARTIFACTS = REPO_ROOT / "build" / "test-artifacts"


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if path is None:
        message = "Chromium is not installed (Debian: apt-get install chromium)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{message}; CI must run the dashboard's browser test")
        pytest.skip(message)
    return path


def run(chromium: str, url: str, *args: str) -> subprocess.CompletedProcess[str]:
    # --virtual-time-budget lets the page's fetch and rendering settle before the DOM is taken.
    return subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                           "--virtual-time-budget=5000", *args, url],
                          capture_output=True, text=True, timeout=120)
