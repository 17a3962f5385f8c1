"""Read the packaged profile CSVs (see SOURCE.md) through importlib.resources.

Reading through ``importlib.resources`` instead of paths relative to ``__file__`` keeps the
data usable from an installed wheel or a zip import. Parsing uses the ``csv`` module: the
files are small and a pandas dependency would buy nothing.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from importlib import resources

import numpy as np

_PACKAGE = "estimator.profiles"


def _read_rows(*parts: str) -> list[dict[str, str]]:
    resource = resources.files(_PACKAGE).joinpath(*parts)
    with resource.open("r", encoding="utf-8", newline="") as handle:
        return list(csv.DictReader(io.StringIO(handle.read())))


def application_names() -> tuple[str, ...]:
    """Applications with a packaged profile, sorted."""
    root = resources.files(_PACKAGE)
    return tuple(sorted(entry.name for entry in root.iterdir() if entry.is_dir() and entry.joinpath("placements.csv").is_file()))


@dataclass(frozen=True)
class PlacementRows:
    """``placements.csv``: one row per (placement, local_bsz) measurement."""

    placement: tuple[str, ...]  # per-node GPU counts as digits, e.g. "1444"
    local_bsz: np.ndarray  # samples per GPU
    step_time: np.ndarray  # seconds per optimizer step
    sync_time: np.ndarray  # seconds of gradient synchronisation within the step


@dataclass(frozen=True)
class ScalabilityRows:
    """``scalability.csv``: measurements of large jobs described by node and GPU counts."""

    num_nodes: np.ndarray
    num_replicas: np.ndarray  # GPUs
    local_bsz: np.ndarray  # samples per GPU
    step_time: np.ndarray  # seconds per optimizer step
    sync_time: np.ndarray  # seconds


@dataclass(frozen=True)
class ValidationTrace:
    """``validation-<bsz>.csv``: one training run at a fixed global batch size, per epoch."""

    batch_size: int  # global samples per step
    progress: np.ndarray
    iteration: np.ndarray  # optimizer steps done at the end of the epoch
    metric: np.ndarray  # validation metric
    grad_sqr: np.ndarray  # squared norm of the gradient
    grad_var: np.ndarray  # gradient variance


@dataclass(frozen=True)
class DatasetFacts:
    """One row of ``datasets.csv``: public facts about a training dataset.

    The ``applications`` column names the applications training on it (``;``-separated).
    """

    name: str
    applications: tuple[str, ...]
    train_samples: int
    total_bytes: int
    bytes_per_sample: int
    note: str


def _floats(rows: list[dict[str, str]], column: str) -> np.ndarray:
    return np.array([float(row[column]) for row in rows], dtype=np.float64)


def read_placements(app: str) -> PlacementRows:
    rows = _read_rows(app, "placements.csv")
    return PlacementRows(
        placement=tuple(row["placement"].strip() for row in rows),
        local_bsz=_floats(rows, "local_bsz"),
        step_time=_floats(rows, "step_time"),
        sync_time=_floats(rows, "sync_time"),
    )


def read_scalability(app: str) -> ScalabilityRows:
    rows = _read_rows(app, "scalability.csv")
    return ScalabilityRows(
        num_nodes=_floats(rows, "num_nodes"),
        num_replicas=_floats(rows, "num_replicas"),
        local_bsz=_floats(rows, "local_bsz"),
        step_time=_floats(rows, "step_time"),
        sync_time=_floats(rows, "sync_time"),
    )


def read_validation(app: str) -> dict[int, ValidationTrace]:
    """All ``validation-<bsz>.csv`` of an application, keyed and sorted by batch size."""
    traces = {}
    for entry in resources.files(_PACKAGE).joinpath(app).iterdir():
        name = entry.name
        if not (name.startswith("validation-") and name.endswith(".csv")):
            continue
        batch_size = int(name[len("validation-") : -len(".csv")])
        rows = _read_rows(app, name)
        traces[batch_size] = ValidationTrace(
            batch_size=batch_size,
            progress=_floats(rows, "progress"),
            iteration=_floats(rows, "iteration"),
            metric=_floats(rows, "metric"),
            grad_sqr=_floats(rows, "grad_sqr"),
            grad_var=_floats(rows, "grad_var"),
        )
    return dict(sorted(traces.items()))


@dataclass(frozen=True)
class JobOverheads:
    """``overheads.csv`` (optional): the seconds a job of the application spends around its
    steps, per world size, as a profiler measured them on a live cluster.

    ``launch_s``: from the plan placing the job to its first step (processes, imports, process
    group, first batch); ``finish_s``: from its last step to the job recorded as finished (final
    checkpoint, exit, the agent's report), during which it still holds its GPUs.
    """

    num_replicas: tuple[int, ...]  # world sizes measured, ascending
    launch_s: tuple[float, ...]
    finish_s: tuple[float, ...]

    def launch(self, replicas: int) -> float:
        return self._at(self.launch_s, replicas)

    def finish(self, replicas: int) -> float:
        return self._at(self.finish_s, replicas)

    def _at(self, values: tuple[float, ...], replicas: int) -> float:
        # Linear between measured world sizes, the nearest measured one outside them: launch
        # and exit grow with the ranks to start and join, but no profile measures far beyond.
        return float(np.interp(replicas, self.num_replicas, values))


def read_overheads(app: str) -> JobOverheads | None:
    """The application's ``overheads.csv``, or None when its profile has none (the Pollux
    artifact's applications: the simulator then charges the cluster's ``restart_cost_s``)."""
    if not resources.files(_PACKAGE).joinpath(app, "overheads.csv").is_file():
        return None
    rows = sorted(_read_rows(app, "overheads.csv"), key=lambda row: int(row["num_replicas"]))
    if not rows:
        return None
    return JobOverheads(
        num_replicas=tuple(int(row["num_replicas"]) for row in rows),
        launch_s=tuple(float(row["launch_s"]) for row in rows),
        finish_s=tuple(float(row["finish_s"]) for row in rows),
    )


def read_datasets() -> tuple[DatasetFacts, ...]:
    return tuple(
        DatasetFacts(
            name=row["dataset"],
            applications=tuple(app.strip() for app in row["applications"].split(";") if app.strip()),
            train_samples=int(row["train_samples"]),
            total_bytes=int(row["total_bytes"]),
            bytes_per_sample=int(row["bytes_per_sample"]),
            note=row["note"],
        )
        for row in _read_rows("datasets.csv")
    )


def dataset_for(app: str) -> DatasetFacts | None:
    """The dataset whose ``applications`` column lists ``app``."""
    for facts in read_datasets():
        if app in facts.applications:
            return facts
    return None
