"""Datasets as a cluster from before dataset tenants (schema below 0008) wrote them: rows without
the ``tenant`` and ``shared`` columns, written with SQL (today's store writes those columns)."""

from __future__ import annotations

from datetime import datetime, timezone

import sqlalchemy as sa
from silod.v1 import common_pb2

from services.metadata.models import Dataset, DatasetObject
from tests.metadata.metadata_samples import objects

_DATASETS = sa.table("datasets", *(sa.column(c, Dataset.__table__.c[c].type) for c in (
    "name", "uri", "storage_options", "description", "manifest_version", "num_objects", "total_bytes",
    "registered_at", "updated_at")))
_OBJECTS = DatasetObject.__table__  # unchanged by 0008


def write_old_dataset(engine: sa.Engine, name: str, count: int) -> tuple[common_pb2.Dataset, list[common_pb2.DatasetObject]]:
    """Write dataset ``name`` with ``count`` objects; what an upgraded cluster must read back: the same
    dataset, now tenant ``default``'s and shared with every tenant, and its manifest."""
    manifest = objects(count, prefix=f"{name}/")
    at = datetime(2026, 11, 1, tzinfo=timezone.utc)
    with engine.begin() as connection:
        connection.execute(_DATASETS.insert().values(
            name=name, uri=f"s3://datasets/{name}", storage_options={"anon": "true"}, description="before tenants",
            manifest_version=1, num_objects=count, total_bytes=sum(o.size_bytes for o in manifest),
            registered_at=at, updated_at=at))
        connection.execute(_OBJECTS.insert(), [{"dataset_name": name, "manifest_version": 1, "key": o.key,
                                                "size_bytes": o.size_bytes, "etag": o.etag} for o in manifest])
    dataset = common_pb2.Dataset(
        spec=common_pb2.DatasetSpec(name=name, uri=f"s3://datasets/{name}", storage_options={"anon": "true"},
                                    description="before tenants", tenant="default", shared=True),
        num_objects=count, total_bytes=sum(o.size_bytes for o in manifest), manifest_version=1)
    dataset.registered_at.FromDatetime(at)
    dataset.updated_at.FromDatetime(at)
    return dataset, manifest
