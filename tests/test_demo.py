"""`make demo` runs end to end: `silod up` (4 emulated nodes, metadata on SQLite), dataset
registration through the real CLI, emulated jobs submitted and watched to completion, a
summary, and a clean shutdown."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from silod.demo import DEMO_JOBS, NODES


def test_demo_runs_jobs_on_the_cluster_and_shuts_down_cleanly(tmp_path: Path) -> None:
    workdir = tmp_path / "demo"
    result = subprocess.run(
        [sys.executable, "-m", "silod.demo", "--workdir", str(workdir)],
        capture_output=True, text=True, timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert f"silod cluster is up ({NODES} nodes" in out
    assert all(f"node-{i} worker-agent" in out and f"node-{i} cache-server" in out for i in range(NODES))
    assert "registered sample-images: 48 objects" in out
    assert "sample-images" in out.split("$ silod dataset list", 1)[1]  # the listing shows it
    assert "manifest version: 1" in out
    summary = out.split("JCT", 1)[1].split("$ silod logs", 1)[0]
    rows = [line.split() for line in summary.strip().splitlines()]
    assert sorted(r[1] for r in rows) == sorted(j[0] for j in DEMO_JOBS)
    assert all(r[2] == "SUCCEEDED" and float(r[4].rstrip("s")) > 0 for r in rows), summary
    assert "emulated: done samples=960" in out  # `silod logs` of the first job
    assert "silod up: all services stopped" in out and "exited with code 0" in out
    assert (workdir / "metadata.db").exists() and not (workdir / "cluster.json").exists()
    log = next((workdir / "logs").glob("metadata-*.log")).read_text()
    assert "RegisterDataset" in log  # the request log recorded the call
