"""``silod estimator``: the SiloD cache/IO model and the Pollux goodput model behind EstimatorService.

Predict answers many (job, candidate allocation) pairs per call; Observe refits a job's model
from its measured steps; GetJobModel returns the fitted parameters. With ``metadata_address``
set, fitted models are written to the metadata service (PutJobModel) and read back from it
(GetJobModel), so a restarted estimator resumes; without it they live in memory only. See
docs/estimator.md.
"""

from __future__ import annotations

import asyncio
import threading

import grpc
from pydantic import Field, field_validator

from estimator.model_store import ModelStore
from estimator.predict import DEFAULT_GPUS_PER_NODE
from estimator.servicer import EstimatorServicer, warm_profiles
from silod.rpc.channels import open_channel
from services.runtime.server import ServiceDefinition
from services.runtime.settings import ConfigError, ServiceSettings, split_host_port
from services.runtime.structured_logging import get_logger
from silod.v1 import estimator_pb2_grpc, metadata_pb2_grpc

_log = get_logger("silod.estimator")


class Settings(ServiceSettings):
    metadata_address: str = Field(
        "",
        description="HOST:PORT of the metadata service; fitted job models are persisted there (PutJobModel) "
        "and read back (GetJobModel) so a restarted estimator resumes. Empty = keep models in memory only: "
        "they are lost when the process exits",
    )
    metadata_token: str = Field(
        "", description="Bearer token sent to the metadata service; empty = send auth_token (one cluster-wide token)"
    )
    metadata_tls_ca_file: str = Field(
        "", description="PEM CA certificate that verifies the metadata service's TLS certificate; empty = plaintext"
    )
    metadata_timeout_s: float = Field(
        5.0, gt=0, le=300, description="Seconds one call to the metadata service may take before it counts as unavailable"
    )
    gpus_per_node: int = Field(
        DEFAULT_GPUS_PER_NODE,
        ge=1,
        le=1024,
        description="GPUs per node assumed for a Predict candidate with nodes=0 (packed: ceil(gpus / gpus_per_node) nodes)",
    )

    @field_validator("metadata_address")
    @classmethod
    def _address_is_host_port(cls, value: str) -> str:
        if value:
            try:
                split_host_port(value, field="metadata_address")
            except ConfigError as exc:
                raise ValueError(exc.detail) from None
        return value


def definition(settings: Settings) -> ServiceDefinition:
    store = ModelStore(settings.metadata_address)
    servicer = EstimatorServicer(store, gpus_per_node=settings.gpus_per_node)
    channels: list[grpc.aio.Channel] = []
    stop_warming = threading.Event()

    def register(server: grpc.aio.Server) -> None:
        estimator_pb2_grpc.add_EstimatorServiceServicer_to_server(servicer, server)

    async def on_start() -> None:
        if settings.metadata_address:
            # The metadata service may come up after us: nothing is called here, lookups and
            # writes report UNAVAILABLE until it answers.
            channel = open_channel(
                settings.metadata_address,
                token=settings.metadata_token or settings.auth_token,
                tls_ca_file=settings.metadata_tls_ca_file,
                aio=True,
                default_timeout_s=settings.metadata_timeout_s,
            )
            channels.append(channel)
            store.attach(metadata_pb2_grpc.MetadataServiceStub(channel))
        else:
            _log.info("no metadata_address: fitted job models are kept in memory only")
        # Fitting the packaged profiles takes a second or two; do it while already serving. A
        # daemon thread rather than the executor, so a SIGTERM right after start need not wait.
        threading.Thread(target=warm_profiles, args=(stop_warming,), name="estimator-warm-profiles", daemon=True).start()

    async def on_stop() -> None:
        stop_warming.set()
        try:  # models whose write failed earlier: one more try, bounded so shutdown stays quick
            await asyncio.wait_for(store.flush(), timeout=settings.metadata_timeout_s)
        except TimeoutError:
            _log.warning("gave up persisting job models at shutdown", extra={"timeout_s": settings.metadata_timeout_s})
        for channel in channels:
            await channel.close()

    return ServiceDefinition(
        name="estimator",
        service_names=["silod.v1.EstimatorService"],
        register=register,
        on_start=on_start,
        on_stop=on_stop,
    )
