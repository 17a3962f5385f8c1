"""Prometheus metrics of the worker agent's GPUs (default registry, exported on --metrics-port).

Labelled by ``node`` and ``gpu`` (the GPU's index) only, so a node exports a fixed number of
series per GPU. A figure NVML does not support on a GPU has no series for it. Nothing here
without NVML (emulated GPUs).
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge

LABELS = ["node", "gpu"]
UTILIZATION = Gauge("silod_gpu_utilization_ratio", "Share (0..1) of NVML's last sample period a kernel ran", LABELS)
MEMORY_USED = Gauge("silod_gpu_memory_used_bytes", "Bytes of device memory in use", LABELS)
MEMORY_TOTAL = Gauge("silod_gpu_memory_total_bytes", "Bytes of device memory", LABELS)
TEMPERATURE = Gauge("silod_gpu_temperature_celsius", "GPU core temperature", LABELS)
# A gauge, not a counter: NVML's volatile count goes back to 0 when the GPU is reset.
ECC_UNCORRECTABLE = Gauge(
    "silod_gpu_ecc_uncorrectable_errors", "Uncorrectable ECC errors since the GPU's last reset (NVML volatile count)",
    LABELS)
XID_FAULTS = Counter(
    "silod_gpu_xid_faults_total", "Critical Xid events that are GPU faults (application Xids left out)", LABELS)
HEALTHY = Gauge(
    "silod_gpu_healthy", "1 = usable; 0 = a fatal fault (ECC, Xid, lost) the metadata store keeps until an operator "
    "clears it", LABELS)
