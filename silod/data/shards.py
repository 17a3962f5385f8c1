"""Datasets stored as WebDataset-style tar shards, read sample by sample.

A sharded dataset's manifest lists **samples**, not shards. At registration
(``silod dataset register NAME URI --format tar-shards``) every ``.tar`` object below the URI
is read once and indexed; each sample becomes one manifest entry whose key names the byte
range it occupies in its shard::

    shards/train-0003.tar#000001048576+116224:n01440764_10026

``<shard key>#<offset>+<length>:<sample name>``, size = length, version tag = the shard's
(S3 ETag, or the file tag). The index therefore lives in the metadata plane with the rest of
the manifest, and everything built on manifest entries works on samples unchanged: the cache
server caches, leases, prefetches and rate-limits samples; a read is a ranged GET of the shard
carrying ``If-Match`` on the shard's version, so a replaced shard is refused as a replaced
object is. Caching is per sample, so with uniform caching the hit ratio is the cached fraction
of the samples, exactly as for a per-sample dataset; the epoch shuffle reads samples in any
order.

A sample is what WebDataset calls one: the consecutive members of a shard that share a base
name (``0001.jpg`` + ``0001.cls``); its range runs from the first member's tar header to the
end of the last member's data, so the bytes are a small tar stream in themselves.
:func:`decode_sample` turns them into ``{"__key__": name, "jpg": bytes, "cls": bytes}``.
"""

from __future__ import annotations

import io
import re
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

_SAMPLE_KEY = re.compile(r"^(?P<shard>.+?\.tar)#(?P<offset>\d+)\+(?P<length>\d+):(?P<sample>.*)$", re.DOTALL)
# WebDataset's rule: the base name is everything before the first dot of the last path component.
_BASE_EXT = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")
SHARD_SUFFIX = ".tar"
OFFSET_DIGITS = 12  # shards up to 1 TB


class ShardError(ValueError):
    """A shard that cannot be indexed (not a tar archive, truncated, changed while indexed)."""


@dataclass(frozen=True)
class SampleRange:
    shard: str  # the shard's key below the dataset root
    offset: int  # of the first member's tar header
    length: int  # up to the end of the last member's data
    sample: str  # WebDataset key (base name shared by the members)

    @property
    def key(self) -> str:
        # Offsets zero-padded: manifests are kept sorted by key, and so stay in shard order.
        return f"{self.shard}#{self.offset:0{OFFSET_DIGITS}d}+{self.length}:{self.sample}"


def parse_sample_key(key: str) -> SampleRange | None:
    """The byte range a sample key names, or None for a plain object key."""
    match = _SAMPLE_KEY.match(key)
    if match is None:
        return None
    return SampleRange(match["shard"], int(match["offset"]), int(match["length"]), match["sample"])


def _base_and_ext(name: str) -> tuple[str, str]:
    match = _BASE_EXT.match(name)
    return (match[1], match[2]) if match else (name, "")


def index_tar(stream: IO[bytes], shard: str) -> list[SampleRange]:
    """Samples of one tar shard, read sequentially from ``stream`` (one pass, no seeks)."""
    samples: list[SampleRange] = []
    current: list[Any] = []  # [base, first header offset, end of data]
    try:
        with tarfile.open(fileobj=stream, mode="r|") as archive:
            for member in archive:
                if not member.isfile():
                    continue
                base, _ = _base_and_ext(member.name)
                end = member.offset_data + member.size
                if current and current[0] == base:
                    current[2] = end
                else:
                    if current:
                        samples.append(SampleRange(shard, current[1], current[2] - current[1], current[0]))
                    current = [base, member.offset, end]
    except tarfile.TarError as exc:
        raise ShardError(f"shard {shard!r} is not a readable tar archive: {exc}") from None
    if current:
        samples.append(SampleRange(shard, current[1], current[2] - current[1], current[0]))
    return samples


def decode_sample(data: bytes) -> dict[str, Any]:
    """A sample's bytes (its members' tar headers and data) as ``{"__key__": base, ext: bytes}``."""
    sample = _decode_ustar(data)
    if sample is not None:
        return sample
    return _decode_with_tarfile(data)


