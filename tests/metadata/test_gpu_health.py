"""GPU figures and faults through Heartbeat, ClearGpuFault and the Node messages, over real gRPC
on SQLite and PostgreSQL: what is recorded, which faults latch, what clearing accepts, bad input."""

from __future__ import annotations

import grpc

from silod.v1 import common_pb2, metadata_pb2 as m
from tests.metadata.metadata_harness import assert_rpc_error
from tests.metadata.metadata_samples import node_spec


def figures(index: int, *, ecc: int | None = 0, lost: bool = False, util: float = 0.5) -> common_pb2.GpuTelemetry:
    t = common_pb2.GpuTelemetry(index=index, utilization_ratio=util, memory_used_bytes=2**30,
                                memory_total_bytes=16 * 2**30, temperature_celsius=40.0, lost=lost)
    if ecc is not None:
        t.ecc_uncorrectable_errors = ecc
    return t


def beat(stub, node: str = "g1", version: int = 0, telemetry=(), faults=()):  # type: ignore[no-untyped-def]
    return stub.Heartbeat(m.HeartbeatRequest(node=node, applied_plan_version=version, gpu_telemetry=list(telemetry),
                                             gpu_faults=list(faults)))


def faulted(node: common_pb2.Node) -> dict[int, str]:
    return {f.index: f.reason for f in node.gpu_faults}


def test_figures_are_kept_and_a_heartbeat_without_any_keeps_them(stub):
    stub.UpsertNode(m.UpsertNodeRequest(spec=node_spec("g1", gpus=2)))
    node = beat(stub, telemetry=[figures(1, ecc=None), figures(0, util=0.75)])
    assert [t.index for t in node.gpu_telemetry] == [0, 1]
    assert node.gpu_telemetry[0].utilization_ratio == 0.75
    assert node.gpu_telemetry[0].HasField("ecc_uncorrectable_errors") and node.gpu_telemetry[0].ecc_uncorrectable_errors == 0
    assert not node.gpu_telemetry[1].HasField("ecc_uncorrectable_errors")  # unsupported stays unset
    assert not node.gpu_faults
    # The scheduler's forwarded plan acks carry no figures: they must not wipe the agent's.
    again = beat(stub, version=1)
    assert again.gpu_telemetry == node.gpu_telemetry
    listed = stub.ListNodes(m.ListNodesRequest()).nodes
    assert [n.gpu_telemetry for n in listed if n.spec.name == "g1"] == [node.gpu_telemetry]


def test_an_ecc_count_above_the_accepted_one_faults_until_cleared(stub):
    stub.UpsertNode(m.UpsertNodeRequest(spec=node_spec("g1", gpus=2)))
    node = beat(stub, telemetry=[figures(0), figures(1, ecc=2)])
    assert faulted(node) == {1: "2 uncorrectable ECC errors"}
    assert node.gpu_faults[0].since.seconds > 0
    first_since = node.gpu_faults[0].since
    # Kept with its first reason and time while the count goes on rising.
    node = beat(stub, telemetry=[figures(0), figures(1, ecc=5)])
    assert faulted(node) == {1: "2 uncorrectable ECC errors"} and node.gpu_faults[0].since == first_since
    # The operator clears it: the 5 errors are accepted, the same count does not fault again ...
    cleared = stub.ClearGpuFault(m.ClearGpuFaultRequest(node="g1", gpu_index=1))
    assert not cleared.gpu_faults
    assert not beat(stub, telemetry=[figures(0), figures(1, ecc=5)]).gpu_faults
    # ... a new error does.
    assert faulted(beat(stub, telemetry=[figures(0), figures(1, ecc=6)])) == {1: "6 uncorrectable ECC errors"}
    stub.ClearGpuFault(m.ClearGpuFaultRequest(node="g1", gpu_index=1))
    # A GPU reset zeroes the count: from then on any error is new.
    assert not beat(stub, telemetry=[figures(0), figures(1, ecc=0)]).gpu_faults
    assert faulted(beat(stub, telemetry=[figures(0), figures(1, ecc=1)])) == {1: "1 uncorrectable ECC errors"}


