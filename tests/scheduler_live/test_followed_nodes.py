"""FollowedNodes (scheduler.live.followed_nodes) against a real metadata service: the live nodes it
keeps by changes are those a whole alive-only listing answers, it says when nothing changed (and
keeps the same list), and it takes a store's whole answers as they come from one that predates
changed_after."""

from __future__ import annotations

import random
from datetime import timedelta
from pathlib import Path

import grpc
from sqlalchemy import update

from scheduler.live.followed_nodes import FollowedNodes
from services.metadata.clock import utc_now
from services.metadata.models import Node
from services.metadata.service import Settings
from services.metadata.store import MetadataStore
from silod.v1 import common_pb2, metadata_pb2
from tests.metadata.metadata_harness import InProcessServer
from tests.metadata.metadata_samples import node_spec

WINDOW_S = 600.0  # far beyond the test's run, however slow the machine: only aged nodes are dead


def _view(nodes: list[common_pb2.Node]) -> list[tuple[common_pb2.NodeSpec, list[int], bool]]:
    return [(n.spec, [f.index for f in n.gpu_faults], n.alive) for n in nodes]


def test_followed_nodes_are_the_alive_listing_and_quiet_polls_change_nothing(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'md.db'}"
    rng = random.Random(7)
    with InProcessServer(Settings(db=url, log_level="warning")) as server:
        stub = server.stub
        store = MetadataStore.open(url)  # to age heartbeats without waiting for them to age
        try:
            followed = FollowedNodes()

            def poll() -> bool:
                request = followed.request(WINDOW_S)
                return followed.take(request, stub.ListNodes(request))

            def whole_alive() -> list[common_pb2.Node]:
                return list(stub.ListNodes(metadata_pb2.ListNodesRequest(alive_only=True, liveness_window_s=WINDOW_S)).nodes)

            for name in ("a", "b", "c"):
                stub.UpsertNode(metadata_pb2.UpsertNodeRequest(spec=node_spec(name)))
            assert poll() and _view(followed.alive) == _view(whole_alive())
            quiet = followed.alive
            stub.Heartbeat(metadata_pb2.HeartbeatRequest(node="a", applied_plan_version=1))
            assert not poll() and followed.alive is quiet

            versions = {"a": 1}
            names = [f"n{i}" for i in range(8)] + ["a", "b", "c"]
            for step in range(120):
                name = rng.choice(names)
                action = rng.random()
                if action < 0.25:
                    stub.UpsertNode(metadata_pb2.UpsertNodeRequest(spec=node_spec(name, gpus=rng.choice((2, 4)))))
                elif action < 0.5:
                    versions[name] = versions.get(name, 0) + 1
                    try:
                        stub.Heartbeat(metadata_pb2.HeartbeatRequest(node=name, applied_plan_version=versions[name]))
                    except grpc.RpcError:  # a node not registered yet: NOT_FOUND, as meant
                        pass
                elif action < 0.65:
                    versions[name] = versions.get(name, 0) + 1
                    try:
                        stub.Heartbeat(metadata_pb2.HeartbeatRequest(
                            node=name, applied_plan_version=versions[name],
                            gpu_faults=[common_pb2.GpuFault(index=rng.randrange(2), reason="Xid 79")]))
                    except grpc.RpcError:  # as above
                        pass
                elif action < 0.85:
                    with store.db.write() as session:  # silent for twice the window
                        session.execute(update(Node).where(Node.name == name)
                                        .values(last_heartbeat=utc_now() - timedelta(seconds=2 * WINDOW_S)))
                before = followed.alive
                changed = poll()
                expected = whole_alive()
                assert _view(followed.alive) == _view(expected), f"step {step}"
                if not changed:
                    assert followed.alive is before
        finally:
            store.close()


def test_a_whole_answer_from_a_store_before_changed_after_replaces_everything() -> None:
    followed = FollowedNodes()
    alive, dead = (common_pb2.Node(spec=node_spec(n), alive=a) for n, a in (("x", True), ("y", False)))
    request = followed.request(WINDOW_S)
    assert request.changed_after == 0
    assert followed.take(request, metadata_pb2.ListNodesResponse(nodes=[alive, dead]))  # no cursor, no whole
    assert [n.spec.name for n in followed.alive] == ["x"]
    assert followed.request(WINDOW_S).changed_after == 0  # such a store gives no cursor: whole again
    gone = followed.take(followed.request(WINDOW_S), metadata_pb2.ListNodesResponse(nodes=[dead]))
    assert gone and followed.alive == []


def test_a_whole_listing_is_asked_for_every_interval() -> None:
    now = [0.0]
    followed = FollowedNodes(whole_every_s=60.0, clock=lambda: now[0])
    first = followed.request(WINDOW_S)
    assert first.changed_after == 0
    answer = metadata_pb2.ListNodesResponse(nodes=[common_pb2.Node(spec=node_spec("x"), alive=True)], cursor=7, whole=True)
    assert followed.take(first, answer)
    now[0] = 59.0
    assert followed.request(WINDOW_S).changed_after == 7
    now[0] = 60.0
    again = followed.request(WINDOW_S)
    assert again.changed_after == 0
    # a whole answer replaces what was kept: a node the store no longer has is gone
    assert followed.take(again, metadata_pb2.ListNodesResponse(
        nodes=[common_pb2.Node(spec=node_spec("y"), alive=True)], cursor=3, whole=True))
    assert [n.spec.name for n in followed.alive] == ["y"] and followed.request(WINDOW_S).changed_after == 3
