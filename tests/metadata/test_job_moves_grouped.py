"""JobStore.transition_many moves jobs alike together (one UPDATE per kind of move, one INSERT of
their events) and keeps the answers of one move at a time: per-move refusals, a job's moves in
order, credentials revoked at a final state, and nothing half done when the database refuses the
batch. On SQLite and PostgreSQL."""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading

import pytest
from sqlalchemy import event, text

from services.metadata.store import MetadataStore
from services.metadata.store import jobs as job_store
from services.runtime.errors import FailedPrecondition, NotFound, ServiceError
from silod.v1 import access_pb2, common_pb2, plan_pb2

PENDING, SCHEDULED, RUNNING = common_pb2.JOB_STATE_PENDING, common_pb2.JOB_STATE_SCHEDULED, common_pb2.JOB_STATE_RUNNING
CANCELLED, SUCCEEDED = common_pb2.JOB_STATE_CANCELLED, common_pb2.JOB_STATE_SUCCEEDED


def _jobs(store: MetadataStore, count: int) -> list[str]:
    spec = common_pb2.JobSpec(name="grouped", min_gpus=1, max_gpus=1, batch_size=64, epochs=1)
    return [job.id for job in store.jobs.create_many([(spec, "")] * count)]


@pytest.mark.parametrize("count", [1, 3], ids=["one-by-one", "grouped"])
def test_state_only_moves_answer_the_state_and_times_without_spec_or_progress(store: MetadataStore, count: int) -> None:
    ids = _jobs(store, count)
    store.jobs.update_progress(ids[0], common_pb2.JobProgress(samples_done=7))
    whole = store.jobs.transition_many([(i, PENDING, SCHEDULED, "placed") for i in ids])
    brief = store.jobs.transition_many([(i, SCHEDULED, RUNNING, "started") for i in ids], state_only=True)
    for before, job in zip(whole, brief):
        assert (job.id, job.state, job.state_version, job.message) == (before.id, RUNNING, 3, "started")
        assert job.created_at == before.created_at and job.updated_at.seconds > 0 and job.started_at.seconds > 0
        assert not job.HasField("spec") and not job.HasField("progress") and not job.HasField("allocated")
    got = store.jobs.get(ids[0])  # the store still holds them whole
    assert got.state == RUNNING and got.spec.name == "grouped" and got.progress.samples_done == 7


