"""Scheduler: JobService (job front door) and AllocationService (versioned plans).

Not implemented yet: the process starts, reports SERVING on the health service and lists its
services through reflection, but every RPC answers UNIMPLEMENTED (the generated base class).
The issue that implements it replaces the servicer below.
"""

from __future__ import annotations

import grpc

from services.runtime.server import ServiceDefinition
from services.runtime.settings import ServiceSettings
from silod.v1 import scheduler_pb2_grpc
from silod.v1 import allocation_pb2_grpc


class Settings(ServiceSettings):
    pass


def definition(settings: Settings) -> ServiceDefinition:
    def register(server: grpc.aio.Server) -> None:
        scheduler_pb2_grpc.add_JobServiceServicer_to_server(scheduler_pb2_grpc.JobServiceServicer(), server)
        allocation_pb2_grpc.add_AllocationServiceServicer_to_server(allocation_pb2_grpc.AllocationServiceServicer(), server)

    return ServiceDefinition(name="scheduler", service_names=["silod.v1.JobService", "silod.v1.AllocationService"], register=register)
