"""NodeStore on SQLite and PostgreSQL: plain heartbeats (prebuilt Core statements), heartbeats
carrying GPU figures or faults (the locking path) in any order with them, refusals, and that the
messages the store hands out are the caller's own (the store remembers what it built per node)."""

from __future__ import annotations

import threading
import time

import pytest

from services.metadata.store import MetadataStore
from services.metadata.store import nodes as node_store
from services.runtime.errors import FailedPrecondition, InvalidArgument, NotFound
from silod.v1 import common_pb2
from tests.metadata.metadata_samples import node_spec


def xid(index: int, reason: str = "Xid 79") -> common_pb2.GpuFault:
    fault = common_pb2.GpuFault(index=index, reason=reason)
    fault.since.FromSeconds(1_800_000_000)
    return fault


def test_a_plain_heartbeat_answers_the_stored_node_and_refusals_are_as_before(store: MetadataStore) -> None:
    registered = store.nodes.upsert(node_spec("n1"))
    beat = store.nodes.heartbeat("n1", 5)
    assert beat.applied_plan_version == 5 and beat.alive and beat.spec == registered.spec
    assert beat.registered_at == registered.registered_at
    assert beat.last_heartbeat.ToNanoseconds() >= registered.last_heartbeat.ToNanoseconds()
    assert beat == store.nodes.get("n1") == store.nodes.list()[0]
    assert store.nodes.heartbeat("n1", 5).applied_plan_version == 5  # the same version again is fine
    time.sleep(0.01)
    with pytest.raises(FailedPrecondition) as refused:
        store.nodes.heartbeat("n1", 4)
    assert refused.value.field == "applied_plan_version"
    assert "already applied plan 5, got 4" in refused.value.message
    after = store.nodes.get("n1")  # refused, yet proof of life
    assert after.applied_plan_version == 5
    assert after.last_heartbeat.ToNanoseconds() > beat.last_heartbeat.ToNanoseconds()
    assert store.nodes.list()[0] == after
    for figures in ((), [common_pb2.GpuTelemetry(index=0)]):
        with pytest.raises(NotFound) as missing:
            store.nodes.heartbeat("nope", 1, gpu_telemetry=figures)
        assert missing.value.field == "node"
    with pytest.raises(NotFound):
        store.nodes.get("nope")
    assert [n.spec.name for n in store.nodes.list()] == ["n1"]


def test_faults_after_plain_heartbeats_show_everywhere_and_plain_heartbeats_keep_them(store: MetadataStore) -> None:
    store.nodes.upsert(node_spec("g1", gpus=4))
    for version in (1, 2):
        assert not store.nodes.heartbeat("g1", version).gpu_faults
    assert not store.nodes.get("g1").gpu_faults and not store.nodes.list()[0].gpu_faults
    node = store.nodes.heartbeat("g1", 2, gpu_telemetry=[common_pb2.GpuTelemetry(index=0, utilization_ratio=0.5)],
                                 gpu_faults=[xid(2)])
    assert [(f.index, f.reason) for f in node.gpu_faults] == [(2, "Xid 79")]
    assert [t.utilization_ratio for t in node.gpu_telemetry] == [0.5]
    for seen in (store.nodes.get("g1"), store.nodes.list()[0], store.nodes.heartbeat("g1", 3),
                 store.nodes.list(alive_only=True)[0]):
        assert seen.gpu_faults == node.gpu_faults and seen.gpu_telemetry == node.gpu_telemetry
    # Refused (a restarted agent), yet its faults are recorded.
    with pytest.raises(FailedPrecondition):
        store.nodes.heartbeat("g1", 0, gpu_faults=[xid(1, "Xid 48")])
    assert [f.index for f in store.nodes.get("g1").gpu_faults] == [1, 2]
    assert store.nodes.heartbeat("g1", 3).applied_plan_version == 3
    assert [f.index for f in store.nodes.list()[0].gpu_faults] == [1, 2]
    assert [f.index for f in store.nodes.clear_gpu_fault("g1", 2).gpu_faults] == [1]
    for seen in (store.nodes.get("g1"), store.nodes.list()[0], store.nodes.heartbeat("g1", 4)):
        assert [f.index for f in seen.gpu_faults] == [1] and len(seen.gpu_telemetry) == 1


def test_a_changed_spec_is_seen_at_once(store: MetadataStore) -> None:
    store.nodes.upsert(node_spec("n1", gpus=4))
    store.nodes.heartbeat("n1", 1)
    assert store.nodes.list()[0].spec.gpus == 4
    store.nodes.upsert(node_spec("n1", gpus=8, labels={"rack": "r2"}))
    for seen in (store.nodes.list()[0], store.nodes.get("n1"), store.nodes.heartbeat("n1", 1)):
        assert seen.spec.gpus == 8 and dict(seen.spec.labels) == {"rack": "r2"}


