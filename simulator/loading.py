"""``--workload``: which reader takes a file or a packaged name.

- a file: Gavel's own tab-separated ``.trace`` rows, or silod's CSV of a Gavel trace (header
  ``job_type,total_steps,...``), both read by :mod:`simulator.gavel_trace`; any other CSV is a
  Pollux-format workload (:mod:`simulator.workload`), told apart by content, not by name;
- ``gavel/<trace>``: a packaged Gavel trace;
- ``philly``: every job of the packaged Philly trace at its own arrival time
  (:func:`simulator.philly.replay_philly`); ``philly/<virtual cluster>`` the jobs of one of its
  virtual clusters (``philly/6214e9``);
- any other name: a packaged Pollux-format workload (``workload-6``, ``workloads-2.0/workload-3``).
"""

from __future__ import annotations

from pathlib import Path

from simulator.errors import SimulatorInputError
from simulator.workload import Workload, mixed_workload, packaged_csv


def load_workload(source: str | Path) -> Workload:
    """Read a workload from a file path or a packaged name (see the module docstring)."""
    path = Path(source)
    if path.is_file():
        text = read_text(path)
        from simulator import gavel_trace  # deferred: it prices jobs with the estimator

        if gavel_trace.looks_like_gavel_tsv(text) or gavel_trace.looks_like_gavel_csv(text):
            return Workload(str(source), gavel_trace.parse_gavel_trace(text, str(source)))
        return mixed_workload(str(source), text)
    if path.is_dir():
        raise SimulatorInputError(f"workload {path}: is a directory; give one CSV or .trace file")
    name = str(source).strip()
    if name == "philly" or name.startswith("philly/"):
        from simulator.philly import replay_philly

        cluster = name.partition("/")[2] or None
        return Workload(name, replay_philly(cluster=cluster))
    if str(source).startswith("gavel/"):
        from simulator.gavel_trace import load_gavel_trace

        return load_gavel_trace(str(source))
    workload = packaged_csv(str(source))
    if workload is None:
        raise SimulatorInputError(
            f"workload {source}: no such file, and not a packaged workload "
            "(e.g. workload-6, workloads/workload-6.csv, workloads-2.0/workload-3, gavel/msr-seed0-0e4a51, philly, "
            "philly/6214e9; "
            "see 'silod simulate list')"
        )
    return workload


def read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SimulatorInputError(f"workload {path}: cannot read: {exc}") from None
