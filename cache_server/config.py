"""The cache server's engine settings (``silod cache-server``'s flags become these in service.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CacheConfig:
    node: str = "node"
    memory_dir: str = ""  # "" = no memory tier
    memory_bytes: int = 0
    disk_dir: str = ""  # "" = no disk tier
    disk_bytes: int = 0
    default_policy: str = "lrfu-cost"
    lease_default_s: float = 60.0
    lease_max_s: float = 3600.0
    remote_timeout_s: float = 30.0
    remote_retries: int = 3
    # A store 20 ms away serves 114 KB objects at 100 MB/s only with ~20 requests in flight.
    remote_concurrency: int = 64
    manifest_refresh_s: float = 30.0
    prefetch_lookahead_s: float = 2.0
    prefetch_min_objects: int = 64
    prefetch_max_objects: int = 8192
    prefetch_max_staged_bytes: int = 256 << 20
    prefetch_concurrency: int = 32
    coalesce_bytes: int = 4 << 20  # longest ranged read of byte-adjacent shard samples while prefetching
    lease_coalesce_bytes: int = 1 << 20  # the same for the misses of a Lease (the batch waits for them)
    lrfu_half_life_s: float = 300.0
    unallocated_io_trickle_bytes_per_s: float = 0.0  # 0: a job granted no IO reads nothing remote
    io_burst_s: float = 0.05
    fsync: bool = True
    no_space_backoff_s: float = 30.0

    @property
    def remote_deadline_s(self) -> float:
        """How long a whole retry sequence of one remote read may take (a hung mount, say)."""
        return self.remote_timeout_s * (self.remote_retries + 1) + 10.0
