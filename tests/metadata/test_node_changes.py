"""ListNodes' changes (NodeStore.listing with changed_after) on SQLite and PostgreSQL: what counts
as a change and what does not, and that a follower of the changes sees what a whole listing
shows, after random operations and while registrations commit concurrently."""

from __future__ import annotations

import random
import threading
from datetime import timedelta

import pytest
from sqlalchemy import update

from services.metadata.clock import utc_now
from services.metadata.models import Node
from services.metadata.store import MetadataStore
from services.runtime.errors import InvalidArgument
from silod.v1 import common_pb2
from tests.metadata.metadata_samples import node_spec


# The followers' liveness window: far beyond a test's run however slow the machine, so that only
# the nodes a test ages are dead.
WINDOW_S = 600.0


def xid(index: int) -> common_pb2.GpuFault:
    return common_pb2.GpuFault(index=index, reason="Xid 79")


def telemetry(index: int, utilization: float) -> common_pb2.GpuTelemetry:
    return common_pb2.GpuTelemetry(index=index, utilization_ratio=utilization)


def age(store: MetadataStore, node: str, seconds: float) -> None:
    """Make ``node``'s last heartbeat ``seconds`` old (liveness without waiting)."""
    with store.db.write() as session:
        session.execute(update(Node).where(Node.name == node).values(last_heartbeat=utc_now() - timedelta(seconds=seconds)))


def names(listing) -> list[str]:
    return [n.spec.name for n in listing.nodes]


def test_changes_are_registrations_specs_and_faults_never_heartbeats(store: MetadataStore) -> None:
    nodes = store.nodes
    empty = nodes.listing()
    assert empty.whole and empty.nodes == [] and empty.not_alive == []
    nodes.upsert(node_spec("a"))
    nodes.upsert(node_spec("b"))
    start = nodes.listing()
    assert start.whole and names(start) == ["a", "b"] and start.cursor > empty.cursor

    nodes.heartbeat("a", 3)
    nodes.heartbeat_many([("a", 4), ("b", 1)])
    nodes.heartbeat("b", 2, gpu_telemetry=[telemetry(0, 0.5)])  # figures change every beat
    quiet = nodes.listing(changed_after=start.cursor)
    assert not quiet.whole and quiet.nodes == [] and quiet.cursor == start.cursor and quiet.not_alive == []

    nodes.heartbeat("b", 3, gpu_faults=[xid(1)])
    faulted = nodes.listing(changed_after=quiet.cursor)
    assert names(faulted) == ["b"] and [f.index for f in faulted.nodes[0].gpu_faults] == [1]
    nodes.heartbeat("b", 4, gpu_faults=[xid(1)], gpu_telemetry=[telemetry(1, 0.1)])  # the same fault again
    assert nodes.listing(changed_after=faulted.cursor).nodes == []

    nodes.clear_gpu_fault("b", 1)
    cleared = nodes.listing(changed_after=faulted.cursor)
    assert names(cleared) == ["b"] and not cleared.nodes[0].gpu_faults

    nodes.upsert(node_spec("a", gpus=8))
    nodes.upsert(node_spec("c"))
    nodes.upsert(node_spec("b"))  # registering again, spec unchanged: an agent back, maybe elsewhere
    changed = nodes.listing(changed_after=cleared.cursor)
    assert names(changed) == ["a", "b", "c"] and changed.nodes[0].spec.gpus == 8
    assert changed.cursor == cleared.cursor + 3


def test_not_alive_names_every_dead_node_and_changes_carry_their_liveness(store: MetadataStore) -> None:
    nodes = store.nodes
    for name in ("a", "b", "c"):
        nodes.upsert(node_spec(name))
    start = nodes.listing()
    age(store, "b", 60)
    age(store, "c", 60)
    nodes.heartbeat("c", 1)  # back by a heartbeat alone: not a change, and alive again
    listing = nodes.listing(changed_after=start.cursor, liveness_window_s=30)
    assert listing.nodes == [] and listing.not_alive == ["b"]
    assert nodes.listing(changed_after=start.cursor, liveness_window_s=90).not_alive == []

    nodes.heartbeat("b", 1, gpu_faults=[xid(0)])
    age(store, "b", 60)  # faulted, then silent: its change is answered, marked not alive
    dead = nodes.listing(changed_after=listing.cursor, liveness_window_s=30)
    assert names(dead) == ["b"] and not dead.nodes[0].alive and dead.not_alive == ["b"]


def test_a_cursor_the_store_never_gave_gets_the_whole_listing(store: MetadataStore) -> None:
    store.nodes.upsert(node_spec("a"))
    store.nodes.upsert(node_spec("b"))
    age(store, "b", 60)
    ahead = store.nodes.listing(changed_after=store.nodes.listing().cursor + 100, liveness_window_s=30)
    assert ahead.whole and names(ahead) == ["a", "b"] and ahead.not_alive == ["b"]
    assert [n.alive for n in ahead.nodes] == [True, False]