def test_callers_get_messages_of_their_own(store: MetadataStore) -> None:
    store.nodes.upsert(node_spec("n1", gpus=2))
    store.nodes.heartbeat("n1", 1, gpu_telemetry=[common_pb2.GpuTelemetry(index=0, utilization_ratio=0.5)],
                          gpu_faults=[xid(1)])
    expected = store.nodes.get("n1")
    for _ in range(2):  # the second time round, everything comes from what the store remembers
        for got in (store.nodes.heartbeat("n1", 1), store.nodes.get("n1"), store.nodes.list()[0]):
            assert got == expected or got.last_heartbeat != expected.last_heartbeat
            got.spec.gpus = 99
            got.spec.labels["mutated"] = "yes"
            got.gpu_telemetry[0].utilization_ratio = 0.9
            got.gpu_faults[0].reason = "mutated"
            got.last_heartbeat.seconds = 1
            got.alive = False
        for fresh in (store.nodes.get("n1"), store.nodes.list()[0]):
            assert fresh.spec == expected.spec and fresh.alive
            assert fresh.gpu_telemetry == expected.gpu_telemetry and fresh.gpu_faults == expected.gpu_faults
            assert fresh.last_heartbeat.seconds > 1


def test_liveness_is_of_the_time_of_each_read(store: MetadataStore) -> None:
    store.nodes.upsert(node_spec("quiet"))
    assert store.nodes.list(liveness_window_s=0.2)[0].alive
    time.sleep(0.3)
    assert not store.nodes.list(liveness_window_s=0.2)[0].alive
    assert store.nodes.list(alive_only=True, liveness_window_s=0.2) == []
    assert store.nodes.list(liveness_window_s=60)[0].alive
    assert store.nodes.heartbeat("quiet", 0).alive
    assert store.nodes.list(liveness_window_s=0.2)[0].alive


def test_heartbeats_in_a_batch_answer_as_one_at_a_time_each_with_its_own_refusal(store: MetadataStore) -> None:
    for name in ("b1", "b2", "b3"):
        store.nodes.upsert(node_spec(name))
    store.nodes.heartbeat("b2", 7)
    before = store.nodes.get("b2")
    time.sleep(0.01)
    beats = [("b1", 3), ("b2", 6), ("nope", 1), ("", 1), ("b3", -1), ("b3", 2), ("b1", 4)]
    results = store.nodes.heartbeat_many(beats)
    assert results[0].applied_plan_version == 3 and results[6].applied_plan_version == 4  # one node twice, in order
    assert isinstance(results[1], FailedPrecondition) and "already applied plan 7, got 6" in results[1].message
    assert isinstance(results[2], NotFound) and results[2].field == "node"
    assert isinstance(results[3], InvalidArgument) and results[3].field == "node"
    assert isinstance(results[4], InvalidArgument) and results[4].field == "applied_plan_version"
    assert results[5] == store.nodes.get("b3") and results[5].applied_plan_version == 2
    after = store.nodes.get("b2")  # refused, yet proof of life, as a lone heartbeat
    assert after.applied_plan_version == 7 and after.last_heartbeat.ToNanoseconds() > before.last_heartbeat.ToNanoseconds()
    assert store.nodes.get("b1").applied_plan_version == 4


# SQLite stores each heartbeat of a batch with a statement of its own (no round trip to save).
@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_a_heartbeat_batch_on_postgresql_is_one_update_whatever_its_size(store: MetadataStore) -> None:
    from sqlalchemy import event

    assert store.db.dialect == "postgresql" and store.nodes.grouped_heartbeats
    for i in range(60):
        store.nodes.upsert(node_spec(f"g{i:02}"))
    store.nodes.heartbeat("g07", 9)
    statements: list[str] = []

    def seen(conn: object, cursor: object, statement: str, *args: object) -> None:
        statements.append(statement)

    event.listen(store.db.engine, "before_cursor_execute", seen)
    try:
        results = store.nodes.heartbeat_many([(f"g{i:02}", 3) for i in range(60)] + [("g03", 4), ("g03", 2)])
    finally:
        event.remove(store.db.engine, "before_cursor_execute", seen)
    updates = [s for s in statements if s.lstrip().upper().startswith("UPDATE")]
    # One for the batch; then one by one: g07's refusal (the conditional update, then its proof of
    # life), g03's second beat, and its third, refused (two again).
    assert len(updates) == 1 + 2 + 1 + 2, statements
    assert [r.applied_plan_version for i, r in enumerate(results[:60]) if i != 7] == [3] * 59
    assert isinstance(results[7], FailedPrecondition) and "already applied plan 9, got 3" in results[7].message
    assert results[60].applied_plan_version == 4 and isinstance(results[61], FailedPrecondition)
    assert store.nodes.get("g03").applied_plan_version == 4 and store.nodes.get("g07").applied_plan_version == 9


