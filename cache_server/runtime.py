"""What every part of the cache server runs its work on.

All bookkeeping runs on one asyncio event loop (no locks); blocking work (remote reads, file
writes, hashing) runs in two thread pools: one for remote reads (``remote_concurrency``
threads) and one for local files, so a slow store never delays local hits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

_log = logging.getLogger("silod.cache")


class Runtime:
    """Thread pools, remote-read slots, background tasks and warnings said once."""

    def __init__(self, remote_concurrency: int) -> None:
        # Remote reads in flight: threads for file:// and s3fs, slots on the loop for the lean client.
        self.remote_pool = ThreadPoolExecutor(max(1, remote_concurrency), thread_name_prefix="cache-remote")
        self.remote_slots = asyncio.Semaphore(max(1, remote_concurrency))
        # Prefetches of all jobs together take at most half of them: a Lease's misses (a batch
        # waiting) always find slots. Two jobs' prefetches once held all 64 and their 4 MiB runs
        # made every miss of both jobs queue behind them.
        self.prefetch_slots = asyncio.Semaphore(max(1, remote_concurrency // 2))
        self.file_pool = ThreadPoolExecutor(4, thread_name_prefix="cache-file")
        self._background: set[asyncio.Task[Any]] = set()
        self._warned: set[str] = set()

    def on_files(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
        """``fn(*args)`` in the local-file pool."""
        return asyncio.get_running_loop().run_in_executor(self.file_pool, fn, *args)

    def on_remote(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
        """``fn(*args)`` in the remote-read pool."""
        return asyncio.get_running_loop().run_in_executor(self.remote_pool, fn, *args)

    def spawn(self, coro: Any) -> asyncio.Task[Any]:
        """Run ``coro`` in the background until it ends or the server stops."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def warn_once(self, what: str, message: str, **extra: Any) -> None:
        if what not in self._warned:
            self._warned.add(what)
            _log.warning(message, extra=extra)

    def cancel_background(self) -> None:
        for task in list(self._background):
            task.cancel()

    async def background_done(self) -> None:
        for task in list(self._background):
            with contextlib.suppress(BaseException):
                await task

    def stop_remote_reads(self) -> None:
        self.remote_pool.shutdown(wait=False, cancel_futures=True)

    def stop_file_work(self) -> None:
        self.file_pool.shutdown(wait=True)
