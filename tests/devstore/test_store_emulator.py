"""``silod store-emulator`` as a real process: one bandwidth limit shared by all connections, a
latency per request, the S3 subset s3fs and the cache server use (a dataset registered through
it and read by a real ``silod cache-server``), /healthz, /metrics, graceful SIGTERM, and flags
that are refused with exit code 2 naming the flag."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from silod.v1 import cache_pb2, cache_pb2_grpc
from tests.cache_server.harness import silod_cli
from tests.support.procs import REPO_ROOT, ServiceProcess, start_service


def _no_aws_env() -> dict[str, str]:
    """The environment without AWS credentials: the emulator must work for anonymous clients."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env["AWS_EC2_METADATA_DISABLED"] = "true"  # no instance-metadata probe on a laptop or CI box
    return env


def _emulator(root: Path, workdir: Path, *flags: str) -> ServiceProcess:
    return start_service("store-emulator", "--root", str(root), *flags, workdir=workdir)


def _get(url: str, headers: dict[str, str] | None = None, method: str = "GET") -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def _metric(address: str, name: str) -> float:
    _, _, body = _get(f"http://{address}/metrics")
    for line in body.decode().splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rpartition(" ")[2])
    raise AssertionError(f"{name} not in /metrics:\n{body.decode()}")


def test_two_concurrent_readers_share_one_bandwidth_limit(tmp_path: Path) -> None:
    rate = 4e6  # bytes/s; 2 x 6 MB = 3 s of transfer, long enough that setup costs are noise
    size = 6_000_000
    bucket = tmp_path / "root" / "bw"
    bucket.mkdir(parents=True)
    payloads = {name: os.urandom(size) for name in ("a.bin", "b.bin")}
    for name, data in payloads.items():
        (bucket / name).write_bytes(data)
    with _emulator(tmp_path / "root", tmp_path / "emu", "--bandwidth-mb-s", "4") as emu:
        # One reader alone gets the whole link ...
        started = time.monotonic()
        status, _, body = _get(f"http://{emu.address}/bw/a.bin")
        alone = size / (time.monotonic() - started)
        assert status == 200 and body == payloads["a.bin"]

        # ... two readers at once share it: together they get the configured rate, each half.
        barrier = threading.Barrier(2)
        spans: dict[str, tuple[float, float, bytes]] = {}

        def read(name: str) -> None:
            barrier.wait()
            t0 = time.monotonic()
            _, _, data = _get(f"http://{emu.address}/bw/{name}")
            spans[name] = (t0, time.monotonic(), data)

        threads = [threading.Thread(target=read, args=(name,)) for name in payloads]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        sent = _metric(emu.address, "silod_store_emulator_sent_bytes_total")
    assert {name: data for name, (_, _, data) in spans.items()} == payloads
    first = min(t0 for t0, _, _ in spans.values())
    last = max(t1 for _, t1, _ in spans.values())
    together = 2 * size / (last - first)
    each = [size / (t1 - t0) for t0, t1, _ in spans.values()]
    print(f"\nconfigured {rate:,.0f} B/s; one reader {alone:,.0f} B/s; two readers together {together:,.0f} B/s, "
          f"each {each[0]:,.0f} and {each[1]:,.0f} B/s")
    assert alone == pytest.approx(rate, rel=0.10)
    assert together == pytest.approx(rate, rel=0.10)
    # Interleaved chunk by chunk: neither reader finishes long before the other.
    assert all(e == pytest.approx(rate / 2, rel=0.15) for e in each)
    assert sent == 3 * size  # the counter /metrics exposes is the bytes served


def test_latency_is_added_to_every_request(tmp_path: Path) -> None:
    bucket = tmp_path / "root" / "lat"
    bucket.mkdir(parents=True)
    (bucket / "small.bin").write_bytes(b"x" * 1000)
    (bucket / "mb.bin").write_bytes(os.urandom(1_000_000))
    with _emulator(tmp_path / "root", tmp_path / "emu", "--latency-ms", "200", "--bandwidth-mb-s", "2") as emu:
        base = f"http://{emu.address}/lat"
        timings = {}
        for what, url, method in (("head", f"{base}/small.bin", "HEAD"), ("get", f"{base}/small.bin", "GET"),
                                  ("list", f"{base}?list-type=2", "GET")):
            t0 = time.monotonic()
            status, _, _ = _get(url, method=method)
            timings[what] = time.monotonic() - t0
            assert status == 200, what
        t0 = time.monotonic()
        status, _, body = _get(f"{base}/mb.bin")
        big = time.monotonic() - t0
        assert status == 200 and len(body) == 1_000_000
        # /healthz and /metrics are the emulator's own: no emulated latency.
        t0 = time.monotonic()
        assert _get(f"http://{emu.address}/healthz")[0] == 200
        health = time.monotonic() - t0
    print(f"\nlatency 200 ms: head {timings['head']:.3f} s, get {timings['get']:.3f} s, list {timings['list']:.3f} s; "
          f"1 MB at 2 MB/s {big:.3f} s; healthz {health:.3f} s")
    # Lower bounds are exact (the emulator sleeps that long); the upper bounds leave room for a busy machine.
    for what, seconds in timings.items():
        assert 0.2 <= seconds < 0.2 + 0.5, what
    # latency + size / bandwidth, less the idle link's credit of 25 ms (SharedLink.slack_s)
    assert 0.2 + 0.5 - 0.025 <= big < 0.2 + 0.5 + 0.5
    assert health < 0.2


