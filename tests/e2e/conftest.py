"""Fixtures: a whole cluster of real processes (see harness.py) on SQLite or PostgreSQL."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.e2e.harness import Cluster
from tests.metadata.metadata_harness import PostgresScratch
from tests.support.fixtures import postgres_scratch


@pytest.fixture(scope="session")
def e2e_postgres() -> Iterator[PostgresScratch]:
    yield from postgres_scratch()


@pytest.fixture
def make_cluster(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Callable[..., Cluster]]:
    """``make_cluster(db="sqlite"|"postgresql", **options)``; every cluster made is stopped at the end."""
    made: list[Cluster] = []

    def make(db: str = "sqlite", **options: object) -> Cluster:
        if db == "sqlite":
            url = f"sqlite:///{tmp_path / 'metadata.db'}"
        else:
            # Requested lazily so that the SQLite cases never depend on PostgreSQL being up.
            url = request.getfixturevalue("e2e_postgres").create()
        made.append(Cluster(tmp_path / f"cluster-{len(made)}", url, **options))  # type: ignore[arg-type]
        return made[-1]

    yield make
    for cluster in made:
        cluster.close()
