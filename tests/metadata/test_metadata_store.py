"""The store layer directly (no gRPC), on both databases: what the RPC tests cannot see."""

from __future__ import annotations

import time
from datetime import datetime, timezone

import pytest
from sqlalchemy import select

from services.metadata.models import Job, UtcDateTime
from services.metadata.store import MetadataStore
from services.metadata.validation.datasets import Manifest
from silod.v1 import common_pb2, metadata_pb2 as m
from tests.metadata.metadata_harness import InProcessServer
from tests.metadata.metadata_samples import dataset_spec, objects, registration, training_spec


def test_timestamps_come_back_timezone_aware_utc(store: MetadataStore):
    job = store.jobs.create(training_spec())
    with store.db.read() as session:
        row = session.scalars(select(Job).where(Job.id == job.id)).one()
    assert row.created_at.tzinfo is not None and row.created_at.utcoffset().total_seconds() == 0
    assert abs((datetime.now(timezone.utc) - row.created_at).total_seconds()) < 30


def test_naive_datetimes_are_refused_before_they_reach_the_database():
    with pytest.raises(ValueError, match="naive"):
        UtcDateTime().process_bind_param(datetime(2030, 1, 1), dialect=None)  # type: ignore[arg-type]


def test_job_spec_is_stored_as_json_with_proto_field_names(store: MetadataStore):
    job = store.jobs.create(training_spec(env={"OMP_NUM_THREADS": "4"}), "req-json")
    with store.db.read() as session:
        row = session.scalars(select(Job).where(Job.id == job.id)).one()
    assert row.spec["min_gpus"] == 1 and row.spec["env"] == {"OMP_NUM_THREADS": "4"}
    assert (row.tenant, row.application, row.kind, row.state) == ("alice", "cifar10", 1, 1)


def test_manifest_keys_are_ordered_by_code_point_on_both_databases(store: MetadataStore):
    keys = ["b", "B", "a", "_x", "Z", "é", "a/b", "a-b", "a.b", "10", "9"]
    manifest = Manifest()
    manifest.add(common_pb2.DatasetObject(key=key, size_bytes=1, etag="e") for key in keys)
    store.datasets.register(dataset_spec("order"), manifest, replace=False)
    listed, _, _ = store.datasets.list_objects("order")
    assert [o.key for o in listed] == sorted(keys)
    # Paging with a tiny page crosses every boundary and still agrees.
    paged, token = [], ""
    while True:
        page, token, _ = store.datasets.list_objects("order", page_size=2, page_token=token)
        paged += [o.key for o in page]
        if not token:
            break
    assert paged == sorted(keys)


def test_hundred_thousand_object_manifest_registers_in_seconds(server: InProcessServer):
    manifest = objects(100_000)
    started = time.monotonic()
    dataset = server.stub.RegisterDataset(registration(dataset_spec("big"), manifest), timeout=120)
    registered_s = time.monotonic() - started
    assert dataset.num_objects == 100_000
    replaced = server.stub.RegisterDataset(registration(dataset_spec("big"), manifest[:50_000], replace=True), timeout=120)
    assert (replaced.manifest_version, replaced.num_objects) == (2, 50_000)
    page = server.stub.ListDatasetObjects(m.ListDatasetObjectsRequest(name="big", page_size=10_000))
    assert len(page.objects) == 10_000 and page.manifest_version == 2
    assert registered_s < 15, f"registering 100k objects took {registered_s:.1f}s"
