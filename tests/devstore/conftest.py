"""Fixtures of the store-emulator tests: one real ``silod metadata`` process per session (tests/support/fixtures.py)."""

from tests.support.fixtures import _quiet_werkzeug, metadata, metadata_proc

__all__ = ["_quiet_werkzeug", "metadata", "metadata_proc"]
