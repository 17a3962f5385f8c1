"""The GPU type a worker agent advertises: derived from the NVML model name, or configured."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from silod.v1 import metadata_pb2
from tests.worker_agent.conftest import wait_until
from worker_agent.gpus import gpu_type_from_model, resolve_gpu_type


@pytest.mark.parametrize(("model", "gpu_type"), [
    ("NVIDIA A100-SXM4-40GB", "a100"),
    ("NVIDIA A100 80GB PCIe", "a100"),
    ("Tesla V100-SXM2-16GB", "v100"),
    ("Tesla K80", "k80"),
    ("Tesla T4", "t4"),
    ("NVIDIA H100 80GB HBM3", "h100"),
    ("NVIDIA L40S", "l40s"),
    ("NVIDIA A10G", "a10g"),
    ("NVIDIA GeForce RTX 4090", "geforce-rtx-4090"),
])
def test_type_from_nvml_model_name(model: str, gpu_type: str) -> None:
    assert gpu_type_from_model(model) == gpu_type


def test_configured_type_wins_and_emulated_gpus_are_untyped() -> None:
    assert resolve_gpu_type("l4", "NVIDIA A100-SXM4-40GB") == "l4"
    assert resolve_gpu_type("", "NVIDIA A100-SXM4-40GB") == "a100"
    assert resolve_gpu_type("", "emulated") == ""


def test_agent_registers_its_configured_gpu_type(metadata, start_agent) -> None:  # type: ignore[no-untyped-def]
    agent = start_agent("--gpu-type", "v100")

    def registered():  # type: ignore[no-untyped-def]
        nodes = metadata.stub.ListNodes(metadata_pb2.ListNodesRequest(gpu_type="v100"), timeout=5).nodes
        return [n for n in nodes if n.spec.name == agent.node]

    node = wait_until(registered, what="node registered with its type")[0]
    assert (node.spec.gpu_type, node.spec.gpu_model) == ("v100", "emulated")


def test_a_gpu_type_outside_the_rule_stops_the_agent_naming_the_setting(tmp_path: Path) -> None:
    done = subprocess.run([str(Path(sys.executable).parent / "silod"), "worker-agent", "--gpu-type", "A100",
                           "--metadata-address", "127.0.0.1:1", "--work-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "gpu_type" in done.stderr and "Traceback" not in done.stderr
