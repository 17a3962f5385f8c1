"""The services the live scheduler calls, and the job states it reads them in.

One :class:`Clients` is shared by every part of the scheduler: the stubs exist only once the
server's event loop runs (an aio channel belongs to the loop that serves), so the parts are
built first and read the stubs from here when they call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from silod.v1 import common_pb2

if TYPE_CHECKING:
    from scheduler.live.data import CachedBytesProbe

ACTIVE_STATES = (common_pb2.JOB_STATE_PENDING, common_pb2.JOB_STATE_SCHEDULED,
                 common_pb2.JOB_STATE_RUNNING, common_pb2.JOB_STATE_RESIZING)
PLACED_STATES = (common_pb2.JOB_STATE_SCHEDULED, common_pb2.JOB_STATE_RUNNING, common_pb2.JOB_STATE_RESIZING)
TERMINAL_STATES = (common_pb2.JOB_STATE_SUCCEEDED, common_pb2.JOB_STATE_FAILED, common_pb2.JOB_STATE_CANCELLED)


@dataclass
class Clients:
    md: Any = None  # metadata_pb2_grpc.MetadataServiceStub
    estimator: Any = None  # EstimatorServiceStub when an estimator address is configured
    cached: CachedBytesProbe | None = None  # what the cache servers hold, when the service wires a probe
