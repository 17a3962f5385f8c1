"""Estimator service: the SiloD cache/IO model and Pollux goodput model behind EstimatorService.

Not implemented yet: the process starts, reports SERVING on the health service and lists its
services through reflection, but every RPC answers UNIMPLEMENTED (the generated base class).
The issue that implements it replaces the servicer below.
"""

from __future__ import annotations

import grpc

from services.runtime.server import ServiceDefinition
from services.runtime.settings import ServiceSettings
from silod.v1 import estimator_pb2_grpc


class Settings(ServiceSettings):
    pass


def definition(settings: Settings) -> ServiceDefinition:
    def register(server: grpc.aio.Server) -> None:
        estimator_pb2_grpc.add_EstimatorServiceServicer_to_server(estimator_pb2_grpc.EstimatorServiceServicer(), server)

    return ServiceDefinition(name="estimator", service_names=["silod.v1.EstimatorService"], register=register)
