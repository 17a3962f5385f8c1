"""CPU per S3 GET of the clients side by side, against one moto server: blocking, in threads
(what the SDK's direct reads use): silod's ``s3_http``, obstore (Rust object_store) and s3fs
``cat_file`` (aiobotocore); on one asyncio event loop (what the cache server uses): silod's
``AsyncS3Http`` (asyncio streams) and aiohttp's client.

Run: ``python benchmarks/s3_clients.py`` (about a minute on 2 cores; ``--requests`` GETs per
client and round, ``--threads`` client threads, ``--rounds`` rounds in rotating order,
``--store emulator`` for bodies that arrive in pieces, as from a store over a network).

moto runs in its own process, so ``time.process_time`` of this process counts only the
clients (all their threads, obstore's tokio threads included). Each GET reads the whole
object (``--size`` bytes) with ``If-Match`` where the client can send it (s3_http, obstore),
as the cache server reads one object per sample; the asyncio clients keep ``--threads``
requests in flight. Wall time is mostly moto's own CPU.
obstore is not a dependency of silod (``silod/data/s3_http.py`` says why); without it its row
says so.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import os
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BUCKET = "bench"
KEY = "sample.bin"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_moto() -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("moto server did not start")


def start_emulator(size: int) -> tuple[subprocess.Popen[bytes], str]:
    """``silod store-emulator`` holding one object of ``size`` random bytes."""
    import atexit
    import shutil
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="s3-clients-"))
    atexit.register(shutil.rmtree, root, True)
    (root / BUCKET).mkdir()
    (root / BUCKET / KEY).write_bytes(os.urandom(size))
    ready = root / "ready"
    proc = subprocess.Popen([sys.executable, "-m", "silod.cli", "store-emulator", "--root", str(root), "--listen",
                             "127.0.0.1:0", "--ready-file", str(ready), "--latency-ms", "20", "--bandwidth-mb-s", "1000",
                             "--log-level", "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit("store emulator did not start")
        time.sleep(0.1)
    return proc, f"http://{ready.read_text().strip()}"


def s3_http_get(endpoint: str, etag: str) -> Callable[[], bytes]:
    from silod.data import s3_http

    client = s3_http.S3Http(endpoint, "us-east-1")
    return lambda: client.get(BUCKET, KEY, if_match=etag)[0]


def obstore_get(endpoint: str, etag: str) -> Callable[[], bytes]:
    import obstore
    from obstore.store import S3Store

    store = S3Store(BUCKET, endpoint=endpoint, region="us-east-1",
                    access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
                    secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"],
                    client_options={"allow_http": True})
    return lambda: bytes(obstore.get(store, KEY, options={"if_match": etag}).bytes())


def s3fs_get(endpoint: str, etag: str) -> Callable[[], bytes]:
    import s3fs

    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint, "region_name": "us-east-1"})
    return lambda: fs.cat_file(f"{BUCKET}/{KEY}")


CLIENTS = {"s3_http": s3_http_get, "obstore": obstore_get, "s3fs": s3fs_get}


def s3_http_asyncio(endpoint: str, etag: str) -> tuple[Callable[[], Awaitable[bytes]], Callable[[], Awaitable[None]]]:
    from silod.data import s3_http

    client = s3_http.AsyncS3Http(endpoint, "us-east-1")

    async def get() -> bytes:
        return (await client.get(BUCKET, KEY, if_match=etag))[0]

    return get, client.close


def aiohttp_asyncio(endpoint: str, etag: str) -> tuple[Callable[[], Awaitable[bytes]], Callable[[], Awaitable[None]]]:
    """aiohttp's client with the same signed headers (``AsyncS3Http`` signs, aiohttp sends)."""
    import aiohttp
    import yarl

    from silod.data import s3_http

    signer = s3_http.AsyncS3Http(endpoint, "us-east-1")
    session: dict[str, Any] = {}

    async def get() -> bytes:
        if "s" not in session:
            session["s"] = aiohttp.ClientSession(auto_decompress=False, skip_auto_headers=("User-Agent",),
                                                 connector=aiohttp.TCPConnector(limit=128))
        path = signer._path(BUCKET, KEY)
        headers = {"If-Match": f'"{etag}"', **signer._sign("GET", path)}
        async with session["s"].get(yarl.URL(endpoint + path, encoded=True), headers=headers) as response:
            return await response.read()

    async def close() -> None:
        if "s" in session:
            await session.pop("s").close()

    return get, close


