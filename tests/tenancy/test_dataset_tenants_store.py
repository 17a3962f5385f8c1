"""Datasets owned by tenants, in the store, on SQLite and PostgreSQL: migration 0008 keeps every
dataset and manifest in place and makes them shared (tenant `default`'s, readable by all), a
downgrade and a second upgrade lose nothing; a registration records its tenant, a listing for a
tenant shows its datasets and the shared ones, and a replacement keeps the tenant.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from alembic import command
from silod.v1 import common_pb2

from services.metadata.migrate import _config, upgrade
from services.metadata.database import EngineOptions, create_db_engine
from services.metadata.store import MetadataStore
from services.metadata.validation.datasets import Manifest
from services.runtime.errors import FailedPrecondition, InvalidArgument
from tests.metadata.metadata_harness import PostgresScratch
from tests.metadata.metadata_samples import dataset_spec, objects, training_spec
from tests.tenancy.old_datasets import write_old_dataset


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'md.db'}"
    postgres: PostgresScratch = request.getfixturevalue("postgres")
    return postgres.create()


def _downgrade(url: str, revision: str) -> None:
    engine = create_db_engine(url, EngineOptions(pool_size=1))
    try:
        with engine.begin() as connection:
            config = _config()
            config.attributes["connection"] = connection
            command.downgrade(config, revision)
    finally:
        engine.dispose()


def _store(url: str) -> Iterator[MetadataStore]:
    store = MetadataStore.open(url)
    try:
        yield store
    finally:
        store.close()


def test_existing_datasets_become_shared_and_keep_their_manifests(url: str) -> None:
    upgrade(url, "0007")
    for store in _store(url):
        before = {name: write_old_dataset(store.db.engine, name, count) for name, count in (("imgs", 1200), ("text", 3))}
        job = store.jobs.create(training_spec(tenant="vision", dataset="imgs"))
    upgrade(url)
    for attempt in ("upgraded", "downgraded to 0007 and upgraded again"):
        for store in _store(url):
            for name, (dataset, manifest) in before.items():
                assert store.datasets.get(name) == dataset, attempt
                listed, token, version = store.datasets.list_objects(name, page_size=10_000)
                assert (listed, token, version) == (manifest, "", 1), attempt
                assert store.datasets.owner(name) == ("default", True)
            # Shared: every tenant's listing shows them; the job of tenant `vision` may still name imgs.
            assert [d.spec.name for d in store.datasets.list(tenant="vision")[0]] == ["imgs", "text"]
            assert store.datasets.job_dataset(job.id) == "imgs"
        _downgrade(url, "0007")
        upgrade(url)


def _register(store: MetadataStore, name: str, *, replace: bool = False, count: int = 3,
              **fields: object) -> common_pb2.Dataset:
    manifest = Manifest()
    manifest.add(objects(count, prefix=f"{name}/"))
    spec = dataset_spec(name, **fields)
    store.datasets.check_registrable(spec, replace)
    return store.datasets.register(spec, manifest, replace=replace)


def test_tenants_of_registered_datasets(url: str) -> None:
    upgrade(url)
    for store in _store(url):
        assert _register(store, "a-imgs", tenant="alpha").spec.tenant == "alpha"
        _register(store, "b-imgs", tenant="beta")
        common = _register(store, "common", shared=True)  # an admin's, naming no tenant: default's
        assert (common.spec.tenant, common.spec.shared) == ("default", True)
        assert [d.spec.name for d in store.datasets.list(tenant="alpha")[0]] == ["a-imgs", "common"]
        assert [d.spec.name for d in store.datasets.list(tenant="beta")[0]] == ["b-imgs", "common"]
        assert [d.spec.name for d in store.datasets.list()[0]] == ["a-imgs", "b-imgs", "common"]
        page, token = store.datasets.list(page_size=1, tenant="beta")
        assert [d.spec.name for d in page] == ["b-imgs"] and token
        assert [d.spec.name for d in store.datasets.list(page_size=1, page_token=token, tenant="beta")[0]] == ["common"]

        # A replacement keeps the tenant: naming another is refused before the stream and at the write.
        with pytest.raises(FailedPrecondition) as refused:
            store.datasets.check_registrable(dataset_spec("a-imgs", tenant="beta"), True)
        assert refused.value.violations[0].field == "spec.tenant"
        with pytest.raises(FailedPrecondition):
            store.datasets.register(dataset_spec("a-imgs", tenant="beta"), Manifest(), replace=True)
        assert store.datasets.get("a-imgs").manifest_version == 1
        replaced = _register(store, "a-imgs", replace=True, count=5)  # empty tenant: kept
        assert (replaced.spec.tenant, replaced.manifest_version, replaced.num_objects) == ("alpha", 2, 5)
        # Sharing on a replacement sticks; a replacement that does not say so never unshares.
        assert _register(store, "a-imgs", replace=True, shared=True).spec.shared
        assert _register(store, "a-imgs", replace=True, tenant="alpha").spec.shared
        assert store.datasets.owner("a-imgs") == ("alpha", True) and store.datasets.owner("nope") is None

        with pytest.raises(InvalidArgument) as bad:
            store.datasets.check_registrable(dataset_spec("x", tenant="no spaces allowed"), False)
        assert bad.value.violations[0].field == "spec.tenant"
        job = store.jobs.create(training_spec(tenant="alpha", dataset="a-imgs"))
        assert store.datasets.job_dataset(job.id) == "a-imgs" and store.datasets.job_dataset("job-000000000000") is None
