"""The metadata service's background compaction: every ``retention_interval_s`` it removes what
the retention policy no longer keeps (services/metadata/store/retention.py) and counts it."""

from __future__ import annotations

import asyncio

from prometheus_client import Counter

from services.metadata.store import MetadataStore
from services.metadata.store.retention import RetentionPolicy
from services.runtime.structured_logging import get_logger

_log = get_logger("silod.metadata")

COMPACTED = Counter("silod_metadata_compacted_rows_total", "Rows the retention policy removed, by table "
                    "(plans, metric_samples, job_events, audit_events)", ["table"])


async def compact_forever(store: MetadataStore, policy: RetentionPolicy, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        try:
            removed = await asyncio.to_thread(store.retention.compact, policy)
        except Exception:  # noqa: BLE001 - the next compaction tries again; the service goes on
            _log.exception("compaction failed")
            continue
        for table, count in removed.items():
            COMPACTED.labels(table).inc(count)
        if any(removed.values()):
            _log.info("compacted", extra={f"{table}_removed": count for table, count in removed.items()})