_BLOCK = 512
_REGULAR = (b"0", b"\0")  # typeflags of a regular file (b"\0": pre-POSIX tar)


def _decode_ustar(data: bytes) -> dict[str, Any] | None:
    """The common case read straight from the 512-byte headers (a sample is read once per
    epoch, and tarfile costs more per sample than reading the sample's bytes): plain ustar
    members of regular files. None for anything else (pax or GNU long names, sparse files,
    bad checksums ...): tarfile then decodes it."""
    sample: dict[str, Any] = {}
    view = memoryview(data)
    offset, end = 0, len(data)
    while offset < end:
        if end - offset < _BLOCK:
            return None
        header = data[offset : offset + _BLOCK]
        if header[156:157] not in _REGULAR or header[257:262] != b"ustar":
            return None
        try:
            size = int(header[124:136].rstrip(b"\0 ").lstrip(b" ") or b"0", 8)
            checksum = int(header[148:156].rstrip(b"\0 ").lstrip(b" ") or b"0", 8)
        except ValueError:
            return None
        # The checksum: the header's bytes summed with its checksum field counted as spaces.
        if checksum != sum(header) - sum(header[148:156]) + 8 * 32:
            return None
        name = header[0:100].split(b"\0", 1)[0]
        prefix = header[345:500].split(b"\0", 1)[0]
        if prefix:
            name = prefix + b"/" + name
        start = offset + _BLOCK
        if start + size > end:
            return None
        base, ext = _base_and_ext(name.decode("utf-8", "surrogateescape"))
        sample.setdefault("__key__", base)
        sample[ext] = bytes(view[start : start + size])
        offset = start + size + (-size % _BLOCK)
    return sample if sample else None


def _decode_with_tarfile(data: bytes) -> dict[str, Any]:
    # Padded to whole blocks plus the end-of-archive marker: the bytes then form a complete tar.
    padded = data + b"\0" * (-len(data) % tarfile.BLOCKSIZE + 2 * tarfile.BLOCKSIZE)
    sample: dict[str, Any] = {}
    with tarfile.open(fileobj=io.BytesIO(padded), mode="r:") as archive:
        for member in archive:
            if not member.isfile():
                continue
            base, ext = _base_and_ext(member.name)
            sample.setdefault("__key__", base)
            extracted = archive.extractfile(member)
            assert extracted is not None  # a regular file always has a payload
            sample[ext] = extracted.read()
    return sample


def sample_objects(uri: str, storage_options: dict[str, str] | None = None) -> Iterator[Any]:
    """The manifest of a sharded dataset: one DatasetObject per sample of every ``.tar`` below
    ``uri``, in shard order then offset order. Each shard is read once; if its version changed
    while it was read, registration fails (its index would describe other bytes)."""
    import fsspec

    from silod.data.storage_options import version_tag
    from silod.manifest import ManifestError, _fsspec_options, list_objects
    from silod.v1 import common_pb2

    shards = [obj for obj in list_objects(uri, storage_options) if obj.key.endswith(SHARD_SUFFIX)]
    if not shards:
        raise ManifestError(f"uri: no {SHARD_SUFFIX} shards below {uri!r} (--format tar-shards)")
    scheme = uri.split("://", 1)[0]
    fs, root = fsspec.core.url_to_fs(uri, **_fsspec_options(scheme, dict(storage_options or {})))
    root = root.rstrip("/")
    for shard in shards:
        path = f"{root}/{shard.key}"
        try:
            with fs.open(path, "rb", block_size=8 << 20) as stream:
                samples = index_tar(stream, shard.key)
            fs.invalidate_cache(path)
            info = fs.info(path)
        except ShardError as exc:
            raise ManifestError(f"uri: {exc}") from None
        except Exception as exc:  # fsspec backends raise many kinds; report them uniformly
            raise ManifestError(f"uri: cannot read shard {shard.key!r} of {uri!r}: {exc}") from exc
        if version_tag(info) != shard.etag:
            raise ManifestError(f"uri: shard {shard.key!r} changed while it was indexed; register again")
        for sample in samples:
            yield common_pb2.DatasetObject(key=sample.key, size_bytes=sample.length, etag=shard.etag)
