"""Valid requests to start from; tests override the one field they are about."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from silod.v1 import common_pb2, metadata_pb2, metadata_pb2_grpc, plan_pb2


def training_spec(**fields: Any) -> common_pb2.JobSpec:
    values: dict[str, Any] = {
        "name": "resnet50-cifar10",
        "tenant": "alice",
        "application": "cifar10",
        "dataset": "cifar10",
        "min_gpus": 1,
        "max_gpus": 4,
        "batch_size": 128,
        "max_batch_size": 1024,
        "epochs": 3,
    }
    values.update(fields)
    if "sample_budget" in fields:
        values.pop("epochs")
    return common_pb2.JobSpec(**values)


def inference_spec(**fields: Any) -> common_pb2.JobSpec:
    values: dict[str, Any] = {
        "name": "infer-resnet50",
        "kind": common_pb2.JOB_KIND_INFERENCE,
        "application": "infer-resnet50-1",
        "min_gpus": 1,
        "max_gpus": 1,
        "inference_duration_s": 30.0,
    }
    values.update(fields)
    return common_pb2.JobSpec(**values)


def node_spec(name: str = "n1", **fields: Any) -> common_pb2.NodeSpec:
    values: dict[str, Any] = {
        "name": name,
        "pool": common_pb2.NODE_POOL_TRAINING,
        "gpus": 4,
        "gpu_model": "emulated",
        "cache_capacity_bytes": 10 * 2**30,
        "memory_cache_bytes": 2**30,
        "agent_address": "127.0.0.1:7001",
        "cache_address": "127.0.0.1:7002",
        "labels": {"rack": "r1"},
    }
    values.update(fields)
    return common_pb2.NodeSpec(**values)


def dataset_spec(name: str = "cifar10", **fields: Any) -> common_pb2.DatasetSpec:
    values: dict[str, Any] = {"name": name, "uri": f"s3://datasets/{name}", "storage_options": {"anon": "true"}}
    values.update(fields)
    return common_pb2.DatasetSpec(**values)


def objects(count: int, prefix: str = "train/") -> list[common_pb2.DatasetObject]:
    return [common_pb2.DatasetObject(key=f"{prefix}{i:06d}.bin", size_bytes=1000 + i, etag=f"e{i}") for i in range(count)]


def registration(
    spec: common_pb2.DatasetSpec, manifest: Sequence[common_pb2.DatasetObject], *, chunk: int = 5000, replace: bool = False
) -> Iterator[metadata_pb2.RegisterDatasetRequest]:
    """The stream a client sends: the spec in the first message, objects in chunks."""
    yield metadata_pb2.RegisterDatasetRequest(spec=spec, objects=manifest[:chunk], replace=replace)
    for start in range(chunk, len(manifest), chunk):
        yield metadata_pb2.RegisterDatasetRequest(objects=manifest[start : start + chunk])


def create_job(stub: metadata_pb2_grpc.MetadataServiceStub, spec: common_pb2.JobSpec | None = None, request_id: str = "") -> common_pb2.Job:
    return stub.CreateJob(metadata_pb2.CreateJobRequest(spec=spec or training_spec(), client_request_id=request_id))


def move(stub: metadata_pb2_grpc.MetadataServiceStub, job: common_pb2.Job, *states: int) -> common_pb2.Job:
    """Walk ``job`` through ``states`` with correct expected states."""
    for state in states:
        job = stub.TransitionJob(
            metadata_pb2.TransitionJobRequest(job_id=job.id, expected_state=job.state, new_state=state, message=f"to {state}")
        )
    return job


def placement(node: str, *gpus: int) -> plan_pb2.GpuPlacement:
    return plan_pb2.GpuPlacement(node=node, gpu_indices=list(gpus))


def plan(version: int, *jobs: plan_pb2.JobAllocation, **fields: Any) -> plan_pb2.AllocationPlan:
    return plan_pb2.AllocationPlan(version=version, policy="pollux", cache_mode="silod", jobs=list(jobs), **fields)
