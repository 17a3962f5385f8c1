"""``SilodDataset``: a map-style torch Dataset over a registered dataset's manifest.

Path of a batch (``DataLoader`` calls ``__getitems__`` with the batch's indices):

1. one ``Lease`` call to the node's cache server for all keys of the batch (misses are
   fetched by the server, hits are already local), carrying the sampler's prefetch hint if the
   batch has one; once a gRPC Lease has named the server's local lease socket, the calls go
   there (the same messages, without gRPC's per-call cost);
2. the leased files are read directly (the memory tier lives on tmpfs, the disk tier on local
   disk: both are plain paths) -- no sample bytes pass through gRPC;
3. the lease is released by the reader's next Lease call (``release_lease_ids``), the last one
   when the process ends: one call per batch.

If the cache server cannot be reached (down, restarting, never configured) the objects are
read from the remote store directly, verified against the manifest's version tags exactly as
the cache server does. The switch is logged once per job run (shared by DataLoader workers);
the cache server is tried again every ``retry_cache_after_s`` seconds.

fork safety: gRPC is not fork-safe once it has been used (threads and locks are copied
mid-flight; forked DataLoader workers can deadlock). The process that builds the dataset and
forks the workers therefore never opens a channel: the manifest is loaded by a helper process,
prefetch hints from the sampler ride along with the indices to the workers, and each worker
opens its own channel lazily. Reading samples in that process itself (``num_workers=0`` or
``dataset[i]`` by hand) opens a channel there: create DataLoaders with workers afterwards with
``multiprocessing_context="forkserver"`` (or "spawn") in that case.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import multiprocessing
import multiprocessing.util
import os
import pickle
import queue
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import torch.utils.data

from silod.data.catalog import Manifest
from silod.data.store import ObjectStore

_log = logging.getLogger("silod.data")

DEFAULT_METADATA_ADDR = "127.0.0.1:7070"
_DOWN_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


class _Background:
    """One thread per process for fire-and-forget calls (ReleaseLease, Prefetch hints): they
    leave the batch's critical path (a grpc ``.future()`` costs more than the call itself).

    gRPC skips its fork handlers while another thread is inside a call, and a DataLoader forks
    its workers from this process: every fork first waits (up to 2 s) until the queue is empty.
    """

    def __init__(self) -> None:
        self._queue: queue.Queue[Callable[[], Any] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="silod-data-background", daemon=True)
        self._thread.start()
        _BACKGROUND.add(self)

    def submit(self, fn: Callable[[], Any]) -> None:
        self._queue.put(fn)

    def _run(self) -> None:
        while True:
            fn = self._queue.get()
            try:
                if fn is not None:
                    fn()
            except Exception:  # noqa: BLE001 -- a lease expires on its own; a hint is only a hint
                pass
            finally:
                self._queue.task_done()

    def drain(self, timeout_s: float = 2.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.001)


_BACKGROUND: weakref.WeakSet[_Background] = weakref.WeakSet()


def _drain_background() -> None:
    for worker in list(_BACKGROUND):
        if worker._thread.is_alive():
            worker.drain()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_drain_background)


def _read_exactly(path: str, size: int) -> bytes | None:
    """The file's bytes if it holds exactly ``size`` of them, else None.

    One ``read`` of the known size (plus one byte, to notice a longer file) instead of
    ``open(path).read()``, which adds a buffered reader, an fstat and a read that finds the end:
    on a hit that is a third of the time spent reading a 100 KB sample from tmpfs."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        data = os.read(fd, size + 1)
        if 0 < len(data) < size:  # a short read (rare: signals, very large files): read the rest
            parts = [data]
            got = len(data)
            while got <= size:
                more = os.read(fd, size + 1 - got)
                if not more:
                    break
                parts.append(more)
                got += len(more)
            data = b"".join(parts)
    except OSError:
        return None
    finally:
        os.close(fd)
    return data if len(data) == size else None


_SOCKET_PATH_BYTES = 256  # a Unix socket's path has at most 107


class DataError(RuntimeError):
    """Reading the dataset failed for a reason the cache server or the store reported."""


class _CacheDown(Exception):
    pass


