"""Prometheus metrics of the cache server (default registry, exported on --metrics-port).

``job`` is the reader's job id ("-" when the reader gave none); ``tier`` is memory or disk;
``path`` says how the bytes reached the reader: ``lease`` (the reader opened the file itself,
no bytes through gRPC), ``stream`` (Read RPC) or ``peer`` (served to the cache server of another
node of the job, ``Read(cached_only)``). ``silod_cache_peer_*`` count the other side: this
server's misses asked of the caches of the job's other nodes (cache_server/peers.py).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Gauge
from prometheus_client.metrics import MetricWrapperBase

HITS = Counter("silod_cache_hits_total", "Objects served from a cache tier", ["tier", "job", "path"])
MISSES = Counter("silod_cache_misses_total", "Objects not in any cache tier when asked for", ["job", "path"])
BYTES = Counter(
    "silod_cache_bytes_total", "Bytes of objects served, by where they came from", ["tier", "job", "path"]
)
REMOTE_BYTES = Counter("silod_cache_remote_bytes_total", "Bytes fetched from remote storage", ["job"])
REMOTE_FETCHES = Counter("silod_cache_remote_fetches_total", "Objects fetched from remote storage", ["job"])
STREAMED_BYTES = Counter("silod_cache_streamed_bytes_total", "Bytes sent through the Read RPC", ["job"])
PEER_HITS = Counter(
    "silod_cache_peer_hits_total", "Misses served from the cache of another node of the job (no remote read)", ["job"]
)
PEER_MISSES = Counter(
    "silod_cache_peer_misses_total", "Misses asked of the job's other nodes that none of them held", ["job"]
)
PEER_BYTES = Counter("silod_cache_peer_bytes_total", "Bytes read from the caches of the job's other nodes", ["job"])
PEER_ERRORS = Counter(
    "silod_cache_peer_errors_total", "Calls to a peer cache server that failed (down, slow, error); skipped", ["peer"]
)
PASS_THROUGH = Counter(
    "silod_cache_pass_through_total", "Objects served without being cached (quota full, no space)", ["job", "reason"]
)
CORRUPT = Counter("silod_cache_corrupt_total", "Cached files that failed verification and were dropped", ["tier"])
EVICTIONS = Counter("silod_cache_evictions_total", "Objects evicted", ["tier"])
USED = Gauge("silod_cache_used_bytes", "Bytes held by a tier", ["tier"])
CAPACITY = Gauge("silod_cache_capacity_bytes", "Bytes a tier may hold", ["tier"])
STORE_ERRORS = Counter(
    "silod_cache_remote_errors_total", "Failed reads from remote storage, by kind: unavailable (the store did not "
    "answer or failed), missing, changed (not the registered version), outside_root", ["kind"])
PLAN_VERSION = Gauge("silod_cache_plan_version", "Version of the plan whose quotas are applied; 0 = none")


def job_label(job_id: str) -> str:
    return job_id or "-"


_children: dict[tuple[int, tuple[str, ...]], Any] = {}


def forget_job(job_id: str) -> int:
    """Remove every series labelled with ``job_id`` from this module's metrics; how many."""
    label = job_label(job_id)
    removed = 0
    for metric in [m for m in globals().values() if isinstance(m, MetricWrapperBase) and "job" in m._labelnames]:
        names = metric._labelnames
        seen = set()
        for family in metric.collect():
            for sample in family.samples:
                values = tuple(sample.labels.get(n, "") for n in names)
                if sample.labels.get("job") == label and values not in seen:
                    seen.add(values)
                    metric.remove(*values)
                    _children.pop((id(metric), values), None)
                    removed += 1
    return removed


def labelled(metric: Any, *labels: str) -> Any:
    """``metric.labels(*labels)``, cached: prometheus_client's labels() costs microseconds."""
    key = (id(metric), labels)
    child = _children.get(key)
    if child is None:
        child = _children[key] = metric.labels(*labels)
    return child
