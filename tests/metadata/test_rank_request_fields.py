"""What the metadata service accepts of the per-rank requests, the image and a node's cores,
memory and runtime (the refusals are in test_metadata_bad_input.py's table), and that they are
kept as sent."""

from __future__ import annotations

import pytest

from services.metadata.validation.jobs import normalized_job_spec
from services.metadata.validation.nodes import normalized_node_spec
from services.runtime.errors import InvalidArgument
from silod.v1 import metadata_pb2 as m
from tests.metadata.metadata_harness import InProcessServer
from tests.metadata.metadata_samples import node_spec, training_spec

DIGEST = "sha256:" + "0123456789abcdef" * 4


@pytest.mark.parametrize("image", [
    "", "ubuntu", "ubuntu:22.04", "library/ubuntu", "registry.example:5000/team/train:1.4", "localhost/train",
    "localhost:5000/a/b", "ghcr.io/org/img_x__y-z.w:Tag_1.2-rc", f"ubuntu@{DIGEST}", f"team/train:1.4@{DIGEST}",
    "Registry.Example.com/team/train", "x" * 255,
])
def test_container_images_accepted(image: str) -> None:
    assert normalized_job_spec(training_spec(image=image)).image == image


@pytest.mark.parametrize("image", [
    "Ubuntu", "UPPER/train", "team//train", "team/train/", "/train", "train_", "-train", "a..b", "ubuntu:-x",
    "host:5000:tag/x", f"ubuntu@{DIGEST.upper()}", "ubuntu latest", "x" * 256,
])
def test_malformed_images_refused_naming_the_field(image: str) -> None:
    with pytest.raises(InvalidArgument) as refused:
        normalized_job_spec(training_spec(image=image))
    assert refused.value.field == "spec.image"


def test_requests_at_their_bounds_are_accepted() -> None:
    spec = normalized_job_spec(training_spec(cpus_per_rank=4096.0, memory_bytes_per_rank=2**50))
    assert (spec.cpus_per_rank, spec.memory_bytes_per_rank) == (4096.0, 2**50)
    spec = normalized_job_spec(training_spec(cpus_per_rank=0.25, memory_bytes_per_rank=0))
    assert (spec.cpus_per_rank, spec.memory_bytes_per_rank) == (0.25, 0)


@pytest.mark.parametrize("runtime", ["", "process", "contained", "container"])
def test_node_capacity_and_runtime_accepted(runtime: str) -> None:
    spec = normalized_node_spec(node_spec(cpus=1e6, memory_bytes=2**60, runtime=runtime))
    assert (spec.cpus, spec.memory_bytes, spec.runtime) == (1e6, 2**60, runtime)


def test_node_fields_refused_together_each_named() -> None:
    with pytest.raises(InvalidArgument) as refused:
        normalized_node_spec(node_spec(cpus=-1.0, memory_bytes=-1, runtime="Container"))
    assert {v.field for v in refused.value.violations} == {"spec.cpus", "spec.memory_bytes", "spec.runtime"}


def test_stored_as_sent(server: InProcessServer) -> None:
    stub = server.stub
    stub.UpsertNode(m.UpsertNodeRequest(spec=node_spec("n1", cpus=31.5, memory_bytes=2**37, runtime="contained")))
    node = stub.GetNode(m.GetNodeRequest(node="n1"))
    assert (node.spec.cpus, node.spec.memory_bytes, node.spec.runtime) == (31.5, 2**37, "contained")
    job = stub.CreateJob(m.CreateJobRequest(spec=training_spec(image="team/train:1", cpus_per_rank=2.5,
                                                               memory_bytes_per_rank=2**33)))
    got = stub.GetJob(m.GetJobRequest(job_id=job.id)).spec
    assert (got.image, got.cpus_per_rank, got.memory_bytes_per_rank) == ("team/train:1", 2.5, 2**33)
