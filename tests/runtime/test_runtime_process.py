"""``silod estimator`` as a real process meets the standard every silod process must meet.

The calls use a deliberately invalid Predict (a query naming no application): a cheap request
whose answer, INVALID_ARGUMENT naming the field, does not depend on the estimator's models.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from google.protobuf import descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from prometheus_client.parser import text_string_to_metric_families

from services.runtime.metrics import silod_version
from tests.support.procs import REPO_ROOT, ServiceProcess, free_port, start_service
from services.runtime.server import ServiceDefinition, start_server
from services.runtime.settings import ServiceSettings
from silod.v1 import estimator_pb2, estimator_pb2_grpc, worker_agent_pb2, worker_agent_pb2_grpc

PREDICT = "/silod.v1.EstimatorService/Predict"
REJECTED = "INVALID_ARGUMENT"  # what the invalid Predict gets once past authentication


@pytest.fixture(scope="module")
def estimator() -> Iterator[tuple[ServiceProcess, int]]:
    """One process for the read-only checks; JSON logs are the default format."""
    metrics_port = free_port()
    with start_service("estimator", "--metrics-port", str(metrics_port)) as proc:
        yield proc, metrics_port


def _predict(address: str, metadata: tuple = ()) -> grpc.RpcError:
    with grpc.insecure_channel(address) as channel:
        with pytest.raises(grpc.RpcError) as failed:
            estimator_pb2_grpc.EstimatorServiceStub(channel).Predict(
                estimator_pb2.PredictRequest(queries=[estimator_pb2.PredictQuery()]), metadata=metadata, timeout=5
            )
    return failed.value


def _health(address: str, service: str = "") -> int:
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return int(reply.status)


def _wait_for_log(proc: ServiceProcess, needle: str, timeout_s: float = 5) -> str:
    """The client can get its status before the server has written the call's log line."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if needle in (log := proc.log()):
            return log
        time.sleep(0.05)
    raise AssertionError(f"{needle!r} not in log:\n{proc.log()}")


def test_health_reports_serving(estimator: tuple[ServiceProcess, int]) -> None:
    proc, _ = estimator
    assert _health(proc.address) == health_pb2.HealthCheckResponse.SERVING
    assert _health(proc.address, "silod.v1.EstimatorService") == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_and_describes_services(estimator: tuple[ServiceProcess, int]) -> None:
    proc, _ = estimator
    with grpc.insecure_channel(proc.address) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        services = set(database.get_services())
        assert {
            "silod.v1.EstimatorService",
            "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection",
        } <= services
        # The descriptors themselves come through too: a generic client could call Predict.
        pool = descriptor_pool.DescriptorPool(database)
        methods = {m.name for m in pool.FindServiceByName("silod.v1.EstimatorService").methods}
        assert methods == {"Predict", "Observe", "GetJobModel"}


def test_invalid_request_names_the_field(estimator: tuple[ServiceProcess, int]) -> None:
    proc, _ = estimator
    failure = _predict(proc.address)
    assert failure.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert failure.details().startswith("queries[0]")


def test_generated_base_servicer_answers_unimplemented() -> None:
    """A service whose RPCs are not written yet (the generated base class) says UNIMPLEMENTED, not UNKNOWN."""

    def register(server: grpc.aio.Server) -> None:
        worker_agent_pb2_grpc.add_WorkerAgentServiceServicer_to_server(worker_agent_pb2_grpc.WorkerAgentServiceServicer(), server)

    async def scenario() -> grpc.RpcError:
        definition = ServiceDefinition(name="stub", service_names=["silod.v1.WorkerAgentService"], register=register)
        running = await start_server(definition, ServiceSettings(log_format="text"))
        try:
            async with grpc.aio.insecure_channel(running.address) as channel:
                with pytest.raises(grpc.RpcError) as failed:
                    await worker_agent_pb2_grpc.WorkerAgentServiceStub(channel).GetNodeStatus(
                        worker_agent_pb2.GetNodeStatusRequest(), timeout=5
                    )
            return failed.value
        finally:
            await running.stop(grace=1)

    failure = asyncio.run(scenario())
    assert failure.code() == grpc.StatusCode.UNIMPLEMENTED
    assert failure.details() == "/silod.v1.WorkerAgentService/GetNodeStatus is not implemented"


