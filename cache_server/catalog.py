"""The dataset catalog: the manifest of every dataset read here (loaded once, its version
re-checked every ``manifest_refresh_s``), the store connection that goes with it, and the
rules for the keys a request names.

The manifest is a dataset's definition: a cached copy is served only while its version tag is
the manifest's, and an object the store has in another version sends us back to the metadata
service to see whether the dataset was re-registered (:meth:`DatasetCatalog.reload_for_change`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass

import grpc

from cache_server.config import CacheConfig
from cache_server.policies import FetchCostModel
from cache_server.runtime import Runtime
from services.runtime.downstream import translate
from services.runtime.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from silod.data.catalog import Manifest, ManifestNotFound
from silod.data.keys import key_problem
from silod.data.store import ObjectStore, StoreConfigError

_log = logging.getLogger("silod.cache")

MAX_KEYS_PER_CALL = 4096

ManifestLoader = Callable[[str], Awaitable[Manifest]]
VersionProbe = Callable[[str], Awaitable[int]]


@dataclass
class DatasetState:
    manifest: Manifest
    store: ObjectStore
    cost: FetchCostModel  # measured fetch cost of this dataset's store (kept across manifest versions)
    checked_at: float  # monotonic time the manifest version was last confirmed
    refreshing: bool = False

    @property
    def name(self) -> str:
        return self.manifest.name


class DatasetCatalog:
    def __init__(self, config: CacheConfig, runtime: Runtime, load_manifest: ManifestLoader,
                 probe_version: VersionProbe | None = None) -> None:
        self.config = config
        self.runtime = runtime
        self._load_manifest = load_manifest
        self._probe_version = probe_version
        self.datasets: dict[str, DatasetState] = {}
        self._loading: dict[str, asyncio.Future[DatasetState]] = {}

    def loaded(self, name: str) -> DatasetState | None:
        """The dataset as loaded now, without loading or refreshing it."""
        return self.datasets.get(name)

    async def get(self, name: str) -> DatasetState:
        """The dataset, loaded on first use; an old manifest version is re-checked in the background."""
        if not name:
            raise InvalidArgument("must name a registered dataset", field="dataset")
        ds = self.datasets.get(name)
        if ds is None:
            return await self._load(name)
        if time.monotonic() - ds.checked_at > self.config.manifest_refresh_s and not ds.refreshing:
            ds.refreshing = True
            self.runtime.spawn(self._refresh_in_background(ds))
        return ds

    def prepare(self, names: Iterable[str]) -> None:
        """Start loading the datasets among ``names`` not loaded yet (a plan names them for jobs here)."""
        for name in set(names) - set(self.datasets) - set(self._loading):
            with contextlib.suppress(RuntimeError):  # no running loop (a direct call): nothing to prepare
                asyncio.get_running_loop()
                self.runtime.spawn(self._prepare(name))

    async def _prepare(self, name: str) -> None:
        """Load a dataset a plan names for a job here before the job's first call: its manifest and
        a store connection (one HEAD), which its first Lease would otherwise wait for (seconds on
        a busy machine, counted in the job's run time)."""
        try:
            ds = await self.get(name)
            if len(ds.manifest) and ds.store.reads_async:
                await ds.store.current_tag_async(ds.manifest.keys[0])
            elif len(ds.manifest):
                await self.runtime.on_remote(ds.store.current_tag, ds.manifest.keys[0])
        except Exception as exc:  # the job's own calls report any problem
            _log.debug("dataset not prepared", extra={"dataset": name, "error": str(exc)})

    async def _refresh_in_background(self, ds: DatasetState) -> None:
        try:
            if self._probe_version is not None:
                version = await self._probe_version(ds.name)
                if version == ds.manifest.version:
                    ds.checked_at = time.monotonic()
                    return
            await self._load(ds.name)
        except Exception as exc:  # metadata down: keep serving the manifest we have
            _log.warning("manifest refresh failed", extra={"dataset": ds.name, "error": str(exc)})
            ds.checked_at = time.monotonic()
        finally:
            ds.refreshing = False

    async def reload_for_change(self, ds: DatasetState) -> DatasetState:
        """The store has another version than our manifest: was the dataset re-registered?"""
        current = self.datasets.get(ds.name, ds)
        if current is not ds:
            return current  # someone reloaded it meanwhile
        try:
            if self._probe_version is not None and await self._probe_version(ds.name) == ds.manifest.version:
                ds.checked_at = time.monotonic()
                return ds
            return await self._load(ds.name)
        except Exception as exc:
            _log.warning("manifest reload failed", extra={"dataset": ds.name, "error": str(exc)})
            return ds

    async def _load(self, name: str) -> DatasetState:
        pending = self._loading.get(name)
        if pending is not None:
            return await asyncio.shield(pending)
        future: asyncio.Future[DatasetState] = asyncio.get_running_loop().create_future()
        future.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._loading[name] = future
        try:
            try:
                manifest = await self._load_manifest(name)
            except ManifestNotFound:
                raise NotFound(f"no dataset named {name!r} is registered", field="dataset") from None
            except (InvalidArgument, NotFound):
                raise
            except grpc.RpcError as exc:  # the shared rule: the caller's field, or retryable, or a bug
                raise translate(exc, "metadata (manifest of the dataset)", {"name": "dataset"},
                                default_field="dataset") from None
            except Exception as exc:
                raise Unavailable(f"cannot load the manifest of {name!r} from the metadata service: {exc}",
                                  field="dataset") from exc
            old = self.datasets.get(name)
            try:
                store = ObjectStore(
                    manifest.uri,
                    manifest.storage_options,
                    timeout_s=self.config.remote_timeout_s,
                    retries=self.config.remote_retries,
                )
            except StoreConfigError as exc:
                raise FailedPrecondition(f"dataset {name!r} cannot be read: {exc}", field="dataset") from None
            if store.scheme == "s3" and not store.reads_async:
                # s3fs/aiobotocore take ~0.5 s of CPU to import: in the background, now.
                self.runtime.spawn(self.runtime.on_remote(import_store_clients, True))
            ds = DatasetState(manifest, store, old.cost if old else FetchCostModel(), time.monotonic())
            self.datasets[name] = ds
            if old is not None and old.store is not store:
                self.runtime.spawn(self._close_later(old.store))
            if old is not None and old.manifest.version != manifest.version:
                _log.info("manifest replaced", extra={"dataset": name, "from_version": old.manifest.version,
                                                      "to_version": manifest.version})
            future.set_result(ds)
            return ds
        except BaseException as exc:
            future.set_exception(exc)
            raise
        finally:
            self._loading.pop(name, None)

    async def _close_later(self, store: ObjectStore) -> None:
        """Close a replaced manifest's store connections once its fetches in flight are over."""
        try:
            await asyncio.sleep(self.config.remote_deadline_s)
        finally:  # at stop() too
            await store.aclose()

    async def close(self) -> None:
        for ds in self.datasets.values():
            with contextlib.suppress(Exception):
                await ds.store.aclose()


def check_batch(keys: Sequence[str], limit: int = MAX_KEYS_PER_CALL, allow_empty: bool = False,
                field: str = "keys") -> None:
    if not keys and not allow_empty:
        raise InvalidArgument("must name at least one key", field=field)
    if len(keys) > limit:
        raise InvalidArgument(f"at most {limit:,} keys per call, got {len(keys):,}", field=field)


def resolve(ds: DatasetState, keys: Sequence[str], field: str = "keys") -> list[int]:
    """The manifest positions of ``keys``; a key not in the manifest is refused, naming it."""
    index = ds.manifest.index
    positions = []
    for i, key in enumerate(keys):
        pos = index.get(key)
        if pos is None:
            problem = key_problem(key)
            if problem is not None:
                raise InvalidArgument(problem, field=f"{field}[{i}]")
            raise NotFound(
                f"no object {key!r} in the manifest of dataset {ds.name!r} (version {ds.manifest.version})",
                field=f"{field}[{i}]",
            )
        positions.append(pos)
    return positions


def import_store_clients(s3fs_too: bool) -> None:
    with contextlib.suppress(ImportError):  # a server for file:// datasets only may lack them
        import botocore.session  # noqa: F401

        if s3fs_too:
            import s3fs  # noqa: F401
