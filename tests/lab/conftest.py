"""The lab's longer fault scenarios (a 30 s partition of the control hosts, test_lab.py; a 30 s
partition of the leading scheduler's host, test_lab_ha.py) run with `make lab-test`
(SILOD_LAB_FULL=1), not in `make test`.

They are deselected, not skipped: `make test` runs a representative subset of the lab by design
(docs/development.md), and a skip would read as a part that could not run here."""

from __future__ import annotations

import os

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "lab_full: a long lab scenario, run by `make lab-test` (SILOD_LAB_FULL=1)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("SILOD_LAB_FULL") == "1":
        return
    long = [item for item in items if item.get_closest_marker("lab_full")]
    if long:
        config.hook.pytest_deselected(items=long)
        items[:] = [item for item in items if not item.get_closest_marker("lab_full")]
