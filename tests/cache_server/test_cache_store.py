"""Store access without any service: verified reads, containment, retries, options."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from silod.data.keys import key_problem
from silod.data.store import (
    ObjectChanged,
    ObjectMissing,
    ObjectOutsideRoot,
    ObjectStore,
    StoreConfigError,
    StoreUnavailable,
    file_version_tag,
)
from silod.manifest import list_objects


@pytest.mark.parametrize(
    ("key", "ok"),
    [
        ("a/b.bin", True),
        ("a..b/c", True),  # ".." inside a name is fine
        ("", False),
        ("../x", False),
        ("a/../../x", False),
        ("a/..", False),
        ("/etc/passwd", False),
        ("\\windows", False),
        ("a\x00b", False),
        ("x" * 1025, False),
    ],
)
def test_key_rules(key: str, ok: bool) -> None:
    assert (key_problem(key) is None) is ok


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / "root" / "a").mkdir(parents=True)
    (tmp_path / "root" / "a" / "f.bin").write_bytes(b"hello world")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret").write_bytes(b"secret!!!!!")  # same size as f.bin
    return tmp_path / "root"


def _manifest(root: Path) -> dict[str, tuple[int, str]]:
    return {o.key: (o.size_bytes, o.etag) for o in list_objects(f"file://{root}")}


def test_file_read_checks_the_manifest_version(root: Path) -> None:
    store = ObjectStore(f"file://{root}")
    size, etag = _manifest(root)["a/f.bin"]
    assert etag == file_version_tag(os.stat(root / "a" / "f.bin"))  # same tag as silod.manifest computes
    assert store.read("a/f.bin", size, etag) == b"hello world"
    (root / "a" / "f.bin").write_bytes(b"HELLO WORLD")
    os.utime(root / "a" / "f.bin", ns=(1, 1))  # rewritten: new mtime, same size
    with pytest.raises(ObjectChanged) as info:
        store.read("a/f.bin", size, etag)
    assert info.value.key == "a/f.bin" and info.value.expected == etag
    with pytest.raises(ObjectMissing):
        store.read("a/none.bin", 1, "x")


def test_file_read_refuses_paths_outside_the_root(root: Path, tmp_path: Path) -> None:
    store = ObjectStore(f"file://{root}")
    size, etag = _manifest(root)["a/f.bin"]
    for key in ("../outside/secret", "/etc/passwd", "a/../../outside/secret", "a\x00"):
        with pytest.raises(ObjectOutsideRoot):
            store.read(key)
    # A manifest file swapped for a symlink that leads out of the root.
    (root / "a" / "f.bin").unlink()
    (root / "a" / "f.bin").symlink_to(tmp_path / "outside" / "secret")
    with pytest.raises(ObjectOutsideRoot):
        store.read("a/f.bin", size, etag)
    # A directory of the key swapped for a symlink.
    (root / "a" / "f.bin").unlink()
    os.rename(root / "a", tmp_path / "a-moved")
    (root / "a").symlink_to(tmp_path / "outside")
    with pytest.raises(ObjectOutsideRoot):
        store.read("a/secret")
    # Symlinks that stay inside the root are fine.
    (root / "b").mkdir()
    (root / "b" / "real").write_bytes(b"ok")
    (root / "b" / "link").symlink_to(root / "b" / "real")
    assert store.read("b/link") == b"ok"


def test_transient_failures_are_retried_with_exponential_backoff(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sleeps: list[float] = []
    store = ObjectStore(f"file://{root}", retries=3, backoff_s=0.1, sleep=sleeps.append)
    real = store._read_file
    failures = iter([ConnectionResetError("reset"), TimeoutError("slow")])

    def flaky(key: str, etag: str, *byte_range: int) -> bytes:
        exc = next(failures, None)
        if exc is not None:
            raise exc
        return real(key, etag, *byte_range)

    monkeypatch.setattr(store, "_read_file", flaky)
    assert store.read("a/f.bin") == b"hello world"
    assert len(sleeps) == 2 and 0.05 <= sleeps[0] <= 0.1 and 0.1 <= sleeps[1] <= 0.2

    sleeps.clear()
    monkeypatch.setattr(store, "_read_file", lambda key, etag, *byte_range: (_ for _ in ()).throw(OSError(5, "EIO")))
    with pytest.raises(StoreUnavailable, match="after 4 attempts"):
        store.read("a/f.bin")
    assert len(sleeps) == 3 and sleeps[2] <= 0.4

    sleeps.clear()  # a bug is not retried
    monkeypatch.setattr(store, "_read_file", lambda key, etag, *byte_range: (_ for _ in ()).throw(TypeError("bug")))
    with pytest.raises(TypeError):
        store.read("a/f.bin")
    assert sleeps == []


def test_storage_options() -> None:
    with pytest.raises(StoreConfigError, match="storage_options.secret"):
        ObjectStore("s3://b/p", {"secret": "x"})
    with pytest.raises(StoreConfigError, match="storage_options.anon"):
        ObjectStore("s3://b/p", {"anon": "maybe"})
    store = ObjectStore("s3://b/p", {"anon": "true", "region": "eu-west-1", "endpoint_url": "http://127.0.0.1:1"})
    assert store._s3_kwargs["anon"] is True
    assert store._s3_kwargs["client_kwargs"] == {"region_name": "eu-west-1"}
    assert store._s3_kwargs["endpoint_url"] == "http://127.0.0.1:1"
    for bad in ("http://x/y", "file://relative", "s3://"):
        with pytest.raises(StoreConfigError):
            ObjectStore(bad)