def test_s3_subset_ranges_if_match_listing_pages_and_errors(tmp_path: Path) -> None:
    bucket = tmp_path / "root" / "api"
    for i in range(25):
        path = bucket / "train" / f"d{i % 3}" / f"{i:03d}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(bytes([i]) * (100 + i))
    (bucket / "train" / ".hidden").write_bytes(b"not an object")
    env = _no_aws_env()
    with _emulator(tmp_path / "root", tmp_path / "emu") as emu:
        # botocore, anonymous (unsigned), as s3fs with anon=true sends it.
        script = f"""
import json, botocore.session
from botocore import UNSIGNED
from botocore.config import Config
s3 = botocore.session.get_session().create_client("s3", endpoint_url="http://{emu.address}", region_name="us-east-1",
                                                  config=Config(signature_version=UNSIGNED))
out = {{"buckets": [b["Name"] for b in s3.list_buckets()["Buckets"]]}}
keys, token = [], None
while True:
    kw = {{"ContinuationToken": token}} if token else {{}}
    page = s3.list_objects_v2(Bucket="api", Prefix="train/", MaxKeys=7, **kw)
    keys += [o["Key"] for o in page.get("Contents", [])]
    if not page["IsTruncated"]:
        break
    token = page["NextContinuationToken"]
out["keys"] = keys
top = s3.list_objects_v2(Bucket="api", Prefix="train/", Delimiter="/")
out["prefixes"] = [p["Prefix"] for p in top.get("CommonPrefixes", [])]
paged, token = [], None  # pages that end inside a common prefix must not repeat it
while True:
    kw = {{"ContinuationToken": token}} if token else {{}}
    page = s3.list_objects_v2(Bucket="api", Prefix="train/", Delimiter="/", MaxKeys=2, **kw)
    paged += [p["Prefix"] for p in page.get("CommonPrefixes", [])]
    if not page["IsTruncated"]:
        break
    token = page["NextContinuationToken"]
out["paged_prefixes"] = paged
head = s3.head_object(Bucket="api", Key="train/d1/004.bin")
out["size"] = head["ContentLength"]
etag = head["ETag"]
out["range"] = s3.get_object(Bucket="api", Key="train/d1/004.bin", Range="bytes=10-19")["Body"].read().hex()
out["if_match"] = len(s3.get_object(Bucket="api", Key="train/d1/004.bin", IfMatch=etag)["Body"].read())
errors = {{}}
for name, call in (("stale", lambda: s3.get_object(Bucket="api", Key="train/d1/004.bin", IfMatch='"0"')),
                   ("missing", lambda: s3.get_object(Bucket="api", Key="train/nope")),
                   ("escape", lambda: s3.get_object(Bucket="api", Key="../api/train/d1/004.bin")),
                   ("bucket", lambda: s3.list_objects_v2(Bucket="nobucket"))):
    try:
        call()
        errors[name] = "no error"
    except Exception as exc:
        errors[name] = exc.response["Error"]["Code"]
out["errors"] = errors
print(json.dumps(out))
"""
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60,
                                cwd=REPO_ROOT)
        assert result.returncode == 0, result.stderr
    import json

    out = json.loads(result.stdout)
    assert out["buckets"] == ["api"]
    assert out["keys"] == sorted(f"train/d{i % 3}/{i:03d}.bin" for i in range(25))  # 4 pages of 7, no dot-files
    assert out["prefixes"] == ["train/d0/", "train/d1/", "train/d2/"]
    assert out["paged_prefixes"] == out["prefixes"]
    assert out["size"] == 104
    assert out["range"] == (bytes([4]) * 10).hex()
    assert out["if_match"] == 104
    assert out["errors"]["stale"] == "PreconditionFailed"
    assert out["errors"]["missing"] == "NoSuchKey"
    assert out["errors"]["escape"] in ("NoSuchKey", "404")  # never a file outside the bucket
    assert out["errors"]["bucket"] == "NoSuchBucket"


