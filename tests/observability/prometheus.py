"""Debian's Prometheus for the tests: promtool, and a server on a loopback port that scrapes what
a file_sd target file lists (the one `silod up` writes), queried over its HTTP API."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.support.procs import free_port


def require(tool: str) -> str:
    """The tool's path; skipped locally and failed under CI=true where it is missing
    (`make test` installs it: tests/support/ensure_debian_package.sh)."""
    path = shutil.which(tool)
    if path is None:
        message = f"{tool} is not installed (Debian: apt-get install prometheus)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{message}; CI must run the metrics tests")
        pytest.skip(message)
    return path


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url

    def query(self, promql: str) -> list[dict[str, Any]]:
        with urllib.request.urlopen(f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': promql})}",
                                    timeout=10) as reply:
            body = json.loads(reply.read())
        assert body["status"] == "success", body
        return body["data"]["result"]

    def value(self, promql: str) -> float | None:
        """The single value of an aggregating query; None while it has no result."""
        result = self.query(promql)
        return float(result[0]["value"][1]) if result else None

    def wait_for(self, promql: str, check: Any, timeout: float = 60, what: str = "") -> float:
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            last = self.value(promql)
            if last is not None and check(last):
                return last
            time.sleep(0.5)
        raise AssertionError(f"{what or promql}: last value {last} after {timeout:g}s")


@contextmanager
def prometheus_scraping(targets: Path, work: Path) -> Iterator[Prometheus]:
    """A Prometheus that scrapes every second whatever ``targets`` (file_sd JSON) lists."""
    binary = require("prometheus")
    work.mkdir(parents=True, exist_ok=True)
    config = work / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, scrape_timeout: 900ms, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: silod\n"
        f"    file_sd_configs: [{{files: ['{targets}'], refresh_interval: 1s}}]\n")
    port = free_port()
    log = (work / "prometheus.log").open("wb")
    proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={work / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                            stdout=log, stderr=subprocess.STDOUT)
    server = Prometheus(f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (work / "prometheus.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{server.url}/-/ready", timeout=2) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "prometheus did not become ready"
            time.sleep(0.2)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
