"""Several simulations at once, one process each, and their progress on a terminal.

``silod simulate compare`` runs one simulation per policy (and cache mode). Each is
independent, single-threaded and CPU-bound, so they run in parallel processes
(:func:`run_many`, ``--jobs N``, by default one per core the process may use); results come
back in the order the runs were asked for, whatever order they finish in. The processes are
forked, so they share the parent's workload, cluster and fitted profiles without copying them.

:class:`Board` shows one row per run on a terminal (stderr): jobs finished of all, the
simulated time reached, the wall time so far and an estimate of the time left (from the share
of jobs finished). When stderr is not a terminal, or with ``--quiet``, it shows nothing.
"""

from __future__ import annotations

import multiprocessing
import os
import queue as queues
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

REPORT_EVERY_S = 0.25  # a worker reports its progress at most this often


@dataclass(frozen=True)
class Run:
    """One simulation to run: ``task(observer)`` returns its result."""

    label: str
    task: Callable[[Callable[[Any], None]], Any]


def default_jobs() -> int:
    """Processes for parallel runs: the cores this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def run_many(runs: Sequence[Run], jobs: int, board: "Board | None" = None) -> list[Any]:
    """Every run's result, in the order of ``runs``; ``jobs`` processes at a time (1: in this one).

    An exception in a run is raised here once the runs already going have been stopped.
    """
    board = board or Board(False)
    for index, run in enumerate(runs):
        board.add(index, run.label)
    if jobs <= 1 or len(runs) <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        results = []
        for index, run in enumerate(runs):
            board.start(index)
            results.append(run.task(_every(REPORT_EVERY_S, lambda progress, _i=index: board.update(_i, progress))))
            board.done(index)
        return results
    context = multiprocessing.get_context("fork")
    reports = context.Queue()
    global _RUNS, _REPORTS
    _RUNS, _REPORTS = runs, reports  # inherited by the forked workers
    results: list[Any] = [None] * len(runs)
    executor = ProcessPoolExecutor(max_workers=min(jobs, len(runs)), mp_context=context)
    try:
        futures: dict[Future, int] = {executor.submit(_work, index): index for index in range(len(runs))}
        pending = set(futures)
        while pending:
            finished, pending = wait(pending, timeout=REPORT_EVERY_S, return_when=FIRST_COMPLETED)
            _drain(reports, board)
            for future in finished:
                index = futures[future]
                results[index] = future.result()  # raises a run's exception
                board.done(index)
        _drain(reports, board)
    except BaseException:
        for process in list(getattr(executor, "_processes", {}).values()):
            process.terminate()  # the pool's own workers: a long simulation does not stop by itself
        executor.shutdown(wait=False, cancel_futures=True)
        raise
    finally:
        _RUNS, _REPORTS = (), None
    executor.shutdown()
    return results


_RUNS: Sequence[Run] = ()
_REPORTS = None


def _work(index: int) -> Any:
    """In a worker: run ``_RUNS[index]``, reporting its progress now and then."""
    reports = _REPORTS
    reports.put((index, None))  # started
    return _RUNS[index].task(_every(REPORT_EVERY_S, lambda progress: reports.put((index, progress))))


def _every(seconds: float, report: Callable[[Any], None]) -> Callable[[Any], None]:
    """An observer that passes at most one progress per ``seconds`` on to ``report``."""
    last = [-seconds]

    def observe(progress) -> None:
        now = time.monotonic()
        if now - last[0] >= seconds:
            last[0] = now
            report(progress)

    return observe


def _drain(reports, board: "Board") -> None:
    while True:
        try:
            index, progress = reports.get_nowait()
        except queues.Empty:
            return
        if progress is None:
            board.start(index)
        else:
            board.update(index, progress)


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    days, rest = divmod(seconds, 86400)
    text = f"{rest // 3600}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    return f"{days}d {text}" if days else text


class Board:
    """Rows of progress on stderr while runs go (rich), or nothing (not a terminal, or quiet)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled and sys.stderr.isatty()
        self._progress = None
        self._rows: dict[int, Any] = {}
        self._started: dict[int, float] = {}

    def __enter__(self) -> "Board":
        if self.enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            self._progress = Progress(
                TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("jobs"),
                TextColumn("sim {task.fields[sim]}"), TextColumn("{task.fields[wall]} wall"),
                TextColumn("{task.fields[left]}"),
                console=Console(stderr=True), transient=True,
            )
            self._progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc)

    def add(self, index: int, label: str) -> None:
        if self._progress is not None:
            self._rows[index] = self._progress.add_task(label, total=None, sim="-", wall="-", left="waiting")

    def start(self, index: int) -> None:
        self._started[index] = time.monotonic()
        if self._progress is not None:
            self._progress.update(self._rows[index], wall="0:00:00", left="")

    def update(self, index: int, progress: Any) -> None:
        """A run's :class:`simulator.records.SimProgress`."""
        if self._progress is None:
            return
        started = self._started.setdefault(index, time.monotonic())
        elapsed = time.monotonic() - started
        share = progress.finished / progress.total if progress.total else 0.0
        left = f"~{_clock(elapsed * (1 - share) / share)} left" if share > 0 else ""
        self._progress.update(self._rows[index], total=progress.total, completed=progress.finished,
                              sim=_clock(progress.time_s), wall=_clock(elapsed), left=left)

    def done(self, index: int) -> None:
        if self._progress is not None:
            elapsed = time.monotonic() - self._started.get(index, time.monotonic())
            self._progress.update(self._rows[index], wall=_clock(elapsed), left="done")
