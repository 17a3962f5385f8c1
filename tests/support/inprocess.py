"""A silod service served in-process by start_server on a private event-loop thread.

Tests then talk to it with plain synchronous gRPC stubs, exactly as a client process would,
without paying for a subprocess per test.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import grpc

from silod.rpc.limits import MESSAGE_SIZE_OPTIONS
from services.runtime.server import RunningServer, ServiceDefinition, start_server


class InProcessServer:
    """``definition`` served on 127.0.0.1; ``.address``, ``.channel``, ``.stop()``, context manager."""

    def __init__(self, definition: ServiceDefinition, settings: Any, *, thread_name: str = "silod-server") -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=thread_name, daemon=True)
        self._thread.start()
        try:
            self.running: RunningServer = self.submit(start_server(definition, settings))
        except BaseException:
            self._close_loop()
            raise
        self.address = self.running.address
        self.channel = grpc.insecure_channel(self.address, options=MESSAGE_SIZE_OPTIONS)

    def submit(self, coroutine: Any, timeout: float = 60) -> Any:
        """Run ``coroutine`` on the server's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    def stop(self) -> None:
        self.channel.close()
        try:
            self.submit(self.running.stop(0))
        except TimeoutError:
            # Seen once in CI (the scheduler, after a report test): say what the loop was waiting on.
            raise TimeoutError(f"the server did not stop within 60 s; its event loop's tasks:\n{self._tasks()}") from None
        finally:
            self._close_loop()

    def _tasks(self) -> str:
        async def describe() -> str:
            lines = []
            for task in asyncio.all_tasks():
                frames = task.get_stack()
                where = " <- ".join(f"{f.f_code.co_name} ({'/'.join(f.f_code.co_filename.rsplit('/', 2)[-2:])}:{f.f_lineno})"
                                    for f in reversed(frames)) or "no frames"
                lines.append(f"{task.get_name()} {task.get_coro()!r}: {where}")
            return "\n".join(lines)

        try:
            return self.submit(describe(), timeout=5)
        except Exception as exc:  # noqa: BLE001 - the loop itself is stuck
            return f"(not readable: {exc!r}; the loop does not turn)"

    def _close_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def __enter__(self) -> InProcessServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
