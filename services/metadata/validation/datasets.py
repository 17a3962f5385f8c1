"""Validation of dataset specs and streamed manifests."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field as dataclass_field

from silod.v1 import common_pb2

from services.metadata.validation.common import check_identifier, check_string_map, check_text
from silod.rpc.identifiers import DATASET_NAME, TENANT
from services.runtime.errors import InvalidArgument, Problems

SUPPORTED_SCHEMES = ("file", "s3")
MAX_OBJECT_BYTES = 2**50
MAX_KEY_BYTES = 1024  # S3's own limit, in UTF-8 bytes; also keeps PostgreSQL index entries small
MAX_ETAG_CHARS = 256
# The manifest is held in memory until the stream closes (it becomes visible atomically).
MAX_MANIFEST_OBJECTS = 5_000_000
_WINDOWS_DRIVE = re.compile(r"[A-Za-z]:[\\/]")


def check_dataset_spec(spec: common_pb2.DatasetSpec, field: str = "spec") -> None:
    """Refused with every problem of ``spec`` at once."""
    problems = Problems()
    problems.check(check_identifier, spec.name, DATASET_NAME, f"{field}.name")
    problems.check(check_identifier, spec.tenant, TENANT, f"{field}.tenant", required=False)
    scheme, separator, rest = spec.uri.partition("://")
    if not separator or scheme not in SUPPORTED_SCHEMES or not rest:
        problems.add(
            f"{field}.uri",
            f"must start with one of {', '.join(s + '://' for s in SUPPORTED_SCHEMES)} and name a location, "
            f"got {spec.uri[:80]!r}",
        )
    problems.check(check_text, spec.uri, f"{field}.uri", max_chars=4096)
    problems.check(check_string_map, spec.storage_options, f"{field}.storage_options", max_entries=64)
    problems.check(check_text, spec.description, f"{field}.description", max_chars=4096)
    problems.raise_if_any()


def check_object_key(key: str, field: str) -> None:
    if not key:
        raise InvalidArgument("must not be empty", field=field)
    if "\x00" in key:
        raise InvalidArgument("must not contain NUL characters", field=field)
    if len(key.encode("utf-8", "surrogatepass")) > MAX_KEY_BYTES:
        raise InvalidArgument(f"longer than {MAX_KEY_BYTES} bytes (UTF-8)", field=field)
    if key.startswith(("/", "\\")) or _WINDOWS_DRIVE.match(key):
        raise InvalidArgument(f"must be relative to the dataset root, got {key[:80]!r}", field=field)
    if ".." in re.split(r"[/\\]", key):
        raise InvalidArgument(f'must not contain a ".." segment, got {key[:80]!r}', field=field)


@dataclass
class Manifest:
    """The validated objects of one registration stream, in arrival order."""

    keys: list[str] = dataclass_field(default_factory=list)
    sizes: list[int] = dataclass_field(default_factory=list)
    etags: list[str] = dataclass_field(default_factory=list)
    total_bytes: int = 0
    _seen: set[str] = dataclass_field(default_factory=set, repr=False)

    def __len__(self) -> int:
        return len(self.keys)

    def add(self, objects: Iterable[common_pb2.DatasetObject]) -> None:
        """Validate and append one streamed chunk; indices in errors count across the stream."""
        for obj in objects:
            index = len(self.keys)
            field = f"objects[{index}]"
            if index >= MAX_MANIFEST_OBJECTS:
                raise InvalidArgument(f"a manifest holds at most {MAX_MANIFEST_OBJECTS} objects", field="objects")
            check_object_key(obj.key, f"{field}.key")
            if obj.key in self._seen:
                raise InvalidArgument(f"duplicate key {obj.key[:80]!r} (keys must be unique in a manifest)", field=f"{field}.key")
            if not 0 <= obj.size_bytes <= MAX_OBJECT_BYTES:
                raise InvalidArgument(f"must be in 0..{MAX_OBJECT_BYTES}, got {obj.size_bytes}", field=f"{field}.size_bytes")
            if not obj.etag:
                raise InvalidArgument("must not be empty", field=f"{field}.etag")
            if "\x00" in obj.etag:
                raise InvalidArgument("must not contain NUL characters", field=f"{field}.etag")
            if len(obj.etag) > MAX_ETAG_CHARS:
                raise InvalidArgument(f"must be at most {MAX_ETAG_CHARS} characters", field=f"{field}.etag")
            self._seen.add(obj.key)
            self.keys.append(obj.key)
            self.sizes.append(obj.size_bytes)
            self.etags.append(obj.etag)
            self.total_bytes += obj.size_bytes
