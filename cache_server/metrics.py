"""Prometheus metrics of the cache server (default registry, exported on --metrics-port).

No job ids as labels: these counters move with every object read, and a label per job would
grow the series with the cluster's history. Per-job figures (hits, misses, remote bytes, peer
reads, quota) are in the Stats RPC, which the scheduler, the dashboard and `silod` read.
``tier`` is memory or disk (``remote`` and ``peer`` for bytes that came from there);
``path`` says how the bytes reached the reader: ``lease`` (the reader opened the file itself,
no bytes through gRPC), ``stream`` (Read RPC) or ``peer`` (served to the cache server of another
node of the job, ``Read(cached_only)``). ``silod_cache_peer_*`` count the other side: this
server's misses asked of the caches of the job's other nodes (cache_server/peers.py).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Gauge

HITS = Counter("silod_cache_hits_total", "Objects served from a cache tier", ["tier", "path"])
MISSES = Counter("silod_cache_misses_total", "Objects not in any cache tier when asked for", ["path"])
BYTES = Counter("silod_cache_bytes_total", "Bytes of objects served, by where they came from", ["tier", "path"])
REMOTE_BYTES = Counter("silod_cache_remote_bytes_total", "Bytes fetched from remote storage")
REMOTE_FETCHES = Counter("silod_cache_remote_fetches_total", "Objects fetched from remote storage")
STREAMED_BYTES = Counter("silod_cache_streamed_bytes_total", "Bytes sent through the Read RPC")
PEER_HITS = Counter(
    "silod_cache_peer_hits_total", "Misses served from the cache of another node of the job (no remote read)"
)
PEER_MISSES = Counter("silod_cache_peer_misses_total", "Misses asked of the job's other nodes that none of them held")
PEER_BYTES = Counter("silod_cache_peer_bytes_total", "Bytes read from the caches of the job's other nodes")
PEER_ERRORS = Counter(
    "silod_cache_peer_errors_total", "Calls to a peer cache server that failed (down, slow, error); skipped", ["peer"]
)
PASS_THROUGH = Counter(
    "silod_cache_pass_through_total", "Objects served without being cached, by reason: policy (the job's partition "
    "would not admit it), no-space, write-error, none (the job's cache policy is none)", ["reason"]
)
CORRUPT = Counter("silod_cache_corrupt_total", "Cached files that failed verification and were dropped", ["tier"])
EVICTIONS = Counter("silod_cache_evictions_total", "Objects evicted", ["tier"])
USED = Gauge("silod_cache_used_bytes", "Bytes held by a tier", ["tier"])
CAPACITY = Gauge("silod_cache_capacity_bytes", "Bytes a tier may hold", ["tier"])
STORE_ERRORS = Counter(
    "silod_cache_remote_errors_total", "Failed reads from remote storage, by kind: unavailable (the store did not "
    "answer or failed), missing, changed (not the registered version), outside_root", ["kind"])
PLAN_VERSION = Gauge("silod_cache_plan_version", "Version of the plan whose quotas are applied; 0 = none")


_children: dict[tuple[int, tuple[str, ...]], Any] = {}


def labelled(metric: Any, *labels: str) -> Any:
    """``metric.labels(*labels)``, cached: prometheus_client's labels() costs microseconds."""
    key = (id(metric), labels)
    child = _children.get(key)
    if child is None:
        child = _children[key] = metric.labels(*labels)
    return child
