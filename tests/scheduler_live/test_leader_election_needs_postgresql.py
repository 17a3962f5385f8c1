"""`silod scheduler --leader-election` against a metadata store on SQLite: the store refuses the
election (one metadata service on one file buys no standby), and the scheduler exits 2 with a
configuration error saying so, instead of standing by forever."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support.procs import start_service


def test_the_scheduler_refuses_leader_election_on_sqlite(tmp_path: Path) -> None:
    metadata = start_service("metadata", "--db", f"sqlite:///{tmp_path / 'md.db'}", "--log-level", "warning",
                             workdir=tmp_path / "metadata")
    try:
        done = subprocess.run(
            [sys.executable, "-m", "silod.cli", "scheduler", "--listen", "127.0.0.1:0", "--metadata-address",
             metadata.address, "--leader-election", "--log-level", "warning"],
            capture_output=True, text=True, timeout=60, cwd=tmp_path)
    finally:
        metadata.close()
    assert done.returncode == 2, done.stdout + done.stderr
    assert "configuration error: leader_election:" in done.stderr
    assert "needs the metadata store on PostgreSQL" in done.stderr, done.stderr


def test_silod_admin_leader_says_when_none_leads(tmp_path: Path) -> None:
    """`silod admin leader` on a store no elected scheduler ever used: exit 1, said in words.
    (tests/lab/test_lab_ha.py reads the leader with it on PostgreSQL, across failovers.)"""
    metadata = start_service("metadata", "--db", f"sqlite:///{tmp_path / 'md.db'}", "--log-level", "warning",
                             workdir=tmp_path / "metadata")
    try:
        shown = subprocess.run([sys.executable, "-m", "silod.cli", "admin", "leader", "--metadata", metadata.address],
                               capture_output=True, text=True, timeout=60, cwd=tmp_path)
        as_json = subprocess.run([sys.executable, "-m", "silod.cli", "admin", "leader", "--json",
                                  "--metadata", metadata.address], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    finally:
        metadata.close()
    assert shown.returncode == 1, shown.stdout + shown.stderr
    assert "no scheduler has led with --leader-election" in shown.stdout
    assert as_json.returncode == 1 and '"held": false' in as_json.stdout and '"epoch": 0' in as_json.stdout
