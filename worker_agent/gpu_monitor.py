"""The agent's GPU health: NVML figures sampled at every heartbeat, exported to Prometheus and
sent with the heartbeat; fatal faults (critical Xid events) queued until a heartbeat delivers
them.

Which GPUs are faulted is the metadata store's decision and record (a critical Xid, an ECC
count above the one an operator last accepted, a lost GPU), kept until an operator clears it,
so it survives agent restarts. Every heartbeat reply carries that record; it is what
``silod_gpu_healthy`` and GetNodeStatus show here, and what the scheduler places around.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from silod.v1 import common_pb2
from worker_agent import metrics, nvml


class GpuMonitor:
    def __init__(self, session: nvml.Session, node: str, on_fault: Callable[[], None]) -> None:
        """``on_fault`` is called (from any thread) when a fault is queued: heartbeat now."""
        self.session = session
        self.node = node
        self.telemetry: list[common_pb2.GpuTelemetry] = []
        self.faults: list[common_pb2.GpuFault] = []  # the metadata store's record, as of the last heartbeat
        self._pending: list[common_pb2.GpuFault] = []
        self._lock = threading.Lock()  # _pending is appended to from the Xid thread
        self._on_fault = on_fault
        for index in range(session.count):
            metrics.HEALTHY.labels(node, str(index)).set(1)
        self._xid = nvml.XidWatcher(session, self._xid_fault)

    def _xid_fault(self, index: int, xid: int) -> None:
        fault = common_pb2.GpuFault(index=index, reason=f"Xid {xid}")
        fault.since.GetCurrentTime()
        with self._lock:
            # One per GPU is enough (the store keeps a GPU's first fault until it is cleared); it
            # also bounds what a heartbeat carries after a long time without the metadata service.
            if all(f.index != index for f in self._pending):
                self._pending.append(fault)
        metrics.XID_FAULTS.labels(self.node, str(index)).inc()
        metrics.HEALTHY.labels(self.node, str(index)).set(0)  # before the store confirms: it will
        self._on_fault()

    async def sample(self) -> list[common_pb2.GpuTelemetry]:
        samples = await asyncio.to_thread(self.session.sample)
        self.telemetry = [_to_proto(s) for s in samples]
        for s in samples:
            labels = (self.node, str(s.index))
            for gauge, value in ((metrics.UTILIZATION, s.utilization_ratio), (metrics.MEMORY_USED, s.memory_used_bytes),
                                 (metrics.MEMORY_TOTAL, s.memory_total_bytes),
                                 (metrics.TEMPERATURE, s.temperature_celsius),
                                 (metrics.ECC_UNCORRECTABLE, s.ecc_uncorrectable_errors)):
                if value is not None:
                    gauge.labels(*labels).set(value)
            if s.lost:
                metrics.HEALTHY.labels(*labels).set(0)
        return self.telemetry

    def pending_faults(self) -> list[common_pb2.GpuFault]:
        with self._lock:
            return list(self._pending)

    def delivered(self, sent: list[common_pb2.GpuFault]) -> None:
        """A heartbeat carrying ``sent`` succeeded: the store has them."""
        with self._lock:
            self._pending = self._pending[len(sent):]

    def record(self, node: common_pb2.Node) -> None:
        """The store's record of faulted GPUs, from a heartbeat reply."""
        self.faults = list(node.gpu_faults)
        faulted = {f.index for f in node.gpu_faults}
        with self._lock:
            faulted |= {f.index for f in self._pending}
        lost = {t.index for t in self.telemetry if t.lost}
        for index in range(self.session.count):
            metrics.HEALTHY.labels(self.node, str(index)).set(0 if index in faulted | lost else 1)

    def close(self) -> None:
        self._xid.close()
        self.session.close()


def _to_proto(s: nvml.GpuSample) -> common_pb2.GpuTelemetry:
    t = common_pb2.GpuTelemetry(index=s.index, lost=s.lost)
    for name in ("utilization_ratio", "memory_used_bytes", "memory_total_bytes", "temperature_celsius",
                 "ecc_uncorrectable_errors"):
        value = getattr(s, name)
        if value is not None:
            setattr(t, name, value)
    return t
