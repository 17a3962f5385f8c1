"""Batch calls larger than gRPC's 4 MiB default pass between silod servers and clients."""

from __future__ import annotations

import asyncio

from estimator import service as estimator_service
from silod.rpc.channels import open_channel
from services.runtime.server import start_server
from silod.v1 import estimator_pb2, estimator_pb2_grpc

CANDIDATES = 60_000  # ~90 bytes per Prediction: a response well over 4 MiB


def test_large_predict_response_is_not_truncated() -> None:
    async def scenario() -> estimator_pb2.PredictResponse:
        settings = estimator_service.Settings(log_format="text")
        running = await start_server(estimator_service.definition(settings), settings)
        try:
            query = estimator_pb2.PredictQuery(
                application="cifar10",
                candidates=[estimator_pb2.CandidateAllocation(gpus=1 + i % 8, remote_io_bytes_per_s=10**9)
                            for i in range(CANDIDATES)],
            )
            request = estimator_pb2.PredictRequest(queries=[query])
            channel = open_channel(running.address, aio=True, default_timeout_s=120)
            async with channel:
                return await estimator_pb2_grpc.EstimatorServiceStub(channel).Predict(request)
        finally:
            await running.stop(grace=1)

    response = asyncio.run(scenario())
    assert response.ByteSize() > 4 * 2**20
    (result,) = response.results
    assert len(result.predictions) == CANDIDATES
    assert all(p.throughput_samples_per_s > 0 for p in result.predictions[:100])
