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
        1.0, ge=0.1, le=60,
        description="Seconds: the scheduler is asked to send a heartbeat on the plan watch whenever the stream was "
        "quiet this long (and one at once), so that a leader gone silent (its process frozen, its host cut off) "
        "is told from one with nothing to say")
    watch_timeout_s: float = Field(
        4.0, ge=0, le=600,
        description="Seconds of silence after which the plan watch is abandoned and the next scheduler address "
        "tried (the silent one is passed over for twice this): at least 3x watch_heartbeat_s; below the "
        "scheduler's lease_ttl_s minus lease_renew_s, a node has left a silent leader when its successor is "
        "elected. 0 = never: the HTTP/2 keepalive alone notices, within 15 s")

    @model_validator(mode="after")
    def _watch_timeout_above_heartbeats(self) -> PlanFollowerSettings:
        if self.watch_timeout_s > 0:
            refuse([at_least(self, "watch_timeout_s", WATCH_TIMEOUT_PER_HEARTBEAT, "watch_heartbeat_s",
                             "a live scheduler's heartbeat a little late would read as a silent one and the "
                             "watch would leave it")])
        return self