def test_xid_faults_and_lost_gpus_latch_and_survive_a_refused_heartbeat(stub):
    stub.UpsertNode(m.UpsertNodeRequest(spec=node_spec("g1", gpus=4)))
    beat(stub, version=5)
    xid = common_pb2.GpuFault(index=2, reason="Xid 79")
    xid.since.FromSeconds(1_800_000_000)
    # A restarted agent (version 0) is refused, but its faults are recorded all the same.
    assert_rpc_error(lambda: beat(stub, version=0, telemetry=[figures(0, lost=True)], faults=[xid]),
                     grpc.StatusCode.FAILED_PRECONDITION, "applied_plan_version")
    node = stub.GetNode(m.GetNodeRequest(node="g1"))
    assert faulted(node) == {0: "GPU lost (NVML: GPU_IS_LOST, fallen off the bus)", 2: "Xid 79"}
    assert node.gpu_faults[1].since.seconds == 1_800_000_000
    # Sent again (the agent did not hear the answer): nothing changes.
    assert faulted(beat(stub, version=5, faults=[xid])) == faulted(node)
    assert faulted(stub.ClearGpuFault(m.ClearGpuFaultRequest(node="g1", gpu_index=2))) == {
        0: "GPU lost (NVML: GPU_IS_LOST, fallen off the bus)"}
    # A GPU still lost is faulted again at the next heartbeat that says so.
    stub.ClearGpuFault(m.ClearGpuFaultRequest(node="g1", gpu_index=0))
    assert 0 in faulted(beat(stub, version=5, telemetry=[figures(0, lost=True)]))


def test_bad_heartbeats_and_clears_name_the_field(stub):
    stub.UpsertNode(m.UpsertNodeRequest(spec=node_spec("g1", gpus=2)))
    assert_rpc_error(lambda: beat(stub, telemetry=[figures(2)]), grpc.StatusCode.INVALID_ARGUMENT,
                     "gpu_telemetry[0].index")
    assert_rpc_error(lambda: beat(stub, telemetry=[figures(0), figures(0)]), grpc.StatusCode.INVALID_ARGUMENT,
                     "gpu_telemetry[1].index")
    assert_rpc_error(lambda: beat(stub, telemetry=[figures(0, util=1.5)]), grpc.StatusCode.INVALID_ARGUMENT,
                     "gpu_telemetry[0].utilization_ratio")
    assert_rpc_error(lambda: beat(stub, telemetry=[figures(0, ecc=-1)]), grpc.StatusCode.INVALID_ARGUMENT,
                     "gpu_telemetry[0].ecc_uncorrectable_errors")
    assert_rpc_error(lambda: beat(stub, faults=[common_pb2.GpuFault(index=0)]), grpc.StatusCode.INVALID_ARGUMENT,
                     "gpu_faults[0].reason")
    assert_rpc_error(lambda: beat(stub, faults=[common_pb2.GpuFault(index=5, reason="Xid 48")]),
                     grpc.StatusCode.INVALID_ARGUMENT, "gpu_faults[0].index")
    assert not stub.GetNode(m.GetNodeRequest(node="g1")).gpu_telemetry  # a refused heartbeat records nothing

    assert_rpc_error(lambda: stub.ClearGpuFault(m.ClearGpuFaultRequest(node="nope", gpu_index=0)),
                     grpc.StatusCode.NOT_FOUND, "node")
    assert_rpc_error(lambda: stub.ClearGpuFault(m.ClearGpuFaultRequest(node="bad name!", gpu_index=0)),
                     grpc.StatusCode.INVALID_ARGUMENT, "node")
    assert_rpc_error(lambda: stub.ClearGpuFault(m.ClearGpuFaultRequest(node="g1", gpu_index=-1)),
                     grpc.StatusCode.INVALID_ARGUMENT, "gpu_index")
    error = assert_rpc_error(lambda: stub.ClearGpuFault(m.ClearGpuFaultRequest(node="g1", gpu_index=2)),
                             grpc.StatusCode.INVALID_ARGUMENT, "gpu_index")
    assert "node g1 has 2 GPUs (0..1), got 2" in error.details()
    assert_rpc_error(lambda: stub.ClearGpuFault(m.ClearGpuFaultRequest(node="g1", gpu_index=1)),
                     grpc.StatusCode.FAILED_PRECONDITION, "gpu_index")
