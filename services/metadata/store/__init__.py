"""The store layer: validation, domain rules and persistence, one transaction per operation.

Plain synchronous SQLAlchemy and protobuf messages; nothing here knows about gRPC, so the
servicer runs these calls in worker threads and tests can call them directly.
"""

from __future__ import annotations

from services.metadata.database import Database, EngineOptions, create_db_engine
from services.metadata.store.access import AccessStore
from services.metadata.store.audit import AuditStore
from services.metadata.store.datasets import DatasetStore
from services.metadata.store.jobs import JobStore
from services.metadata.store.leadership import LeadershipStore
from services.metadata.store.metrics import MetricStore
from services.metadata.store.nodes import NodeStore
from services.metadata.store.plans import PlanStore
from services.metadata.store.quotas import QuotaStore
from services.metadata.store.retention import RetentionStore


class MetadataStore:
    def __init__(self, db: Database, *, liveness_window_s: float = 15.0) -> None:
        self.db = db
        self.datasets = DatasetStore(db)
        self.jobs = JobStore(db)
        self.nodes = NodeStore(db, liveness_window_s=liveness_window_s)
        self.plans = PlanStore(db)
        self.metrics = MetricStore(db)
        self.access = AccessStore(db)
        self.quotas = QuotaStore(db)
        self.audit = AuditStore(db)
        self.retention = RetentionStore(db)
        self.leadership = LeadershipStore(db)

    @classmethod
    def open(cls, db_url: str, *, liveness_window_s: float = 15.0, pool_size: int = 8) -> "MetadataStore":
        """Connects lazily: nothing touches the database until the first operation."""
        engine = create_db_engine(db_url, EngineOptions(pool_size=pool_size))
        return cls(Database(engine), liveness_window_s=liveness_window_s)

    def close(self) -> None:
        self.db.dispose()


__all__ = ["MetadataStore", "AccessStore", "AuditStore", "DatasetStore", "JobStore", "LeadershipStore", "MetricStore", "NodeStore", "PlanStore"]