ASYNC_CLIENTS = {"s3_http asyncio": s3_http_asyncio, "aiohttp": aiohttp_asyncio}


def measure(get: Callable[[], bytes], requests: int, threads: int, size: int) -> tuple[float, float]:
    """(CPU ms per GET, wall s) of ``requests`` GETs over ``threads`` threads."""
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        for data in pool.map(lambda _: get(), range(threads * 4)):  # connections, TLS-free warm-up
            assert len(data) == size
        cpu, wall = time.process_time(), time.perf_counter()
        for data in pool.map(lambda _: get(), range(requests)):
            assert len(data) == size
        return (time.process_time() - cpu) * 1000 / requests, time.perf_counter() - wall


def measure_async(client: tuple[Callable[[], Awaitable[bytes]], Callable[[], Awaitable[None]]], requests: int,
                  in_flight: int, size: int) -> tuple[float, float]:
    """(CPU ms per GET, wall s) of ``requests`` GETs on one event loop, ``in_flight`` at a time."""
    get, close = client

    async def run() -> tuple[float, float]:
        slots = asyncio.Semaphore(in_flight)

        async def one() -> None:
            async with slots:
                assert len(await get()) == size

        await asyncio.gather(*(one() for _ in range(in_flight * 4)))  # connections
        cpu, wall = time.process_time(), time.perf_counter()
        await asyncio.gather(*(one() for _ in range(requests)))
        result = (time.process_time() - cpu) * 1000 / requests, time.perf_counter() - wall
        await close()
        return result

    return asyncio.run(run())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--size", type=int, default=114 * 1024)
    parser.add_argument("--store", choices=("moto", "emulator"), default="moto",
                        help="moto (answers in one burst) or silod store-emulator (20 ms a request, bodies paced "
                             "in 64 KiB chunks over a 1 GB/s link: they arrive in pieces, as over a network)")
    args = parser.parse_args()
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    import boto3

    proc, endpoint = start_moto() if args.store == "moto" else start_emulator(args.size)
    try:
        s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        if args.store == "moto":
            s3.create_bucket(Bucket=BUCKET)
            etag = s3.put_object(Bucket=BUCKET, Key=KEY, Body=os.urandom(args.size))["ETag"].strip('"')
        else:
            etag = s3.head_object(Bucket=BUCKET, Key=KEY)["ETag"].strip('"')
        gets, missing = {}, {}
        for name, make in {**CLIENTS, **ASYNC_CLIENTS}.items():
            try:
                gets[name] = make(endpoint, etag)
            except ImportError as exc:  # obstore is not a dependency of silod (see s3_http.py)
                missing[name] = f"not installed ({exc.name}): pip install {exc.name}"
        results: dict[str, list[tuple[float, float]]] = {name: [] for name in gets}
        names = list(gets)
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:
                run = measure_async if name in ASYNC_CLIENTS else measure
                results[name].append(run(gets[name], args.requests, args.threads, args.size))
        print(f"{args.store}, load average {os.getloadavg()[0]:.2f}; {args.requests} GETs x {args.rounds} rounds, "
              f"{args.threads} threads, {args.size} bytes each")
        print(f"{'client':10} {'CPU ms/GET':>22} {'wall s':>14} {'x s3_http CPU':>14}")
        base = min(c for c, _ in results["s3_http"])
        for name, runs in results.items():
            cpus = " ".join(f"{c:6.3f}" for c, _ in runs)
            walls = " ".join(f"{w:5.1f}" for _, w in runs)
            print(f"{name:10} {cpus:>22} {walls:>14} {min(c for c, _ in runs) / base:>13.1f}x")
        for name, why in missing.items():
            print(f"{name:10} {why}")
    finally:
        proc.terminate()
        proc.wait()


if __name__ == "__main__":
    main()
