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


def _page_request(name: str, token: str) -> Any:
    from silod.v1 import metadata_pb2

    return metadata_pb2.ListDatasetObjectsRequest(name=name, page_size=PAGE_SIZE, page_token=token)


def _add_page(pages: list[Any], page: Any) -> str:
    """Keep ``page``; the next page token ("" when done). _Replaced if the manifest changed mid-read."""
    if pages and page.manifest_version != pages[0].manifest_version:
        raise _Replaced()
    pages.append(page)
    return page.next_page_token


def _should_restart(exc: grpc.RpcError, name: str) -> bool:
    """True if the read must start over (manifest replaced while paging); raise otherwise."""
    if exc.code() == grpc.StatusCode.NOT_FOUND:
        raise ManifestNotFound(exc.details() or name) from None
    if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
        raise exc
    return True


def _kept_being_replaced(name: str) -> RuntimeError:
    return RuntimeError(f"dataset {name!r}: manifest kept being replaced while it was read")


def load_manifest(stub: Any, name: str, timeout_s: float = 60.0) -> Manifest:
    """Load ``name`` with a sync MetadataServiceStub; raises ManifestNotFound or grpc.RpcError."""
    from silod.v1 import metadata_pb2

    for _ in range(_MAX_RESTARTS):
        try:
            dataset = stub.GetDataset(metadata_pb2.GetDatasetRequest(name=name), timeout=timeout_s)
            pages: list[Any] = []
            token = _add_page(pages, stub.ListDatasetObjects(_page_request(name, ""), timeout=timeout_s))
            while token:
                token = _add_page(pages, stub.ListDatasetObjects(_page_request(name, token), timeout=timeout_s))
            return _build(dataset, pages)
        except grpc.RpcError as exc:
            _should_restart(exc, name)
        except _Replaced:
            pass
    raise _kept_being_replaced(name)


async def load_manifest_async(stub: Any, name: str, timeout_s: float = 60.0) -> Manifest:
    """:func:`load_manifest` with a grpc.aio MetadataServiceStub."""
    from silod.v1 import metadata_pb2

    for _ in range(_MAX_RESTARTS):
        try:
            dataset = await stub.GetDataset(metadata_pb2.GetDatasetRequest(name=name), timeout=timeout_s)
            pages: list[Any] = []
            token = _add_page(pages, await stub.ListDatasetObjects(_page_request(name, ""), timeout=timeout_s))
            while token:
                token = _add_page(pages, await stub.ListDatasetObjects(_page_request(name, token), timeout=timeout_s))
            return _build(dataset, pages)
        except grpc.RpcError as exc:
            _should_restart(exc, name)
        except _Replaced:
            pass
    raise _kept_being_replaced(name)


class _Replaced(Exception):
    pass
