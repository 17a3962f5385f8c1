"""Fixture bodies shared by several test packages (each conftest re-exports what it uses)."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import pytest

from tests.metadata.metadata_harness import PostgresScratch
from tests.support.procs import ServiceProcess, start_service


def postgres_scratch() -> Iterator[PostgresScratch]:
    """Throw-away databases on the test PostgreSQL; skipped locally if it is down, a failure under CI=true."""
    reason = PostgresScratch.unreachable_reason()
    if reason is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{reason}; CI must test the PostgreSQL backend (start PostgreSQL or fix SILOD_TEST_PG_*)")
        pytest.skip(reason)
    scratch = PostgresScratch()
    try:
        yield scratch
    finally:
        scratch.drop_all()


@pytest.fixture(scope="session")
def metadata_proc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    """One real ``silod metadata`` process (SQLite) for the whole session."""
    workdir = tmp_path_factory.mktemp("metadata")
    with start_service("metadata", "--db", f"sqlite:///{workdir / 'meta.db'}", "--log-level", "warning",
                       workdir=workdir) as proc:
        yield proc


@pytest.fixture(scope="session")
def metadata(metadata_proc: ServiceProcess) -> str:
    return metadata_proc.address


@pytest.fixture(autouse=True)
def _quiet_werkzeug() -> None:
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's S3 server logs every request
