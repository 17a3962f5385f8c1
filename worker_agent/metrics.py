"""Prometheus metrics of the worker agent's GPUs (default registry, exported on --metrics-port).

Labelled by ``node`` and ``gpu`` (the GPU's index) only, so a node exports a fixed number of
series per GPU. A figure NVML does not support on a GPU has no series for it. Nothing here
without NVML (emulated GPUs).
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

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


# ---- the agent's ranks and plans (labelled by node; causes and start kinds are fixed sets) ----
RANKS_RUNNING = Gauge("silod_agent_ranks_running", "Ranks (task processes) alive on the node", ["node"])
PLAN_VERSION = Gauge("silod_agent_plan_version", "Version of the last allocation plan the agent applied", ["node"])
LAUNCHES = Counter("silod_agent_launches_total", "Rank launches by how the process started: warm (a preloaded "
                   "interpreter), cold (a new process) or failed (the command could not be started)", ["node", "start"])
EXITS = Counter("silod_agent_rank_exits_total", "Rank exits by cause (see worker_agent.task_metrics.exit_cause)",
                ["node", "cause"])
_SECONDS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
PLAN_APPLY = Histogram("silod_agent_plan_apply_seconds", "From a plan reaching the agent to its acknowledgement "
                       "(ranks stopped, checkpointed and launched)", ["node"], buckets=_SECONDS)
CHECKPOINT = Histogram("silod_agent_checkpoint_seconds", "From asking a rank to checkpoint and exit (SIGTERM) to "
                       "its exit", ["node"], buckets=_SECONDS)
REFORM = Histogram("silod_agent_reform_seconds", "From a fast resize reaching a surviving rank's agent to the rank's "
                   "first call under its new identity (the in-place re-form)", ["node"], buckets=_SECONDS)
