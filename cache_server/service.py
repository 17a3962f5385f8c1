"""Per-node cache server: memory/disk tiers in front of remote dataset storage.

Not implemented yet: the process starts, reports SERVING on the health service and lists its
services through reflection, but every RPC answers UNIMPLEMENTED (the generated base class).
The issue that implements it replaces the servicer below.
"""

from __future__ import annotations

import grpc

from services.runtime.server import ServiceDefinition
from services.runtime.settings import ServiceSettings
from silod.v1 import cache_pb2_grpc


class Settings(ServiceSettings):
    pass


def definition(settings: Settings) -> ServiceDefinition:
    def register(server: grpc.aio.Server) -> None:
        cache_pb2_grpc.add_CacheServiceServicer_to_server(cache_pb2_grpc.CacheServiceServicer(), server)

    return ServiceDefinition(name="cache-server", service_names=["silod.v1.CacheService"], register=register)