def _server_side(exc: grpc.RpcError) -> bool:
    """An UNAVAILABLE raised by the cache server's own code names a field ("keys[3]: remote store ...")
    -- the store is down, not the cache server; falling back would not help."""
    details = exc.details() or ""
    return details.startswith(("keys[", "dataset:"))


class SilodDataset(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Samples of a registered dataset as ``bytes`` (or ``transform(bytes)``), in manifest order.

    ``cache_addr`` (default ``$SILOD_CACHE_ADDR``; empty = no cache server, read the store
    directly), ``metadata_addr`` (default ``$SILOD_METADATA_ADDR``, else 127.0.0.1:7070),
    ``job_id`` (default ``$SILOD_JOB_ID``): the reader the cache server charges quotas and IO to.
    The manifest is loaded once, here, and travels with the dataset to DataLoader workers. It is
    fetched by a helper process, so that this one stays free of gRPC until it forks its workers;
    ``manifest_in_process=True`` skips the helper (about a second) where that does not matter: no
    forked workers (``num_workers=0``, or spawn/forkserver), or a process that already uses gRPC.
    ``use_local_socket``: send Lease calls to the cache server's local lease socket once a gRPC
    Lease has named it (docs/cache.md); False keeps every call on gRPC.
    """

    def __init__(
        self,
        dataset_name: str,
        *,
        cache_addr: str | None = None,
        metadata_addr: str | None = None,
        job_id: str | None = None,
        transform: Callable[[bytes], Any] | None = None,
        token: str | None = None,
        lease_s: float = 0.0,
        timeout_s: float = 300.0,
        retry_cache_after_s: float = 30.0,
        direct_read_threads: int = 8,
        manifest_in_process: bool = False,
        use_local_socket: bool = True,
    ) -> None:
        self.name = dataset_name
        self.cache_addr = os.environ.get("SILOD_CACHE_ADDR", "") if cache_addr is None else cache_addr
        self.metadata_addr = metadata_addr or os.environ.get("SILOD_METADATA_ADDR") or DEFAULT_METADATA_ADDR
        self.job_id = os.environ.get("SILOD_JOB_ID", "") if job_id is None else job_id
        self.transform = transform
        self.token = os.environ.get("SILOD_AUTH_TOKEN", "") if token is None else token
        self.lease_s = lease_s
        self.timeout_s = timeout_s
        self.retry_cache_after_s = retry_cache_after_s
        self.direct_read_threads = direct_read_threads
        self.use_local_socket = use_local_socket
        self.manifest: Manifest = self._load_manifest(manifest_in_process)
        if self.cache_addr:
            # Imported here, once, not in every DataLoader worker of every epoch (~15 ms of CPU
            # each); importing opens no channel, so the process stays fork-safe.
            import silod.data.local_lease  # noqa: F401
            import silod.rpc.channels  # noqa: F401
            import silod.v1.cache_pb2  # noqa: F401
            import silod.v1.cache_pb2_grpc  # noqa: F401
        # Shared with forked DataLoader workers: the fallback is announced once per run.
        self._fallback_logged: Any = multiprocessing.Value("b", 0)
        # Shared too: the cache server's local lease socket, once a worker has learned it, so the
        # workers of later epochs go there straight away (no gRPC channel to set up at all).
        self._shared_socket: Any = multiprocessing.Array("c", _SOCKET_PATH_BYTES)
        self._reset_process_state()

    # -- manifest ---------------------------------------------------------------------------------

    def _load_manifest(self, in_process: bool) -> Manifest:
        if in_process:  # the caller forks no DataLoader workers, or already uses gRPC itself
            from silod.data._manifest_helper import ManifestUnavailable, fetch

            try:
                return fetch(self.name, self.metadata_addr, self.token)  # type: ignore[return-value]
            except ManifestUnavailable as exc:
                raise DataError(str(exc)) from None
        # In a helper process: this process must stay free of gRPC until it has forked its
        # DataLoader workers (see _manifest_helper).
        result = subprocess.run(
            [sys.executable, "-m", "silod.data._manifest_helper", self.name, self.metadata_addr],
            capture_output=True,
            env={**os.environ, "SILOD_AUTH_TOKEN": self.token},
            timeout=600,
        )
        if result.returncode != 0:
            raise DataError(result.stderr.decode(errors="replace").strip().splitlines()[-1]
                            if result.stderr.strip() else f"manifest helper exited with {result.returncode}")
        manifest: Manifest = pickle.loads(result.stdout)
        return manifest

    @property
    def keys(self) -> list[str]:
        return self.manifest.keys

    # -- per-process state (opened lazily, after fork) ---------------------------------------------

    def _reset_process_state(self) -> None:
        self._pid = 0
        self._channel: Any = None
        self._stub: Any = None
        self._store: ObjectStore | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._fallback_since: float | None = None
        self._background: _Background | None = None
        self._done_leases: list[str] = []  # read, not released yet: the next Lease releases them
        self._local: Any = None  # LocalLeaseClient, once the cache server has named its socket
        self._local_failed: set[str] = set()  # socket paths that failed in this process
        self._exit_hook = False
        self.counters = collections.Counter()

    def _ensure_process(self) -> None:
        if self._pid == os.getpid():
            return
        # Inherited from the parent through fork: never use (or close) its channel here.
        self._reset_process_state()
        self._pid = os.getpid()

    def _cache_stub(self) -> Any:
        if self._stub is None:
            from silod.rpc.channels import open_channel
            from silod.v1 import cache_pb2_grpc

            # Its own connection: the one opened to retry a cache that was down must not share
            # the old one's reconnect backoff (it failed the first batch after the cache returned).
            self._channel = open_channel(self.cache_addr, token=self.token, default_timeout_s=self.timeout_s,
                                         own_connection=True)
            self._stub = cache_pb2_grpc.CacheServiceStub(self._channel)
            self._release_at_exit()
        return self._stub

    def _release_at_exit(self) -> None:
        """The last lease of a DataLoader worker has no next Lease to release it: release it when
        the process ends (multiprocessing runs its finalizers in every exiting child)."""
        if not self._exit_hook:
            multiprocessing.util.Finalize(None, self._release_done, args=(weakref.ref(self),), exitpriority=0)
            self._exit_hook = True

    @staticmethod
    def _release_done(ref: Any) -> None:
        self = ref()
        if self is None or not self._done_leases or self._pid != os.getpid():
            return
        from silod.v1 import cache_pb2

        for lease_id in self._done_leases:
            request = cache_pb2.ReleaseLeaseRequest(lease_id=lease_id)
            with contextlib.suppress(Exception):
                if self._local is not None:
                    self._local.release(request.SerializeToString())
                elif self._stub is not None:
                    self._stub.ReleaseLease(request, timeout=1)
        self._done_leases = []

    def _direct_store(self) -> ObjectStore:
        if self._store is None:
            self._store = ObjectStore(self.manifest.uri, self.manifest.storage_options)
        return self._store

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for name in ("_channel", "_stub", "_store", "_pool", "_background", "_local"):
            state[name] = None
        state["_pid"] = 0
        state["_done_leases"], state["_exit_hook"] = [], False
        # The shared "fallback logged" flag is a fork-context lock: forked workers inherit it
        # (no pickling), and a spawn or forkserver child cannot take it at all (Python refuses
        # to pickle it). Such children get none and log a fallback once each.
        state["_fallback_logged"] = None
        state["_shared_socket"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    # -- torch Dataset ---------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.manifest)

    def __getitem__(self, index: int) -> Any:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        hints: list[int] = []
        for index in indices:
            hint = getattr(index, "prefetch_hint", None)  # set by EpochShuffleSampler
            if hint:
                hints.extend(hint)
        positions = [int(i) for i in indices]
        n = len(self.manifest)
        for i in positions:
            if not -n <= i < n:
                raise IndexError(f"index {i} out of range for dataset {self.name!r} of {n} objects")
        positions = [i % n for i in positions]
        return self._read(positions, self.transform, hints)

    # -- reading ---------------------------------------------------------------------------------------

    def read_batch(self, positions: Sequence[int]) -> list[bytes]:
        """The bytes of the manifest objects at ``positions`` (one Lease for all of them)."""
        return self._read(positions, None)

    def _read(self, positions: Sequence[int], transform: Callable[[bytes], Any] | None,
              hints: Sequence[int] = ()) -> list[Any]:
        """``transform(bytes)`` of each object (or the bytes), each transformed as soon as it is
        read: a batch's raw bytes are never all alive at once, so their memory is reused from
        one sample to the next instead of being faulted in afresh for every batch. ``hints``:
        positions read next (a prefetch hint), sent with the batch's Lease call."""
        self._ensure_process()
        if self._cache_enabled():
            try:
                data = self._read_via_cache(positions, transform, hints)
                if self._fallback_since is not None:
                    _log.info("cache server reachable again; reading through it", extra={"cache": self.cache_addr})
                    self._fallback_since = None
                return data
            except _CacheDown as exc:
                self._enter_fallback(str(exc))
        data = self._read_direct(positions, [None] * len(positions))
        return data if transform is None else [transform(d) for d in data]

    def _cache_enabled(self) -> bool:
        if not self.cache_addr:
            return False
        if self._fallback_since is None:
            return True
        if time.monotonic() - self._fallback_since < self.retry_cache_after_s:
            return False
        if self._channel is not None:
            # A fresh channel: the old one may sit in reconnect backoff. Open before closing, so
            # gRPC never drops to zero channels (that starts its background shutdown).
            old = self._channel
            self._channel = self._stub = None
            self._cache_stub()
            old.close()
        return True

    def _enter_fallback(self, reason: str) -> None:
        self._fallback_since = time.monotonic()
        self.counters["fallbacks"] += 1
        # The channel stays open: gRPC reconnects it when the cache is tried again.
        first = True
        shared = self._fallback_logged
        if shared is not None:
            with shared.get_lock():
                first = not shared.value
                shared.value = 1
        level = logging.WARNING if first else logging.DEBUG
        _log.log(
            level,
            "cache server %s unreachable (%s); reading dataset %s directly from %s"
            " (logged once; retrying the cache every %gs)",
            self.cache_addr, reason, self.name, self.manifest.uri, self.retry_cache_after_s,
        )

    def _read_via_cache(self, positions: Sequence[int], transform: Callable[[bytes], Any] | None,
                        hints: Sequence[int] = ()) -> list[Any]:
        from silod.v1 import cache_pb2

        manifest_keys = self.manifest.keys
        keys = [manifest_keys[p] for p in positions]
        # The previous batch's lease is released by this call (one call per batch, not two), and
        # the sampler's hint rides along (no Prefetch call of its own).
        request = cache_pb2.LeaseRequest(job_id=self.job_id, dataset=self.name, keys=keys, lease_s=self.lease_s,
                                         release_lease_ids=self._done_leases,
                                         prefetch_keys=[manifest_keys[int(p)] for p in hints])
        response = self._lease(request)
        self._done_leases = []
        out: list[Any] = []
        holes: list[int] = []
        expected: list[tuple[int, str] | None] = []
        try:
            for i, obj in enumerate(response.objects):
                data = None
                if obj.path:
                    data = _read_exactly(obj.path, obj.size_bytes)
                expected.append((obj.size_bytes, obj.etag))
                if data is None:
                    self.counters["lease_unreadable"] += 1
                    holes.append(i)
                    out.append(None)
                else:
                    out.append(data if transform is None else transform(data))
        finally:
            self._done_leases.append(response.lease_id)
        self.counters["leased"] += len(keys)
        self.counters["lease_calls"] += 1
        if holes:
            missing = set(holes)
            filled = self._read_direct(positions, [None if i in missing else b"" for i in range(len(out))], expected)
            for i in holes:
                out[i] = filled[i] if transform is None else transform(filled[i])
        return out

    def _lease(self, request: Any) -> Any:
        """One Lease call: on the cache server's local lease socket once it has named one, else gRPC."""
        from silod.data.local_lease import LeaseRefused, SocketTrouble
        from silod.v1 import cache_pb2

        local = self._local
        if local is None and self.use_local_socket and self._shared_socket is not None:
            path = self._shared_socket.value.decode()
            if path and path not in self._local_failed:
                self._open_local(path)
                local = self._local
        if local is not None:
            try:
                response = cache_pb2.LeaseResponse.FromString(local.lease(request.SerializeToString()))
                self.counters["local_lease_calls"] += 1
                return response
            except LeaseRefused as exc:  # the server answered: as a refusal over gRPC
                raise DataError(f"cache server: {exc}") from None
            except SocketTrouble as exc:
                self._drop_local(str(exc))
                if exc.timed_out:  # as a gRPC deadline: the cache is too slow, not just the socket
                    raise _CacheDown(f"DEADLINE_EXCEEDED: {exc}") from None
                # Anything else (the server restarted, say): the same call over gRPC.
        stub = self._cache_stub()
        try:
            response = stub.Lease(request, timeout=self.timeout_s)
        except grpc.RpcError as exc:
            if exc.code() in _DOWN_CODES and not _server_side(exc):
                raise _CacheDown(f"{exc.code().name}: {exc.details()}") from None
            raise DataError(f"cache server: {exc.code().name}: {exc.details()}") from None
        path = response.local_socket
        if path and self.use_local_socket and path not in self._local_failed:
            self._open_local(path)
            shared = self._shared_socket
            if self._local is not None and shared is not None and len(path.encode()) < _SOCKET_PATH_BYTES:
                shared.value = path.encode()
        return response

    def _open_local(self, path: str) -> None:
        from silod.data.local_lease import LeaseRefused, LocalLeaseClient, SocketTrouble

        try:
            self._local = LocalLeaseClient(path, self.token, self.timeout_s)
            self._release_at_exit()
        except (SocketTrouble, LeaseRefused) as exc:
            # Another host's socket (a shared /tmp?), a token the socket refuses, ...: gRPC it is.
            self._local_failed.add(path)
            _log.debug("local lease socket not usable; staying on gRPC", extra={"path": path, "error": str(exc)})

    def _drop_local(self, reason: str) -> None:
        local, self._local = self._local, None  # another thread may be dropping it too
        if local is not None:
            self._local_failed.add(local.path)
            local.close()
            _log.debug("local lease socket failed; back to gRPC", extra={"error": reason})

    def _read_direct(
        self,
        positions: Sequence[int],
        have: list[bytes | None],
        expected: list[tuple[int, str] | None] | None = None,
    ) -> list[bytes]:
        """Fill the holes of ``have`` from the store, verified (size and version tag)."""
        store = self._direct_store()
        todo = [i for i, d in enumerate(have) if d is None]
        if not todo:
            return have  # type: ignore[return-value]

        def one(i: int) -> bytes:
            p = positions[i]
            size, etag = self.manifest.sizes[p], self.manifest.etags[p]
            if expected is not None and expected[i] is not None:
                size, etag = expected[i]  # type: ignore[misc]  # the version the cache server served
            return store.read(self.manifest.keys[p], size, etag)

        if len(todo) == 1 or self.direct_read_threads <= 1:
            results = [one(i) for i in todo]
        else:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.direct_read_threads, thread_name_prefix="silod-data")
            results = list(self._pool.map(one, todo))
        for i, data in zip(todo, results):
            have[i] = data
        self.counters["direct"] += len(todo)
        return have  # type: ignore[return-value]

    def prefetch_hint(self, positions: Sequence[int]) -> None:
        """Tell the cache server which objects come next, in a Prefetch call of its own (fire and
        forget; no-op without a cache).

        The samplers do not call this: they attach the upcoming positions to an index
        (``index.prefetch_hint``), and whichever process reads that index -- a DataLoader
        worker -- sends them with that batch's Lease; the process that forks the workers stays
        free of gRPC.
        """
        if not positions:
            return
        self._ensure_process()
        if not self.cache_addr or self._fallback_since is not None:
            return
        from silod.v1 import cache_pb2

        keys = [self.manifest.keys[int(p)] for p in positions]
        stub = self._cache_stub()
        request = cache_pb2.PrefetchRequest(job_id=self.job_id, dataset=self.name, keys=keys)
        self._in_background(lambda: stub.Prefetch(request, timeout=30))

    def _in_background(self, fn: Callable[[], Any]) -> None:
        if self._background is None:
            self._background = _Background()
        self._background.submit(fn)