def test_dataset_registered_through_the_emulator_is_read_by_a_real_cache_server(tmp_path: Path, metadata: str) -> None:
    """The s3fs path end to end, anonymously: ``silod dataset register NAME s3://BUCKET/PREFIX
    --option endpoint_url=... --option anon=true``, a ``silod cache-server`` process reading it
    (misses through the emulator, hits from its tier), and a file replaced after registration
    caught by the If-Match on the cache server's GET."""
    prefix = tmp_path / "root" / "demo" / "train"
    objects = {f"c{i % 4}/{i:04d}.jpg": os.urandom(20_000 + i) for i in range(60)}
    for key, data in objects.items():
        (prefix / key).parent.mkdir(parents=True, exist_ok=True)
        (prefix / key).write_bytes(data)
    env = _no_aws_env()
    with _emulator(tmp_path / "root", tmp_path / "emu", "--bandwidth-mb-s", "20", "--latency-ms", "5") as emu:
        endpoint = f"http://{emu.address}"
        result = subprocess.run(
            [sys.executable, "-m", "silod.cli", "dataset", "register", "emu-ds", "s3://demo/train",
             "--option", f"endpoint_url={endpoint}", "--option", "anon=true", "--metadata", metadata],
            capture_output=True, text=True, env=env, timeout=60, cwd=REPO_ROOT)
        assert result.returncode == 0, result.stderr
        assert "60 objects" in result.stdout
        listing_bytes = _metric(emu.address, "silod_store_emulator_sent_bytes_total")
        assert listing_bytes == 0  # listing sends no object bytes

        with start_service("cache-server", "--metadata-address", metadata, "--disk-cache-dir", str(tmp_path / "disk"),
                           "--memory-cache-bytes", "0", "--log-level", "warning", env=env,
                           workdir=tmp_path / "cs") as cache:
            stub = cache_pb2_grpc.CacheServiceStub(grpc.insecure_channel(cache.address))
            changed = "c0/0000.jpg"
            keys = sorted(k for k in objects if k != changed)
            cold = stub.Lease(cache_pb2.LeaseRequest(job_id="j", dataset="emu-ds", keys=keys))
            assert {o.key: Path(o.path).read_bytes() for o in cold.objects} == {k: objects[k] for k in keys}
            assert {o.tier for o in cold.objects} == {"remote"}
            stub.ReleaseLease(cache_pb2.ReleaseLeaseRequest(lease_id=cold.lease_id))
            warm = stub.Lease(cache_pb2.LeaseRequest(job_id="j", dataset="emu-ds", keys=keys))
            assert {o.tier for o in warm.objects} == {"disk"}
            stub.ReleaseLease(cache_pb2.ReleaseLeaseRequest(lease_id=warm.lease_id))
            assert _metric(emu.address, "silod_store_emulator_sent_bytes_total") == sum(len(objects[k]) for k in keys)

            # Replaced in the store after registration: the cache server's GET carries
            # If-Match with the registered ETag, the emulator answers 412, and the lease fails
            # naming the key instead of serving other bytes than the manifest's.
            (prefix / changed).write_bytes(os.urandom(20_000))
            with pytest.raises(grpc.RpcError) as info:
                stub.Lease(cache_pb2.LeaseRequest(job_id="j", dataset="emu-ds", keys=[changed]))
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert info.value.details().startswith("keys[0]:") and "changed in the store" in info.value.details()


def test_sigterm_lets_a_transfer_in_flight_finish_and_removes_the_ready_file(tmp_path: Path) -> None:
    bucket = tmp_path / "root" / "slow"
    bucket.mkdir(parents=True)
    payload = os.urandom(2_000_000)
    (bucket / "big.bin").write_bytes(payload)
    emu = _emulator(tmp_path / "root", tmp_path / "emu", "--bandwidth-mb-s", "1")  # 2 s for the object
    try:
        assert _get(f"http://{emu.address}/healthz")[0] == 200
        assert silod_cli("health", f"http://{emu.address}/healthz") == (0, "SERVING\n")  # what a healthcheck runs
        got: list[bytes] = []
        reader = threading.Thread(target=lambda: got.append(_get(f"http://{emu.address}/slow/big.bin")[2]))
        reader.start()
        deadline = time.monotonic() + 10
        while _metric(emu.address, "silod_store_emulator_sent_bytes_total") < 200_000:
            assert time.monotonic() < deadline, "the transfer did not start"
            time.sleep(0.05)
        assert emu.terminate(timeout=15) == 0
        reader.join(30)
        assert got == [payload]  # the request in flight was served to the end
        assert list(emu.workdir.glob("*.ready")) == []
        assert "shutting down" in emu.log() and "signal=SIGTERM" in emu.log()
    finally:
        emu.close()


def _run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    from silod.cli.main import main

    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's usage errors
        code = int(exc.code or 0)
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--bandwidth-mb-s", "-1"),
        ("--bandwidth-mb-s", "fast"),
        ("--latency-ms", "-5"),
        ("--latency-ms", "nan"),
        ("--listen", "9000"),
        ("--listen", "127.0.0.1:70000"),
        ("--root", "/nonexistent/silod-store"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(flag: str, value: str, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["store-emulator", "--root", str(tmp_path), flag, value, "--ready-file", str(tmp_path / "ready")]
    code, err = _run_cli(argv, capsys)
    assert code == 2
    # Usage errors come from argparse; a --root that is not a directory is found when run.
    assert f"argument {flag}:" in err or f"{flag}: " in err, err
    assert "Traceback" not in err
    assert not (tmp_path / "ready").exists()


def test_a_bucket_named_like_an_own_endpoint_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "metrics").mkdir()
    code, err = _run_cli(["store-emulator", "--root", str(tmp_path), "--listen", "127.0.0.1:0"], capsys)
    assert code == 2
    assert "--root:" in err and "'metrics'" in err, err
