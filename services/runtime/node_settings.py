"""Settings of the processes on a node that follow the scheduler's plans (worker agent, cache
server): their node identity (:class:`~services.runtime.auth.NodeIdentitySettings`) and how they
watch the leader (worker_agent/node_protocol.py, scheduler/live/watch.py)."""

from __future__ import annotations

from pydantic import Field, model_validator

from services.runtime.auth import NodeIdentitySettings
from services.runtime.settings import at_least, refuse

WATCH_TIMEOUT_PER_HEARTBEAT = 3  # watch_timeout_s must be at least this many watch heartbeats


class PlanFollowerSettings(NodeIdentitySettings):
    watch_heartbeat_s: float = Field(
        0.0, ge=0, le=60,
        description="Seconds: ask the leading scheduler for a heartbeat on the plan watch whenever it was quiet "
        "this long, so that a leader gone silent (its process frozen, its host cut off, or the link to it) is "
        "left after watch_timeout_s. 0 = none: a new leader tells the nodes itself when it is elected (the "
        "standbys hold the nodes' watches), and the HTTP/2 keepalive closes a dead connection within 15 s. "
        "Each heartbeat costs the scheduler a streamed message")
    watch_timeout_s: float = Field(
        0.0, ge=0, le=600,
        description="Seconds without a heartbeat after which the plan watch is opened again; at least 3x "
        "watch_heartbeat_s, which it needs. 0 = never")

    @model_validator(mode="after")
    def _watch_timeout_above_heartbeats(self) -> PlanFollowerSettings:
        if self.watch_timeout_s > 0:
            if self.watch_heartbeat_s <= 0:
                raise ValueError(f"watch_timeout_s ({self.watch_timeout_s:g}) needs watch_heartbeat_s: without "
                                 "heartbeats a live leader with nothing to say would read as a silent one")
            refuse([at_least(self, "watch_timeout_s", WATCH_TIMEOUT_PER_HEARTBEAT, "watch_heartbeat_s",
                             "a live leader's heartbeat a little late would read as a silent leader and the "
                             "watch would be opened again")])
        return self
