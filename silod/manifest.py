"""Build a dataset manifest (keys, sizes, version tags) by listing the store through fsspec.

The same code lists ``file://`` directories and ``s3://`` buckets. S3 gives an ETag per
object; a local filesystem has none, so a file's tag is derived from its size and
modification time — it changes whenever the file is rewritten, which is what the cache
needs to notice a stale copy, without reading every byte of a large dataset.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import fsspec

from silod.data.storage_options import BOOL_OPTIONS, parse_bool_option, version_tag
from silod.v1 import common_pb2

SUPPORTED_SCHEMES = ("file", "s3")


class ManifestError(Exception):
    """The store cannot be listed (bad URI, missing directory, no permission)."""


def _fsspec_options(scheme: str, options: dict[str, str]) -> dict[str, Any]:
    """Storage options as fsspec wants them. They arrive as strings (``--option anon=false``),
    and s3fs takes any non-empty string as true, so its boolean options are parsed the way
    the cache server parses them (silod.data.store), or the listing would run anonymously
    while the reads are signed (or the other way round)."""
    if scheme != "s3":
        return dict(options)
    out: dict[str, Any] = {}
    for name, value in options.items():
        if name in BOOL_OPTIONS:
            try:
                out[name] = parse_bool_option(value)
            except ValueError as exc:
                raise ManifestError(f"storage_options.{name}: {exc}") from None
        else:
            out[name] = value
    return out


def list_objects(uri: str, storage_options: dict[str, str] | None = None) -> Iterator[common_pb2.DatasetObject]:
    """Yield one DatasetObject per file below ``uri``, keys relative to it, sorted by key."""
    scheme = uri.split("://", 1)[0] if "://" in uri else ""
    if scheme not in SUPPORTED_SCHEMES:
        raise ManifestError(f"uri: scheme must be one of {', '.join(s + '://' for s in SUPPORTED_SCHEMES)}, got {uri!r}")
    try:
        fs, root = fsspec.core.url_to_fs(uri, **_fsspec_options(scheme, dict(storage_options or {})))
        if not fs.isdir(root):
            raise ManifestError(f"uri: {uri!r} is not a directory or prefix that exists")
        listing = fs.find(root, detail=True)
    except ManifestError:
        raise
    except Exception as exc:  # fsspec backends raise many kinds; report them uniformly
        raise ManifestError(f"uri: cannot list {uri!r}: {exc}") from exc
    root = root.rstrip("/")
    for path in sorted(listing):
        info = listing[path]
        if info.get("type") != "file":
            continue
        key = path[len(root) :].lstrip("/")
        yield common_pb2.DatasetObject(key=key, size_bytes=int(info["size"]), etag=version_tag(info))
