"""Fixtures of the tenancy tests: the test PostgreSQL (a failure under CI=true when it is down)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.metadata.metadata_harness import PostgresScratch
from tests.support.fixtures import postgres_scratch


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresScratch]:
    yield from postgres_scratch()
