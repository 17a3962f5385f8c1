"""GPU types in the metadata store: nodes carry one (a column, migrated from the stored specs),
ListNodes filters by it, and job specs name the types they may run on."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import pytest
import sqlalchemy as sa

from services.metadata.database import create_db_engine
from services.metadata.migrate import upgrade
from services.metadata.store import MetadataStore
from services.runtime.errors import InvalidArgument
from tests.metadata.metadata_samples import node_spec, training_spec


def test_nodes_are_listed_by_gpu_type(store: MetadataStore) -> None:
    store.nodes.upsert(node_spec("a-0", gpu_type="a100"))
    store.nodes.upsert(node_spec("a-1", gpu_type="a100"))
    store.nodes.upsert(node_spec("v-0", gpu_type="v100"))
    store.nodes.upsert(node_spec("plain"))
    assert [n.spec.name for n in store.nodes.list(gpu_type="a100")] == ["a-0", "a-1"]
    assert [n.spec.name for n in store.nodes.list(gpu_type="v100")] == ["v-0"]
    assert len(store.nodes.list()) == 4
    assert store.nodes.get("v-0").spec.gpu_type == "v100"
    store.nodes.upsert(node_spec("v-0", gpu_type="h100"))  # a node re-registered with new GPUs
    assert [n.spec.name for n in store.nodes.list(gpu_type="h100")] == ["v-0"]
    assert store.nodes.list(gpu_type="v100") == []


@pytest.mark.parametrize("bad", ["A100", "-a100", "a" * 33, "a 100", "a100\u00e9"])
def test_a_node_gpu_type_outside_the_rule_is_refused_naming_the_field(store: MetadataStore, bad: str) -> None:
    with pytest.raises(InvalidArgument) as refused:
        store.nodes.upsert(node_spec("n1", gpu_type=bad))
    assert refused.value.field == "spec.gpu_type"
    with pytest.raises(InvalidArgument) as refused:
        store.nodes.list(gpu_type=bad)
    assert refused.value.field == "gpu_type"


def test_job_gpu_types_are_kept_and_checked(store: MetadataStore) -> None:
    spec = training_spec()
    spec.gpu_types[:] = ["a100", "h100"]
    job = store.jobs.create(spec)
    assert list(store.jobs.get(job.id).spec.gpu_types) == ["a100", "h100"]
    for bad, field in ((["a100", "a100"], "spec.gpu_types"), (["a100", "V100"], "spec.gpu_types[1]"),
                       ([f"t{i}" for i in range(17)], "spec.gpu_types")):
        spec.gpu_types[:] = bad
        with pytest.raises(InvalidArgument) as refused:
            store.jobs.create(spec)
        assert refused.value.field == field


def test_migration_0002_takes_each_node_type_from_its_stored_spec(tmp_path) -> None:  # type: ignore[no-untyped-def]
    url = f"sqlite:///{tmp_path / 'old.db'}"
    upgrade(url, "0001")
    engine = create_db_engine(url)
    now = datetime(2026, 11, 1, tzinfo=timezone.utc).replace(tzinfo=None)
    with engine.begin() as connection:
        for name, spec in (("typed", {"name": "typed", "gpus": 4, "gpu_type": "v100"}), ("old", {"name": "old"})):
            connection.execute(sa.text(
                "INSERT INTO nodes (name, pool, spec, registered_at, last_heartbeat, applied_plan_version) "
                "VALUES (:name, 1, :spec, :now, :now, 0)"), {"name": name, "spec": json.dumps(spec), "now": now})
    engine.dispose()
    upgrade(url)
    store = MetadataStore.open(url)
    try:
        assert [n.spec.name for n in store.nodes.list(gpu_type="v100")] == ["typed"]
        assert store.nodes.get("old").spec.gpu_type == ""
    finally:
        store.close()
