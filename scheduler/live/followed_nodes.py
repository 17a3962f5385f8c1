"""The nodes as the metadata store lists them, kept from one listing to the next by what changed
since (ListNodesRequest.changed_after): registrations, specs and GPU faults in full, and the names
of the nodes not alive. Heartbeats alone change nothing here, so a steady round at 5,000 nodes
reads a short answer instead of every node's message (about 40 ms a listing, twice a second: the
rounds' and the node watch's).

Each reader keeps its own (the rounds and the node watch list at their own times).

A whole listing every ``WHOLE_EVERY_S`` bounds what a cursor could miss if the database under the
metadata service were replaced by another that has counted as far (a store whose count is behind
the cursor answers whole by itself)."""

from __future__ import annotations

import time
from collections.abc import Callable

from silod.v1 import common_pb2, metadata_pb2

WHOLE_EVERY_S = 60.0


class FollowedNodes:
    def __init__(self, *, whole_every_s: float = WHOLE_EVERY_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._nodes: dict[str, common_pb2.Node] = {}  # every node listed, alive or not: copies
        self._cursor = 0  # of the last answer; 0: none yet, the next listing is whole
        self._not_alive: frozenset[str] = frozenset()
        self._whole_every_s = whole_every_s
        self._clock = clock
        self._whole_at = -float("inf")  # when the last whole listing was asked for
        self.alive: list[common_pb2.Node] = []  # the live nodes, by name

    def request(self, window_s: float) -> metadata_pb2.ListNodesRequest:
        """The next listing's request: the changes since the last answer, or the whole listing
        (the first, and every ``whole_every_s``)."""
        now = self._clock()
        if now - self._whole_at >= self._whole_every_s:
            self._whole_at = now
            return metadata_pb2.ListNodesRequest(liveness_window_s=window_s)
        return metadata_pb2.ListNodesRequest(changed_after=self._cursor, liveness_window_s=window_s)

    def take(self, request: metadata_pb2.ListNodesRequest, answer: metadata_pb2.ListNodesResponse) -> bool:
        """Take the answer to ``request``; whether the live nodes differ from the last answer's
        (a node came, went, or changed its spec or faults). :attr:`alive` is a new list if so,
        else the same one."""
        # A whole answer, however it says so: a store from before changed_after answers every
        # node, with neither whole nor a cursor set.
        whole = answer.whole or not request.changed_after
        if whole:
            self._nodes = {}
        for node in answer.nodes:
            # Copies: a part of an answer keeps the whole answer alive (upb messages share their arena).
            copy = common_pb2.Node()
            copy.CopyFrom(node)
            self._nodes[node.spec.name] = copy
        not_alive = (frozenset(answer.not_alive) if request.changed_after
                     else frozenset(node.spec.name for node in answer.nodes if not node.alive))
        self._cursor = answer.cursor
        if not whole and not answer.nodes and not_alive == self._not_alive:
            return False
        for name in not_alive ^ self._not_alive:  # liveness flipped by heartbeats alone
            if (node := self._nodes.get(name)) is not None:
                node.alive = name not in not_alive
        self._not_alive = not_alive
        alive = [self._nodes[name] for name in sorted(self._nodes) if name not in not_alive]
        changed = whole or bool(answer.nodes) or [n.spec.name for n in alive] != [n.spec.name for n in self.alive]
        self.alive = alive
        return changed
