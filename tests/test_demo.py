"""`make demo` runs end to end: a throttled S3 store emulator, `silod up` with training and
inference nodes (deepboot, cache co-allocation), two datasets registered through the CLI, training
jobs and an inference burst watched to completion, a summary with lent GPUs, a PNG chart and a
clean shutdown — in well under the 5 minutes the demo promises."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

from silod.demo import DATASETS, INFERENCE_BURST, INFERENCE_NODES, NODES, TRAINING_JOBS


def test_demo_runs_training_and_inference_and_shuts_down_cleanly(tmp_path: Path) -> None:
    workdir = tmp_path / "demo"
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "silod.demo", "--workdir", str(workdir)],
                            capture_output=True, text=True, timeout=300)
    took = time.monotonic() - started
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert took < 300
    assert f"silod cluster is up ({NODES + INFERENCE_NODES} nodes x 2 GPUs, {INFERENCE_NODES} of them inference)" in out
    assert re.search(r"dashboard: http://127\.0\.0\.1:\d+/", out)
    for name, files, _ in DATASETS:
        assert f"registered {name}: {files} objects" in out
    summary = out.split("NAME             KIND", 1)[1].split("average training JCT", 1)[0]
    rows = {line.split()[0]: line.split() for line in summary.strip().splitlines()[1:] if line.strip()}
    expected = [j[0] for j in TRAINING_JOBS] + [f"infer-{k}" for k in range(len(INFERENCE_BURST))]
    assert sorted(rows) == sorted(expected), summary
    assert all(r[2] == "SUCCEEDED" and float(r[4].rstrip("s")) > 0 for r in rows.values()), summary
    lent = re.search(r"GPUs lent to training: up to (\d+) at once, (\d+) GPU-seconds", out)
    assert lent and int(lent.group(1)) >= 1, "deepboot lent no idle inference GPU"
    chart = workdir / "demo-gpus.png"
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "silod up: all services stopped" in out and "silod up exited with code 0" in out
    assert "store emulator exited with code 0" in out
    assert not (workdir / "cluster.json").exists()
