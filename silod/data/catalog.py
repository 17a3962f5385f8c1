"""A registered dataset's manifest, loaded from the metadata service (GetDataset + paged
ListDatasetObjects), in a compact form both the SDK and the cache server use."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import grpc

from silod.data.keys import key_problem

PAGE_SIZE = 10000  # the metadata service's maximum
_MAX_RESTARTS = 5  # a manifest replaced while we page restarts the listing; give up after this many


@dataclass
class Manifest:
    name: str
    uri: str
    storage_options: dict[str, str]
    version: int
    keys: list[str]
    sizes: list[int]
    etags: list[str]
    index: dict[str, int] = field(default_factory=dict)  # key -> position
    total_bytes: int = 0

    def __post_init__(self) -> None:
        if not self.index:
            self.index = {key: i for i, key in enumerate(self.keys)}
        self.total_bytes = sum(self.sizes)

    def __len__(self) -> int:
        return len(self.keys)


class ManifestNotFound(LookupError):
    """No dataset of that name is registered."""


def _build(dataset: Any, pages: list[Any]) -> Manifest:
    keys: list[str] = []
    sizes: list[int] = []
    etags: list[str] = []
    for page in pages:
        for obj in page.objects:
            if key_problem(obj.key) is not None:  # the metadata store rejects these; do not trust blindly
                continue
            keys.append(obj.key)
            sizes.append(int(obj.size_bytes))
            etags.append(obj.etag)
    version = pages[0].manifest_version if pages else dataset.manifest_version
    return Manifest(
        name=dataset.spec.name,
        uri=dataset.spec.uri,
        storage_options=dict(dataset.spec.storage_options),
        version=int(version),
        keys=keys,
        sizes=sizes,
        etags=etags,
    )


def load_manifest(stub: Any, name: str, timeout_s: float = 60.0) -> Manifest:
    """Load ``name`` with a sync MetadataServiceStub; raises ManifestNotFound or grpc.RpcError."""
    from silod.v1 import metadata_pb2

    for _ in range(_MAX_RESTARTS):
        try:
            dataset = stub.GetDataset(metadata_pb2.GetDatasetRequest(name=name), timeout=timeout_s)
            pages, token = [], ""
            while True:
                page = stub.ListDatasetObjects(
                    metadata_pb2.ListDatasetObjectsRequest(name=name, page_size=PAGE_SIZE, page_token=token),
                    timeout=timeout_s,
                )
                if pages and page.manifest_version != pages[0].manifest_version:
                    raise _Replaced()
                pages.append(page)
                token = page.next_page_token
                if not token:
                    return _build(dataset, pages)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                raise ManifestNotFound(exc.details() or name) from None
            if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:  # replaced while paging: restart
                raise
        except _Replaced:
            pass
    raise RuntimeError(f"dataset {name!r}: manifest kept being replaced while it was read")


async def load_manifest_async(stub: Any, name: str, timeout_s: float = 60.0) -> Manifest:
    """:func:`load_manifest` with a grpc.aio MetadataServiceStub."""
    from silod.v1 import metadata_pb2

    for _ in range(_MAX_RESTARTS):
        try:
            dataset = await stub.GetDataset(metadata_pb2.GetDatasetRequest(name=name), timeout=timeout_s)
            pages, token = [], ""
            while True:
                page = await stub.ListDatasetObjects(
                    metadata_pb2.ListDatasetObjectsRequest(name=name, page_size=PAGE_SIZE, page_token=token),
                    timeout=timeout_s,
                )
                if pages and page.manifest_version != pages[0].manifest_version:
                    raise _Replaced()
                pages.append(page)
                token = page.next_page_token
                if not token:
                    return _build(dataset, pages)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                raise ManifestNotFound(exc.details() or name) from None
            if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise
        except _Replaced:
            pass
    raise RuntimeError(f"dataset {name!r}: manifest kept being replaced while it was read")


class _Replaced(Exception):
    pass