def test_a_heartbeat_batch_the_database_refuses_is_stored_one_by_one(store: MetadataStore,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from sqlalchemy import text

    store.nodes.upsert(node_spec("c1"))
    monkeypatch.setattr(node_store, "_HEARTBEAT", text("SELECT no_such_column"))
    monkeypatch.setattr(node_store, "_GROUPED_HEARTBEAT", text("SELECT no_such_column"))  # PostgreSQL's
    real_heartbeat = store.nodes.heartbeat
    one_by_one: list[str] = []

    def heartbeat(node: str, version: int, *args: object) -> common_pb2.Node:
        one_by_one.append(node)
        monkeypatch.undo()  # the lone path runs with the real statement
        return real_heartbeat(node, version, *args)

    monkeypatch.setattr(store.nodes, "heartbeat", heartbeat)
    results = store.nodes.heartbeat_many([("c1", 5)])
    assert one_by_one == ["c1"] and results[0].applied_plan_version == 5


def test_registrations_in_a_batch_answer_as_one_at_a_time_in_one_transaction(store: MetadataStore) -> None:
    first = store.nodes.upsert(node_spec("r2", gpus=4))
    store.nodes.heartbeat("r2", 6)
    before = store.nodes.listing()
    specs = [node_spec("r3"), node_spec("r2", gpus=8), node_spec(""), node_spec("r1", labels={"rack": "r9"}),
             node_spec("r3", gpus=2)]
    results = store.nodes.upsert_many(specs)
    assert isinstance(results[2], InvalidArgument) and results[2].field == "spec.name", results[2]
    assert results[0].spec.name == "r3" and results[0].spec.gpus == 4  # a node twice: each answer its own, in order
    assert results[4].spec.gpus == 2 and store.nodes.get("r3").spec.gpus == 2
    again = results[1]  # registered again: its first registration and applied plan kept, the new spec
    assert again.spec.gpus == 8 and again.registered_at == first.registered_at and again.applied_plan_version == 6
    assert results[3] == store.nodes.get("r1") and results[3].spec.labels["rack"] == "r9"
    # Every registration is a change, as each upsert would have made it: four of them.
    changed = store.nodes.listing(changed_after=before.cursor)
    assert sorted(n.spec.name for n in changed.nodes) == ["r1", "r2", "r3"] and changed.cursor == before.cursor + 4


def test_a_registration_batch_the_database_refuses_is_stored_one_by_one(store: MetadataStore,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from sqlalchemy import text

    real_statement, real_upsert = node_store._SET_CHANGED, store.nodes.upsert
    monkeypatch.setattr(node_store, "_SET_CHANGED", text("SELECT no_such_column"))
    one_by_one: list[str] = []

    def upsert(spec: common_pb2.NodeSpec) -> common_pb2.Node:
        one_by_one.append(spec.name)
        monkeypatch.setattr(node_store, "_SET_CHANGED", real_statement)  # the lone path runs with the real one
        return real_upsert(spec)

    monkeypatch.setattr(store.nodes, "upsert", upsert)
    results = store.nodes.upsert_many([node_spec("u2"), node_spec("u1", gpus=2)])
    assert one_by_one == ["u2", "u1"] and [r.spec.gpus for r in results] == [4, 2]
    assert store.nodes.get("u1").spec.gpus == 2


def test_registering_a_name_again_keeps_its_first_registration_and_racing_registrations_all_succeed(
        store: MetadataStore) -> None:
    first = store.nodes.upsert(node_spec("r1", gpus=4))
    store.nodes.heartbeat("r1", 5, gpu_faults=[xid(1)])
    again = store.nodes.upsert(node_spec("r1", gpus=8))
    assert again.spec.gpus == 8 and again.registered_at == first.registered_at
    assert again.applied_plan_version == 5 and [f.index for f in again.gpu_faults] == [1]  # kept
    assert again.last_heartbeat.ToNanoseconds() >= first.last_heartbeat.ToNanoseconds()

    errors: list[BaseException] = []

    def register(worker: int) -> None:
        try:
            for i in range(20):
                store.nodes.upsert(node_spec(f"race-{i}", gpus=1 + worker))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=register, args=(w,)) for w in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    raced = [n for n in store.nodes.list() if n.spec.name.startswith("race-")]
    assert len(raced) == 20 and all(1 <= n.spec.gpus <= 4 for n in raced)


def test_the_heartbeat_batch_benchmark_measures_both_ways_and_leaves_the_stores_way(
        store: MetadataStore, caplog: pytest.LogCaptureFixture) -> None:
    from benchmarks.metadata_node_writes import _heartbeat_batches

    for i in range(12):
        store.nodes.upsert(node_spec(f"n{i}"))
    way = store.nodes.grouped_heartbeats
    figures = _heartbeat_batches(store, nodes=12, batch=5, first_version=4)
    assert "batched heartbeats failed" not in caplog.text  # each way as the store can take it
    assert store.nodes.grouped_heartbeats == way == (store.db.dialect == "postgresql")
    assert figures["heartbeat_batch"] == 5
    for name in ("heartbeat_in_batch", "heartbeat_in_batch_one_by_one"):
        assert figures[f"{name}_wall_ms"] > 0 and figures[f"{name}_cpu_ms"] >= 0, figures
    rounds = 5 * (2 if way else 1)  # five times each way the store has
    assert store.nodes.get("n11").applied_plan_version == 4 + rounds - 1
