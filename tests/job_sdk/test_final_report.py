"""The last progress report of a rank (``done()``) reaches its agent even after a failed one.

The scheduler records a job's progress from its agent before the job's terminal state, so a
final report that is skipped (the SDK backs off after a failed call) or times out leaves the
finished job short of its budget for everyone watching it. The agent here is a gRPC server
that stalls or refuses its first calls the way a busy or restarting agent does."""

from __future__ import annotations

import signal
import threading
import time
from concurrent import futures

import grpc

from silod.rpc.keepalive import SERVER_KEEPALIVE_OPTIONS
from silod.v1 import worker_agent_pb2, worker_agent_pb2_grpc


class RefusingAgent(worker_agent_pb2_grpc.WorkerAgentServiceServicer):
    def __init__(self, stalls: int, refusals: int) -> None:
        self.stalls = stalls  # calls answered after the SDK's periodic-report deadline
        self.refusals = refusals  # then calls refused (the channel itself retries these a few times)
        self.received: list[int] = []
        self.lock = threading.Lock()

    def ReportProgress(self, request, context):  # noqa: N802
        with self.lock:
            stall, self.stalls = self.stalls > 0, max(0, self.stalls - 1)
            refuse, self.refusals = not stall and self.refusals > 0, self.refusals - (not stall and self.refusals > 0)
        if stall:
            time.sleep(1.5)
            context.abort(grpc.StatusCode.UNAVAILABLE, "agent stuck")
        if refuse:
            context.abort(grpc.StatusCode.UNAVAILABLE, "agent busy")
        with self.lock:
            self.received.append(request.progress.samples_done)
        return worker_agent_pb2.ReportProgressResponse()


def _context(address: str, tmp_path):  # type: ignore[no-untyped-def]
    from silod.job import ClusterContext

    previous = signal.getsignal(signal.SIGTERM)
    try:
        return ClusterContext({"SILOD_JOB_ID": "job-x", "SILOD_RANK": "0", "SILOD_GENERATION": "1",
                               "SILOD_CHECKPOINT_DIR": str(tmp_path), "SILOD_AGENT_ADDR": address})
    finally:
        signal.signal(signal.SIGTERM, previous)  # ClusterContext installed the SDK's handler in pytest


def test_final_report_is_delivered_despite_the_back_off_and_a_refusal(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # The channel retries UNAVAILABLE 4 times per call: 5 refusals fail one whole call.
    agent = RefusingAgent(stalls=1, refusals=5)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=SERVER_KEEPALIVE_OPTIONS)
    worker_agent_pb2_grpc.add_WorkerAgentServiceServicer_to_server(agent, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        ctx = _context(f"127.0.0.1:{port}", tmp_path)
        ctx.report(samples=100, steps=1)  # past its deadline: the SDK backs off periodic reports
        assert agent.received == []
        time.sleep(1.1)  # past the periodic-report interval, still within the back-off
        ctx.report(samples=50, steps=1)  # not even tried
        assert agent.received == [] and agent.refusals == 5
        ctx.done()  # its first attempt refused (4 tries by the channel), the second delivered
        assert agent.received == [150] and agent.refusals == 0
    finally:
        server.stop(None)
