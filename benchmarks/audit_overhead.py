"""What the audit log's interceptor (services/runtime/audit.py) adds to a call, in process.

    .venv/bin/python benchmarks/audit_overhead.py [--calls 20000] [--repeat 3]

Runs the interceptor's wrapper around a handler that does nothing but name its caller (as the
access interceptor does), for a call it does not record (a user's read) and one it records (a
user's CancelJob: the request's resources read, the values noted in the buffer), and prints the
median microseconds each adds over calling the handler alone. Building the event message and
sending it happen later, in the flush task, and are not counted: they are off the call's path.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

from silod.v1 import scheduler_pb2

from services.runtime.audit import AuditInterceptor, AuditRecorder, LogSink, note_principal
from services.runtime.principals import USER, Principal

ALICE = Principal(USER, "alice", ("vision",), "0123456789abcdef")


class _Context:  # what the wrapper asks of a grpc.aio context after a successful call
    def code(self) -> None:
        return None

    def details(self) -> str:
        return ""

    def peer(self) -> str:
        return "ipv4:127.0.0.1:50000"


async def _handler(request: Any, context: Any) -> None:
    note_principal(ALICE)


async def _added_us(method: str, request: Any, calls: int) -> float:
    interceptor = AuditInterceptor(AuditRecorder("bench", LogSink(), max_buffered=10 * calls))
    context = _Context()
    started = time.perf_counter()
    for _ in range(calls):
        await interceptor._around(method, "token", _handler, request, context)
    wrapped = time.perf_counter() - started
    started = time.perf_counter()
    for _ in range(calls):
        await _handler(request, context)
    bare = time.perf_counter() - started
    return 1e6 * (wrapped - bare) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    cases = (("not recorded: a user's WatchJob", "/silod.v1.JobService/WatchJob",
              scheduler_pb2.WatchJobRequest(job_id="job-3f9c2a1b7d4e")),
             ("recorded: a user's CancelJob", "/silod.v1.JobService/CancelJob",
              scheduler_pb2.CancelJobRequest(job_id="job-3f9c2a1b7d4e")))
    for label, method, request in cases:
        runs = [asyncio.run(_added_us(method, request, args.calls)) for _ in range(args.repeat)]
        print(f"{label}: {statistics.median(runs):.1f} us added per call (median of {args.repeat} runs of "
              f"{args.calls})")


if __name__ == "__main__":
    main()
