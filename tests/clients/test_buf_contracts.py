"""The contracts in protos/ pass `buf lint` and break nothing of the released contract.

protos/released/silod-v1.binpb is the contract of the last release (built with `make
proto-release`); `buf breaking` compares the working protos with it by the FILE rules: no
field, message, enum value, service or method of it may be removed, renumbered, retyped or
renamed. Adding is fine."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from tests.clients.node_tools import BUF, ROOT, node_client_ready

PROTOS = ROOT / "protos"


def _buf(*args: str, cwd: Path = PROTOS) -> subprocess.CompletedProcess[str]:
    node_client_ready()
    return subprocess.run([str(BUF), *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_protos_pass_buf_lint() -> None:
    done = _buf("lint")
    assert done.returncode == 0, done.stdout + done.stderr


def test_protos_keep_the_released_contract() -> None:
    done = _buf("breaking", "--against", "released/silod-v1.binpb")
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_breaking_change_is_caught(tmp_path: Path) -> None:
    """The check can fail: renumbering a field of a copy of the protos is reported."""
    copy = tmp_path / "protos"
    shutil.copytree(PROTOS, copy, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    common = copy / "silod" / "v1" / "common.proto"
    text = common.read_text()
    assert "  int64 samples_done = 1;" in text
    common.write_text(text.replace("  int64 samples_done = 1;", "  int64 samples_done = 99;"))
    done = _buf("breaking", "--against", str(PROTOS / "released" / "silod-v1.binpb"), cwd=copy)
    assert done.returncode != 0
    assert "samples_done" in done.stdout + done.stderr