def _scrape(metrics_port: int) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_endpoint_counts_calls(estimator: tuple[ServiceProcess, int]) -> None:
    proc, metrics_port = estimator
    _predict(proc.address)
    in_flight = ("silod_grpc_in_flight", (("service_process", "estimator"),))
    # A refused call's status reaches the client as the servicer aborts, a moment before the
    # server's bookkeeping of that call ends (seen once on a loaded CI run): wait for it.
    # The loop's lag probe observes once a tenth of a second from the start: a scrape right after
    # a fast start can come before its first observation.
    lag = ("silod_event_loop_lag_seconds_count", ())
    deadline = time.monotonic() + 5
    samples = _scrape(metrics_port)
    while (samples[in_flight] != 0 or samples.get(lag, 0) < 1) and time.monotonic() < deadline:
        time.sleep(0.05)
        samples = _scrape(metrics_port)
    key = (
        "silod_grpc_requests_total",
        (("code", REJECTED), ("method", PREDICT), ("service_process", "estimator")),
    )
    assert samples.get(key, 0) >= 1
    assert samples[("silod_grpc_request_duration_seconds_count", (("method", PREDICT), ("service_process", "estimator")))] >= 1
    assert samples[in_flight] == 0
    assert samples[("silod_build_info", (("version", silod_version()),))] == 1
    # Once serving, the collector was tuned (docs/sizing.md); its pauses are measured from the start.
    assert samples[("silod_gc_pause_seconds_count", (("generation", "2"),))] >= 1
    assert samples[lag] >= 1  # the loop's probe runs from the start


def test_json_log_has_one_line_per_call(estimator: tuple[ServiceProcess, int]) -> None:
    proc, _ = estimator
    _predict(proc.address, metadata=(("x-request-id", "json-log-test"),))
    log = _wait_for_log(proc, '"json-log-test"')
    lines = [json.loads(line) for line in log.splitlines() if line.strip()]  # every line is JSON
    (call,) = [line for line in lines if line.get("request_id") == "json-log-test"]
    assert call["method"] == PREDICT and call["code"] == REJECTED
    assert call["msg"] == "rpc finished" and call["level"] == "info" and call["logger"] == "silod.rpc"
    assert call["process"] == "estimator" and call["peer"].startswith("ipv4:127.0.0.1:")
    assert isinstance(call["duration_ms"], float) and call["ts"].endswith("Z")


def test_auth_token_required_except_for_health() -> None:
    with start_service("estimator", "--auth-token", "secret") as proc:
        missing = _predict(proc.address)
        assert (missing.code(), missing.details()) == (grpc.StatusCode.UNAUTHENTICATED, "missing bearer token")
        wrong = _predict(proc.address, metadata=(("authorization", "Bearer nope"),))
        assert (wrong.code(), wrong.details()) == (grpc.StatusCode.UNAUTHENTICATED, "invalid bearer token")
        right = _predict(proc.address, metadata=(("authorization", "Bearer secret"),))
        assert right.code() == grpc.StatusCode.INVALID_ARGUMENT  # got past auth to the servicer
        assert _health(proc.address) == health_pb2.HealthCheckResponse.SERVING
        # Reflection reveals the API, so it is not exempt.
        with grpc.insecure_channel(proc.address) as channel, pytest.raises(grpc.RpcError) as refused:
            ProtoReflectionDescriptorDatabase(channel).get_services()
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_sigterm_shuts_down_cleanly() -> None:
    with start_service("estimator", "--log-format", "text") as proc:
        ready_files = list(proc.workdir.glob("*.ready"))
        assert len(ready_files) == 1
        assert _predict(proc.address).code() == grpc.StatusCode.INVALID_ARGUMENT
        started = time.monotonic()
        assert proc.terminate(timeout=10) == 0
        assert time.monotonic() - started < 5
        log = proc.log()
        assert "shutting down signal=SIGTERM" in log and "shutdown complete" in log
        assert "Traceback" not in log
        assert not ready_files[0].exists()  # the address is no longer being served


