"""Fixtures of the SDK data tests: one real ``silod metadata`` process per session."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.procs import ServiceProcess, start_service


@pytest.fixture(scope="session")
def metadata_proc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    workdir = tmp_path_factory.mktemp("metadata")
    with start_service("metadata", "--db", f"sqlite:///{workdir / 'meta.db'}", "--log-level", "warning",
                       workdir=workdir) as proc:
        yield proc


@pytest.fixture(scope="session")
def metadata(metadata_proc: ServiceProcess) -> str:
    return metadata_proc.address


@pytest.fixture(autouse=True)
def _quiet_werkzeug() -> None:
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
