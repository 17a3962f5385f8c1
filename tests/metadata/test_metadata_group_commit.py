"""SQLite group commit: concurrent writes of one process share a COMMIT, each stays atomic on
its own, and none returns before its COMMIT."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import event

from services.metadata import database
from services.metadata.store import MetadataStore
from services.metadata.store.jobs import _insert_job
from silod.v1 import common_pb2
from tests.metadata.metadata_samples import training_spec


@pytest.fixture
def sqlite_store(sqlite_template: Path, tmp_path: Path):
    path = tmp_path / "metadata.db"
    shutil.copyfile(sqlite_template, path)
    store = MetadataStore.open(f"sqlite:///{path}")
    yield store, f"sqlite:///{path}"
    store.close()


def _wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.005)


def test_queued_writers_share_one_commit_and_a_failure_stays_its_own(sqlite_store, monkeypatch) -> None:
    # The first writer holds the batch open while the others queue, longer than a batch may last.
    monkeypatch.setattr(database, "GROUP_COMMIT_MAX_S", 60.0)
    store, url = sqlite_store
    group = store.db._group
    commits: list[float] = []
    event.listen(store.db.engine, "commit", lambda conn: commits.append(time.monotonic()))
    first_inside = threading.Event()
    release_first = threading.Event()
    results: dict[str, object] = {}

    def first() -> None:
        # Holds the shared transaction open until the two others are queued behind it.
        with store.db.write() as session:
            _insert_job(session, training_spec(name="first"), "first")
            first_inside.set()
            release_first.wait(10)
        results["first"] = time.monotonic()

    def failing() -> None:
        try:
            with store.db.write() as session:
                _insert_job(session, training_spec(name="failing"), "failing")
                raise RuntimeError("this operation fails after writing")
        except RuntimeError as exc:
            results["failing"] = exc

    def last() -> None:
        results["last"] = store.jobs.create(training_spec(name="last"), "last")

    threads = [threading.Thread(target=first)]
    threads[0].start()
    assert first_inside.wait(10)
    for target in (failing, last):
        threads.append(threading.Thread(target=target))
        threads[-1].start()
    _wait_until(lambda: group._queued == 2, "two writers queued behind the first")
    release_first.set()
    for t in threads:
        t.join(10)

    assert len(commits) == 1, "three operations queued together should share one COMMIT"
    assert results["first"] >= commits[0], "a writer returned before the COMMIT that holds its work"
    assert isinstance(results["failing"], RuntimeError)
    fresh = MetadataStore.open(url)  # another connection sees only what was committed
    try:
        names = sorted(j.spec.name for j in fresh.jobs.list()[0])
    finally:
        fresh.close()
    assert names == ["first", "last"]
    assert results["last"].state == common_pb2.JOB_STATE_PENDING


def test_a_lone_writer_commits_at_once(sqlite_store) -> None:
    store, _ = sqlite_store
    commits: list[int] = []
    event.listen(store.db.engine, "commit", lambda conn: commits.append(1))
    for i in range(3):
        store.jobs.create(training_spec(name=f"j{i}"), f"r{i}")
        assert len(commits) == i + 1


def test_a_batch_of_creations_and_moves_commits_once(sqlite_store) -> None:
    store, _ = sqlite_store
    commits: list[float] = []
    event.listen(store.db.engine, "commit", lambda conn: commits.append(time.monotonic()))
    created = store.jobs.create_many([(training_spec(name=f"b{i}"), f"b{i}") for i in range(20)]
                                     + [(training_spec(name=""), "refused")])
    assert len(commits) == 1
    jobs, refused = created[:-1], created[-1]
    assert all(isinstance(j, common_pb2.Job) for j in jobs) and len({j.id for j in jobs}) == 20
    stamps = [j.created_at.ToNanoseconds() for j in jobs]
    assert stamps == sorted(stamps) and len(set(stamps)) == 20  # FIFO order is the request order
    assert getattr(refused, "field", None) == "spec.name"
    # Retried: every key is found (the batch insert is refused and each is looked up), and
    # a new one among them is still created.
    retried = store.jobs.create_many([(training_spec(name=f"b{i}"), f"b{i}") for i in range(20)]
                                     + [(training_spec(name="new"), "new")])
    assert len(commits) == 2 and [j.id for j in retried[:-1]] == [j.id for j in jobs]
    assert retried[-1].spec.name == "new" and retried[-1].id not in {j.id for j in jobs}
    pending, scheduled = common_pb2.JOB_STATE_PENDING, common_pb2.JOB_STATE_SCHEDULED
    moves = [(j.id, pending, scheduled, "placed") for j in jobs] + [(jobs[0].id, pending, scheduled, "stale")]
    moved = store.jobs.transition_many(moves)
    assert len(commits) == 3
    assert all(j.state == scheduled for j in moved[:-1]) and getattr(moved[-1], "field", None) == "expected_state"
    # Durable and visible to another connection once the call returned.
    reopened = MetadataStore.open(store.db.engine.url.render_as_string(hide_password=False))
    try:
        states = {j.id: j.state for j in reopened.jobs.list(page_size=100)[0]}
        assert states == {**{j.id: scheduled for j in jobs}, retried[-1].id: pending}
    finally:
        reopened.close()


def test_each_commit_is_timed_for_the_operators(sqlite_store) -> None:
    """silod_metadata_sqlite_commit_duration_seconds: one observation per COMMIT (a slow disk
    shows there first)."""
    from prometheus_client import REGISTRY

    def commits() -> float:
        return REGISTRY.get_sample_value("silod_metadata_sqlite_commit_duration_seconds_count") or 0.0

    store, _ = sqlite_store
    before = commits()
    with store.db.write() as session:
        _insert_job(session, training_spec(name="timed"), "timed")
    assert commits() == before + 1