def test_many_alike_moves_happen_each_with_its_event_across_the_chunks(store: MetadataStore,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    ids = _jobs(store, job_store._GROUP_MOVES + 101)  # two UPDATEs for one kind of move
    results = store.jobs.transition_many([(i, PENDING, SCHEDULED, f"placed (generation {n % 2 + 1})")
                                          for n, i in enumerate(ids)])
    assert [r.id for r in results] == ids and all(r.state == SCHEDULED for r in results)
    assert all(r.message == f"placed (generation {n % 2 + 1})" for n, r in enumerate(results))
    assert all(r.state_version == 2 for r in results)
    for job_id in (ids[0], ids[-1]):
        created, moved = store.jobs.list_events(job_id)
        assert (moved.type, moved.sequence, moved.from_state, moved.to_state) == ("state", created.sequence + 1,
                                                                                 PENDING, SCHEDULED)
    running = store.jobs.transition_many([(i, SCHEDULED, RUNNING, "") for i in ids[:3]])
    assert all(r.started_at.seconds > 0 for r in running)  # what a move to RUNNING sets
    assert "moving each on its own" not in caplog.text  # done grouped, not by the fallback


def test_refusals_are_per_move_and_a_job_twice_moves_in_order(store: MetadataStore) -> None:
    a, b, c = _jobs(store, 3)
    results = store.jobs.transition_many([
        (a, PENDING, SCHEDULED, "placed"),
        (b, RUNNING, SUCCEEDED, ""),                 # b is PENDING: refused by the compare-and-set
        ("job-000000000000", PENDING, SCHEDULED, ""),  # no such job
        (c, PENDING, SUCCEEDED, ""),                 # not an edge of the state machine
    ])
    assert results[0].state == SCHEDULED
    assert isinstance(results[1], FailedPrecondition) and results[1].field == "expected_state"
    assert isinstance(results[2], NotFound)
    assert isinstance(results[3], ServiceError) and not isinstance(results[3], NotFound)
    assert store.jobs.get(b).state == PENDING and store.jobs.get(c).state == PENDING
    # The same job twice: the second move sees the first.
    twice = store.jobs.transition_many([(b, PENDING, SCHEDULED, "placed"), (b, SCHEDULED, RUNNING, "started")])
    assert [r.state for r in twice] == [SCHEDULED, RUNNING]


def test_a_final_move_in_a_batch_revokes_the_jobs_credentials(store: MetadataStore) -> None:
    a, b = _jobs(store, 2)
    store.jobs.transition_many([(a, PENDING, SCHEDULED, ""), (b, PENDING, SCHEDULED, "")])
    plan = plan_pb2.AllocationPlan(version=1)
    for job_id in (a, b):
        plan.jobs.add(job_id=job_id).placements.add(node="n1", gpu_indices=[0])
    for job_id in (a, b):
        store.access.mint_job_credential(job_id, "n1", lambda: plan)
    store.jobs.transition_many([(a, SCHEDULED, CANCELLED, "bye"), (b, SCHEDULED, CANCELLED, "bye")])
    listed = store.access.list_credentials(kind=access_pb2.PRINCIPAL_KIND_JOB, include_revoked=True)
    assert len(listed) == 2 and all(c.HasField("revoked_at") for c in listed)


def test_a_batch_the_database_refuses_is_moved_one_by_one_with_nothing_half_done(
        store: MetadataStore, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    ids = _jobs(store, 4)
    monkeypatch.setattr(job_store, "_group_move_statement", lambda new_state, state_only=False: text("SELECT no_such_column"))
    results = store.jobs.transition_many([(i, PENDING, SCHEDULED, "placed") for i in ids])
    assert [r.state for r in results] == [SCHEDULED] * 4
    assert [len(store.jobs.list_events(i)) for i in ids] == [2] * 4  # one move each, not two
    assert "moving each on its own" in caplog.text


def test_two_batches_whose_kinds_of_move_cross_do_not_deadlock(store: MetadataStore,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """Two batches at once, as the scheduler's concurrent commit batches and its report-driven moves
    are: each moves jobs a and b, but in kinds of move that come in the opposite order, so one UPDATE
    per kind would lock a then b in one transaction and b then a in the other. Each waits, after its
    first UPDATE, for the other to have done its first (or 2 s): with the rows locked in job id order
    up front, the second batch waits for the first instead of deadlocking (PostgreSQL broke such a
    deadlock after a second and the batch fell back to moving each job in a transaction of its own)."""
    a, b = sorted(_jobs(store, 2))
    both_did_one = threading.Barrier(2, timeout=2.0)
    updates: dict[int, int] = {}

    def hold_after_the_first_update(conn, cursor, statement, parameters, context, executemany):  # type: ignore[no-untyped-def]
        if statement.lstrip().upper().startswith("UPDATE JOBS"):
            me = threading.get_ident()
            updates[me] = updates.get(me, 0) + 1
            if updates[me] == 2:
                with contextlib.suppress(threading.BrokenBarrierError):
                    both_did_one.wait()

    event.listen(store.db.engine, "before_cursor_execute", hold_after_the_first_update)
    try:
        batches = [[(a, PENDING, SCHEDULED, "first kind"), (b, PENDING, SCHEDULED, "second kind")],
                   [(b, PENDING, SCHEDULED, "first kind"), (a, PENDING, SCHEDULED, "second kind")]]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            results = list(pool.map(store.jobs.transition_many, batches))
    finally:
        event.remove(store.db.engine, "before_cursor_execute", hold_after_the_first_update)
    assert "moving each on its own" not in caplog.text  # no database error, no fallback
    moved = [r for batch in results for r in batch if not isinstance(r, ServiceError)]
    assert sorted(r.id for r in moved) == [a, b]  # each job moved once, by one of the batches
    assert all(isinstance(r, FailedPrecondition) for batch in results for r in batch if r not in moved)
    assert [len(store.jobs.list_events(i)) for i in (a, b)] == [2, 2]


def test_a_batch_of_progress_writes_stores_each_shape_across_chunks_and_names_the_missing(store: MetadataStore) -> None:
    """UpdateJobsProgress's batch (JobStore.update_progress_many): on PostgreSQL one UPDATE per
    shape (progress, allocated, both) and 500 jobs; each job's own values, a missing job refused."""
    ids = _jobs(store, job_store._GROUP_MOVES + 20)
    updates = []
    for n, job_id in enumerate(ids):
        progress = common_pb2.JobProgress(samples_done=n + 1, steps_done=n) if n % 3 != 1 else None
        allocated = common_pb2.ResourceVector(gpus=n % 4 + 1) if n % 3 != 0 else None
        updates.append((job_id, progress, allocated))
    updates.insert(7, ("job-000000000000", common_pb2.JobProgress(samples_done=1), None))
    results = store.jobs.update_progress_many(updates)
    assert [type(r) for r in results].count(NotFound) == 1 and isinstance(results[7], NotFound)
    assert all(r is None for i, r in enumerate(results) if i != 7)
    for n in (0, 1, 2, len(ids) - 1):
        job = store.jobs.get(ids[n])
        assert job.progress.samples_done == (n + 1 if n % 3 != 1 else 0)
        assert job.allocated.gpus == (n % 4 + 1 if n % 3 != 0 else 0)
