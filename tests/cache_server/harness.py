"""Plumbing for the cache-server and SDK tests: datasets on disk, a real ``silod metadata``
process, registration through the real CLI code, and an in-process cache server whose core
the test can drive directly (apply_quotas) on the server's own event loop."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import random
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc

from cache_server.service import Settings, definition
from services.runtime.server import RunningServer, start_server
from silod.v1 import cache_pb2, cache_pb2_grpc, plan_pb2


def make_dataset(root: Path, count: int, size: int = 1000, seed: int = 0, prefix: str = "obj") -> dict[str, bytes]:
    """``count`` files of ``size`` random bytes below ``root`` (two levels of keys); returns key -> bytes."""
    rng = random.Random(seed)
    files = {}
    for i in range(count):
        key = f"{prefix}/{i % 10}/{i:06d}.bin"
        data = rng.randbytes(size)
        path = root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        files[key] = data
    return files


def silod_cli(*argv: str) -> tuple[int, str]:
    """Run ``silod ARGV`` in this process (the real CLI code); returns (exit code, stdout+stderr)."""
    from silod.cli.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(list(argv))
    return code, out.getvalue()


def register(metadata: str, name: str, uri: str, *options: str, replace: bool = False) -> None:
    argv = ["dataset", "register", name, uri, "--metadata", metadata]
    for option in options:
        argv += ["--option", option]
    if replace:
        argv.append("--replace")
    code, output = silod_cli(*argv)
    assert code == 0, output


def quota(job_id: str, dataset: str, cache_bytes: int, io_rate: int = 0, policy: str = "") -> plan_pb2.JobCacheQuota:
    return plan_pb2.JobCacheQuota(
        job_id=job_id, dataset=dataset, cache_quota_bytes=cache_bytes, remote_io_bytes_per_s=io_rate, cache_policy=policy
    )


class InProcessCache:
    """``silod cache-server`` via start_server on a private event-loop thread."""

    def __init__(self, tmp: Path, metadata: str, **overrides: Any) -> None:
        values: dict[str, Any] = {
            "metadata_address": metadata,
            "memory_cache_dir": str(tmp / "mem"),
            "memory_cache_bytes": 0,
            "disk_cache_dir": str(tmp / "disk"),
            "disk_cache_bytes": 64 << 20,
            "log_level": "warning",
            "node": "test-node",
            "fsync": False,
        }
        values.update(overrides)
        self.settings = Settings(**values)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="cache-server", daemon=True)
        self._thread.start()
        self.definition = definition(self.settings)
        self.core = self.definition.core  # type: ignore[attr-defined]
        try:
            self.running: RunningServer = self.run(start_server(self.definition, self.settings))
        except BaseException:
            self._shutdown_loop()
            raise
        self.address = self.running.address
        self.channel = grpc.insecure_channel(self.address)
        self.stub = cache_pb2_grpc.CacheServiceStub(self.channel)

    def run(self, coroutine: Any, timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a plain function of the core on the server's loop (the core is single-threaded)."""

        async def wrapper() -> Any:
            return fn(*args)

        return self.run(wrapper())

    def apply_quotas(self, quotas: list[plan_pb2.JobCacheQuota], version: int) -> bool:
        return self.call(self.core.apply_quotas, quotas, version)

    def lease(self, job: str, dataset: str, keys: list[str], lease_s: float = 0) -> cache_pb2.LeaseResponse:
        return self.stub.Lease(cache_pb2.LeaseRequest(job_id=job, dataset=dataset, keys=keys, lease_s=lease_s))

    def read_all(self, job: str, dataset: str, keys: list[str]) -> dict[str, bytes]:
        out: dict[str, bytearray] = {}
        for chunk in self.stub.Read(cache_pb2.ReadRequest(job_id=job, dataset=dataset, keys=keys)):
            out.setdefault(chunk.key, bytearray()).extend(chunk.data)
        return {k: bytes(v) for k, v in out.items()}

    def stats(self, job: str = "") -> cache_pb2.StatsResponse:
        return self.stub.Stats(cache_pb2.StatsRequest(job_id=job))

    def stop(self) -> None:
        self.channel.close()
        try:
            self.run(self.running.stop(0))
        finally:
            self._shutdown_loop()

    def _shutdown_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def __enter__(self) -> InProcessCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def read_leased(response: cache_pb2.LeaseResponse) -> dict[str, bytes]:
    return {obj.key: Path(obj.path).read_bytes() for obj in response.objects}


def aws_test_env() -> dict[str, str]:
    return {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }


@contextlib.contextmanager
def moto_s3() -> Iterator[str]:
    """A real S3-protocol server (moto) on a free loopback port; yields its endpoint URL."""
    from moto.server import ThreadedMotoServer

    for name, value in aws_test_env().items():
        os.environ.setdefault(name, value)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


def digests(values: Any) -> list[str]:
    import hashlib

    return sorted(hashlib.sha256(v).hexdigest() for v in values)


def start_job(*argv: str, env: dict[str, str] | None = None) -> Any:
    """Start ``python -m tests.sdk.sdk_job ARGV`` (a training job's data loop) from the repo root,
    in its own process group; its output goes to files (forked DataLoader workers may outlive it)."""
    import subprocess
    import sys
    import tempfile

    root = Path(__file__).resolve().parents[2]
    out = tempfile.NamedTemporaryFile("w+", prefix="sdk-job-", suffix=".out", delete=False)  # noqa: SIM115
    err = tempfile.NamedTemporaryFile("w+", prefix="sdk-job-", suffix=".err", delete=False)  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.sdk.sdk_job", *argv],
        cwd=root,
        env={**os.environ, **(env or {}), "PYTHONPATH": str(root)},
        stdout=out,
        stderr=err,
        text=True,
        start_new_session=True,
    )
    proc.out_path, proc.err_path = out.name, err.name  # type: ignore[attr-defined]
    out.close()
    err.close()
    return proc


def stop_job(proc: Any) -> str:
    """Kill a job and its workers; returns its stderr."""
    import signal

    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)
    return Path(proc.err_path).read_text(errors="replace")


def finish_job(proc: Any, timeout: float = 120) -> tuple[dict[str, Any], str]:
    """Wait for a job from :func:`start_job`; returns (its JSON report, its stderr)."""
    import json
    import subprocess

    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"job still running after {timeout:g}s; stderr:\n{stop_job(proc)}") from None
    err = Path(proc.err_path).read_text(errors="replace")
    out = Path(proc.out_path).read_text(errors="replace")
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1]), err
