"""What the manifest lister (silod.manifest) and the store reader (silod.data.store) must agree
on: how a string storage option becomes a boolean, and the version tag of an object. A leaf
module, so that neither of them imports the other."""

from __future__ import annotations

from typing import Any

# s3fs options that are booleans; they arrive as strings (``--option anon=false``), and s3fs
# takes any non-empty string as true.
BOOL_OPTIONS = frozenset({"anon", "use_ssl", "requester_pays", "version_aware", "asynchronous"})
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})


def parse_bool_option(value: Any) -> bool:
    """``value`` as a boolean; ValueError for anything but the usual spellings of true and false."""
    lowered = str(value).strip().lower()
    if lowered not in _TRUE | _FALSE:
        raise ValueError(f"expected true or false, got {value!r}")
    return lowered in _TRUE


def version_tag(info: dict[str, Any]) -> str:
    """An object's version as listed by fsspec: its ETag, else size and modification time."""
    etag = info.get("ETag") or info.get("etag")
    if etag:
        return str(etag).strip('"')
    mtime = info.get("mtime") or info.get("LastModified") or info.get("created") or 0
    mtime_ns = int(float(mtime.timestamp() if hasattr(mtime, "timestamp") else mtime) * 1e9)
    return f"{int(info['size']):x}-{mtime_ns:x}"
