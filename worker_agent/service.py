"""Per-node worker agent: launches, resizes and stops job processes.

Not implemented yet: the process starts, reports SERVING on the health service and lists its
services through reflection, but every RPC answers UNIMPLEMENTED (the generated base class).
The issue that implements it replaces the servicer below.
"""

from __future__ import annotations

import grpc

from services.runtime.server import ServiceDefinition
from services.runtime.settings import ServiceSettings
from silod.v1 import worker_agent_pb2_grpc


class Settings(ServiceSettings):
    pass


def definition(settings: Settings) -> ServiceDefinition:
    def register(server: grpc.aio.Server) -> None:
        worker_agent_pb2_grpc.add_WorkerAgentServiceServicer_to_server(worker_agent_pb2_grpc.WorkerAgentServiceServicer(), server)

    return ServiceDefinition(name="worker-agent", service_names=["silod.v1.WorkerAgentService"], register=register)
