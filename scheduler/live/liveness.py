"""Which nodes are alive: the heartbeat window the scheduler asks the metadata store with, the
watch that triggers a round when the set of live nodes (or of faulted GPUs) changes, and what
the live training nodes offer a rank (cores and memory), for JobService's check of a
submission's per-rank requests.

Partitions of the control plane: heartbeats that could not reach the control plane while it
was cut off are not the nodes' fault: after such a blind span, a node keeps counting as alive
for the span's length on top of the node timeout, so no job is requeued on heartbeats that are
merely stale (their agents resume heartbeating within one interval of the link coming back).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable

import grpc

from scheduler.live.clients import Clients
from scheduler.live.followed_nodes import FollowedNodes
from scheduler.live.gpu_health import faulted_gpus
from silod.v1 import common_pb2, metadata_pb2

_log = logging.getLogger("silod.scheduler")


class NodeLiveness:
    def __init__(self, clients: Clients, *, node_timeout_s: float, node_poll_s: float,
                 trigger: Callable[[str], None]) -> None:
        self.clients = clients
        self.node_timeout_s = node_timeout_s
        self.node_poll_s = node_poll_s
        self._trigger = trigger
        self._metadata_seen_at: float | None = None   # last ListNodes answered (monotonic)
        self._blind: tuple[float, float] | None = None   # latest span we could not see the metadata
        self._known_nodes: frozenset[str] | None = None
        # Faulted GPUs as the node watch last saw them. Starts empty, not unknown: a fault reported
        # between the scheduler's start and its first poll must still start a round, or its job
        # stays on the faulted GPU until the next periodic round.
        self._known_faults: dict[str, frozenset[int]] = {}
        self.node_set_version = 0  # bumped whenever the set of live nodes changes
        # (cores, bytes) ranks may request on each live training node with GPUs, as last listed
        # (each distinct pair once); None until a listing came back.
        self.rank_room: frozenset[tuple[float, int]] | None = None

    def saw_nodes(self, nodes: Iterable[common_pb2.Node]) -> None:
        """Remember what the live nodes of a listing offer ranks (the watch's and the rounds')."""
        self.rank_room = frozenset((n.spec.cpus, n.spec.memory_bytes) for n in nodes
                                   if n.spec.gpus > 0 and n.spec.pool != common_pb2.NODE_POOL_INFERENCE)

    async def read_rank_room(self) -> frozenset[tuple[float, int]]:
        """:attr:`rank_room` from a fresh listing of the live nodes."""
        nodes = await self.clients.md.ListNodes(
            metadata_pb2.ListNodesRequest(alive_only=True, liveness_window_s=self.window_s()))
        self.saw_nodes(nodes.nodes)
        return self.rank_room or frozenset()

    def _unseen_for_s(self, now: float) -> float:
        """How long the metadata has not answered, if that is longer than the node poll's own
        rhythm allows (0 otherwise): a span in which the nodes' heartbeats may not have landed."""
        if self._metadata_seen_at is None:
            return 0.0
        gap = now - self._metadata_seen_at
        return gap if gap > max(self.node_timeout_s / 3, 2 * self.node_poll_s) else 0.0

    def metadata_seen(self) -> None:
        now = time.monotonic()
        if unseen := self._unseen_for_s(now):
            self._blind = (now - unseen, now)
            _log.warning("metadata unreachable for %.1fs: node liveness extended by as much", unseen)
        self._metadata_seen_at = now

    def window_s(self) -> float:
        """The heartbeat age under which a node counts as alive, for a request sent now."""
        now = time.monotonic()
        if unseen := self._unseen_for_s(now):
            # This request may be the first to get through after a blind span: metadata_seen
            # records the span only once it returns, too late for the answer to this one
            # (seen in the lab: the first round after a 30 s partition found every node dead
            # and requeued their jobs).
            return self.node_timeout_s + unseen
        if self._blind is not None:
            lost, back = self._blind
            # As long again after it: connections that backed off during the cut (TCP
            # retransmission timers double) can take that long to carry a heartbeat again.
            if now - back < self.node_timeout_s + (back - lost):
                return self.node_timeout_s + (back - lost)
        return self.node_timeout_s

    async def watch(self) -> None:
        """Trigger a round when the set of live nodes changes (arrival, or loss by heartbeat timeout)."""
        listed = FollowedNodes()  # its own: it lists at its own times, beside the rounds
        while True:
            await asyncio.sleep(self.node_poll_s)
            request = listed.request(self.window_s())
            try:
                answer = await self.clients.md.ListNodes(request)
            except grpc.aio.AioRpcError:
                continue
            self.metadata_seen()
            if not listed.take(request, answer):
                continue  # no node came, went or changed since the last poll
            nodes = listed.alive
            self.saw_nodes(nodes)
            names = frozenset(n.spec.name for n in nodes)
            if self._known_nodes is not None and names != self._known_nodes:
                self.node_set_version += 1
                self._trigger("node-lost" if self._known_nodes - names else "node-joined")
            self._known_nodes = names
            faults = faulted_gpus(nodes)
            if faults != self._known_faults:
                self._trigger("gpu-health")  # a GPU faulted (its job moves now) or was cleared
            self._known_faults = faults
