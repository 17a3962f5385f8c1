"""`make demo` runs end to end: real metadata process on SQLite, real CLI, clean shutdown."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_demo_registers_lists_and_shuts_down_cleanly(tmp_path: Path) -> None:
    workdir = tmp_path / "demo"
    result = subprocess.run(
        [sys.executable, "-m", "silod.demo", "--workdir", str(workdir)],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "registered sample-images: 48 objects" in out
    assert "sample-images" in out.split("$ silod dataset list", 1)[1]  # the listing shows it
    assert "manifest version: 1" in out
    assert "exited with code 0" in out
    assert (workdir / "metadata.db").exists()
    log = next((workdir / "logs").glob("metadata-*.log")).read_text()
    assert "RegisterDataset" in log  # the request log recorded the call