@pytest.mark.parametrize("fields, field", [
    ({"alive_only": True}, "alive_only"),
    ({"pool": common_pb2.NODE_POOL_TRAINING}, "pool"),
    ({"gpu_type": "a100"}, "gpu_type"),
    ({}, "changed_after"),
])
def test_changes_refuse_filters_and_cursors_out_of_range(store: MetadataStore, fields, field) -> None:
    changed_after = 2**63 if field == "changed_after" else 1
    with pytest.raises(InvalidArgument) as refused:
        store.nodes.listing(changed_after=changed_after, **fields)
    assert refused.value.field == field
    assert store.nodes.listing(**fields).whole  # the filters alone are a whole listing, as before


class Follower:
    """What a scheduler keeps: every node by name, updated by changes; alive by not_alive."""

    def __init__(self, store: MetadataStore) -> None:
        self.store = store
        self.nodes: dict[str, common_pb2.Node] = {}
        self.cursor = 0
        self.dead: set[str] = set()

    def follow(self, window_s: float = WINDOW_S) -> None:
        listing = self.store.nodes.listing(changed_after=self.cursor, liveness_window_s=window_s)
        if listing.whole:
            self.nodes = {}
        for node in listing.nodes:
            self.nodes[node.spec.name] = node
        self.dead = (set(listing.not_alive) if self.cursor or listing.not_alive
                     else {n.spec.name for n in listing.nodes if not n.alive})
        self.cursor = listing.cursor

    def view(self) -> dict[str, tuple[common_pb2.NodeSpec, list[int], bool]]:
        return {name: (n.spec, [f.index for f in n.gpu_faults], name not in self.dead) for name, n in self.nodes.items()}


def whole_view(store: MetadataStore, window_s: float = WINDOW_S) -> dict[str, tuple[common_pb2.NodeSpec, list[int], bool]]:
    return {n.spec.name: (n.spec, [f.index for f in n.gpu_faults], n.alive)
            for n in store.nodes.list(liveness_window_s=window_s)}


def test_a_follower_of_changes_sees_what_whole_listings_show(store: MetadataStore) -> None:
    rng = random.Random(45)
    follower = Follower(store)
    names_ = [f"n{i}" for i in range(12)]
    versions = dict.fromkeys(names_, 0)
    for step in range(300):
        name = rng.choice(names_)
        action = rng.random()
        registered = store.nodes.listing().nodes
        known = {n.spec.name for n in registered}
        if name not in known or action < 0.1:
            store.nodes.upsert(node_spec(name, gpus=rng.choice((4, 8))))
        elif action < 0.4:
            versions[name] += 1
            store.nodes.heartbeat(name, versions[name])
        elif action < 0.55:
            versions[name] += 1
            store.nodes.heartbeat(name, versions[name], gpu_telemetry=[telemetry(0, rng.random())])
        elif action < 0.65:
            versions[name] += 1
            store.nodes.heartbeat(name, versions[name], gpu_faults=[xid(rng.randrange(4))])
        elif action < 0.75:
            faulted = [f.index for n in registered if n.spec.name == name for f in n.gpu_faults]
            if faulted:
                store.nodes.clear_gpu_fault(name, rng.choice(faulted))
        elif action < 0.9:
            age(store, name, 2 * WINDOW_S)
        if rng.random() < 0.5:
            follower.follow()
            assert follower.view() == whole_view(store), f"step {step}"
    follower.follow()
    assert follower.view() == whole_view(store)


def test_changes_committed_while_a_follower_reads_are_never_missed(store: MetadataStore) -> None:
    """Concurrent registrations against a follower polling: a change counted before the count a
    listing answers was committed before it (the count's row lock orders the commits)."""
    follower = Follower(store)
    follower.follow()
    stop = threading.Event()
    errors: list[BaseException] = []

    def register(worker: int) -> None:
        try:
            for i in range(40):
                store.nodes.upsert(node_spec(f"w{worker}-{i}", gpus=1 + i % 8))
        except BaseException as exc:  # noqa: BLE001 - reported by the test below
            errors.append(exc)

    threads = [threading.Thread(target=register, args=(w,)) for w in range(4)]
    for thread in threads:
        thread.start()
    polls = 0
    while any(t.is_alive() for t in threads) and not stop.is_set():
        follower.follow()
        polls += 1
    for thread in threads:
        thread.join()
    assert not errors, errors
    follower.follow()
    assert polls > 1
    assert follower.view() == whole_view(store) and len(follower.nodes) == 160