def test_taken_port_fails_with_one_clear_line(estimator: tuple[ServiceProcess, int]) -> None:
    holder, _ = estimator  # the module's estimator keeps its port busy
    result = subprocess.run(
        [sys.executable, "-m", "silod.cli", "estimator", "--listen", holder.address],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=REPO_ROOT,
    )
    assert holder.running()
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last == f"silod estimator: cannot start: listen: cannot bind {holder.address}: Address already in use"


def _scripted(on_start: str, *flags: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.support.servicers", on_start, *flags],
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
    )


def test_failing_on_start_exits_with_one_clear_line() -> None:
    proc = _scripted("fail")
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 1
    assert "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1] == (
        "silod scripted: cannot start: on_start failed: RuntimeError: database unreachable"
    )


def test_sigterm_during_on_start_stops_without_serving(tmp_path) -> None:  # type: ignore[no-untyped-def]
    ready = tmp_path / "ready"
    proc = _scripted("hang", f"--ready-file={ready}", "--log-format=text")
    try:
        assert proc.stderr is not None
        assert proc.stderr.readline() == "on_start: hanging\n"
        proc.terminate()
        _, stderr = proc.communicate(timeout=5)
    finally:
        proc.kill()
    assert proc.returncode == 0
    assert "stopped before serving signal=SIGTERM" in stderr
    assert not ready.exists()


_LAUNCHER = """
import sys, time
from silod.launcher import start_service
service = start_service(sys.argv[2], *sys.argv[3:], workdir=sys.argv[1])
print(service.proc.pid, flush=True)
time.sleep(600)
"""


def _running(pid: int) -> bool:
    """Whether ``pid`` is a process that has not exited (a zombie nobody reaped yet has)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("command", ["estimator", "dashboard", "store-emulator"])
def test_a_service_stops_cleanly_when_its_launcher_is_killed(command: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A launcher killed with SIGKILL (a test run cut off, `silod up` killed) cannot stop what it
    started: the service notices it lost its launcher and shuts down as on SIGTERM. The gRPC
    services share one runtime; the dashboard and the store emulator each have their own loop."""
    args = {"estimator": ["--log-format", "text"], "dashboard": ["--metadata-address", f"127.0.0.1:{free_port()}"],
            "store-emulator": ["--root", str(tmp_path)]}[command]
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER, str(tmp_path), command, *args],
                                stdout=subprocess.PIPE, cwd=REPO_ROOT)
    service_pid = 0
    try:
        service_pid = int(launcher.stdout.readline())  # type: ignore[union-attr]
        assert _running(service_pid)
        launcher.kill()
        launcher.wait(10)
        deadline = time.monotonic() + 15
        while _running(service_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _running(service_pid), "the service outlived its launcher"
        log = next(tmp_path.glob(f"{command}-*.log")).read_text()
        assert "is gone; stopping" in log and "shutting down" in log, log[-2000:]
        assert "Traceback" not in log
    finally:
        if launcher.poll() is None:
            launcher.kill()
        if service_pid and _running(service_pid):
            os.kill(service_pid, signal.SIGKILL)


def test_the_launcher_names_itself_whatever_its_own_environment_says() -> None:
    """A launcher that inherited the variable (or was handed another value) still names itself:
    the service would otherwise stop at once, its parent not being the process named."""
    from silod.launcher import LAUNCHER_PID_ENV

    with start_service("estimator", env={LAUNCHER_PID_ENV: "1"}) as proc:  # the launcher sets its own
        time.sleep(1.5)  # three of the watch's looks
        assert proc.running()
        assert _predict(proc.address).code() == grpc.StatusCode.INVALID_ARGUMENT
