"""silod/manifest.py hands s3fs real booleans: ``--option anon=false`` must not list anonymously."""

from __future__ import annotations

import fsspec
import pytest

from silod import manifest


class _Listed(Exception):
    pass


@pytest.fixture
def seen(monkeypatch):
    captured: dict = {}

    def fake_url_to_fs(uri, **options):
        captured.update(options)
        raise _Listed  # stop before any network access

    monkeypatch.setattr(fsspec.core, "url_to_fs", fake_url_to_fs)
    return captured


@pytest.mark.parametrize("text, expected", [("false", False), ("False", False), ("0", False), ("true", True), ("yes", True)])
def test_s3_boolean_options_are_parsed(seen, text, expected):
    with pytest.raises(manifest.ManifestError):
        list(manifest.list_objects("s3://bucket/prefix", {"anon": text, "endpoint_url": "http://127.0.0.1:1"}))
    assert seen["anon"] is expected
    assert seen["endpoint_url"] == "http://127.0.0.1:1"  # other options pass through as strings


def test_bad_boolean_names_the_option(seen):
    with pytest.raises(manifest.ManifestError, match=r"storage_options\.anon"):
        list(manifest.list_objects("s3://bucket/prefix", {"anon": "maybe"}))
    assert seen == {}  # refused before fsspec saw it


def test_file_options_untouched(seen):
    with pytest.raises(manifest.ManifestError):
        list(manifest.list_objects("file:///tmp", {"auto_mkdir": "false"}))
    assert seen == {"auto_mkdir": "false"}
