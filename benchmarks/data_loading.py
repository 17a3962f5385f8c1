"""Data-loading throughput, DLCache's method on a small scale: a plain PyTorch DataLoader reading
the remote store vs silod (cold and warm cache), with GPU compute emulated by a sleep per batch.

Run: ``python benchmarks/data_loading.py`` (about 4 minutes on 2 cores; ``--quick`` for a
smaller run). Prints the command, a table and the targets:

- warm silod >= 3x the plain DataLoader when IO-bound (compute 0);
- compute-bound (every point where the plain DataLoader itself waited for its loader less than
  3% of the time, i.e. was limited by compute): silod cold and warm within 3% of the plain
  DataLoader (DLCache lost up to 7.7% there). The plain loader reads ~100 samples/s from the
  emulated store on a quiet 2-core machine (fewer when the CPUs are busy: its s3fs workers need
  CPU per request), so with batches of 256 it is limited by compute only from ~2.6 s per batch
  on: the default sweep (0, 0.25, 1 s) therefore ends with an ``auto`` point, 1.5x the plain
  loader's time per batch measured at compute 0 in the same run (4 s on a quiet machine);
- the local hit path (Lease + read the files + release, one process) >= 70% of reading the same
  files straight from local disk.

Long compute steps would make a full epoch take minutes, so a point reads at most
``--point-seconds`` of compute worth of batches, but at least two per worker (the first round
is loaded in parallel before timing starts; the second shows whether loading keeps up): the
4 s point reads 8 of the 12 batches. Its warm run then replays the cold run's order (the samples the cold run cached); a
point that reads the whole epoch measures the warm run on the next epoch's order.

The remote store is ``silod store-emulator`` (services/devstore/emulator.py) on loopback: a minimal
S3 API (ListObjectsV2, HEAD, GET with Range and If-Match) in aiohttp, in its own process, with
one bandwidth limit shared by all connections and a per-request latency. Both the plain DataLoader (s3fs, like a user's ``fsspec.open``) and the cache server
(the dataset's ``s3://`` URI with ``endpoint_url``) read through it, so the emulated limits
apply to both. Samples are ~114 KB (ImageNet's mean), batch 256, 4 DataLoader workers.

Page cache: the emulator throttles every byte it sends, so whether its files are in the page
cache does not matter; for the local comparison the source files are re-created just before
(both sides then read page-cached files: the cache's tmpfs copies vs the fresh sources).
"""

from __future__ import annotations

import argparse
import math
import os
import pathlib
import shutil
import sys
import tempfile
import time
from typing import Any

try:
    import silod  # noqa: F401
except ImportError:  # run from a clone without installing
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

BUCKET = "bench"
PREFIX = "train"


# -- the benchmark ------------------------------------------------------------------------------------


def to_tensor(data: bytes) -> Any:
    """The stand-in for decoding: bytes -> a uint8 tensor. Batches of tensors reach the training
    process through shared memory, as decoded images do; raw bytes would be pickled through a
    pipe (~30 MB per batch) and that copy, not the loader, would bound the compute-bound case."""
    import numpy as np
    import torch

    return torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy())


class PlainS3Dataset:
    """What a user writes without silod: one fsspec read per sample, in DataLoader workers."""

    def __init__(self, endpoint: str, keys: list[str]) -> None:
        self.endpoint = endpoint
        self.keys = keys
        self._fs: Any = None
        self._pid = 0

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, index: int) -> bytes:
        if self._pid != os.getpid():
            import s3fs

            self._fs = s3fs.S3FileSystem(endpoint_url=self.endpoint, skip_instance_cache=True)
            self._pid = os.getpid()
            # s3fs closes its session from an exit hook on fsspec's IO loop, which a worker shut
            # down mid-epoch has already stopped; the "attached to a different loop" error that
            # loop then logs is about closing, not reading (a failed read raises in cat_file).
            import fsspec.asyn

            fsspec.asyn.get_loop().set_exception_handler(lambda loop, context: None)
        return to_tensor(self._fs.cat_file(f"{BUCKET}/{PREFIX}/{self.keys[index]}"))


def run_epoch(loader: Any, compute_s: float, sampler: Any = None, epoch: int = 0,
              max_batches: int = 0) -> tuple[int, float, float]:
    """(samples, seconds, seconds blocked waiting for the loader), from the arrival of the first
    batch to the end of the last batch's compute: worker start-up (first batch) and shutdown
    (after the last) are paid once by every loader alike and would dominate a short epoch.
    ``max_batches`` > 0 stops after that many batches (the rest of the epoch is not read)."""
    if sampler is not None:
        sampler.set_epoch(epoch)
    iterator = iter(loader)
    batch = next(iterator)
    started = time.perf_counter()
    samples, blocked, finished, batches = 0, 0.0, started, 0
    while True:
        samples += len(batch)
        batches += 1
        if compute_s:
            time.sleep(compute_s)
        finished = time.perf_counter()
        if batches == max_batches:
            break
        try:
            batch = next(iterator)
        except StopIteration:
            break
        blocked += time.perf_counter() - finished
    del iterator  # shuts the workers down before the next loader starts its own
    return samples, finished - started, blocked


def make_files(root: pathlib.Path, count: int, size: int) -> list[str]:
    keys = []
    for i in range(count):
        key = f"c{i % 16:02d}/{i:06d}.jpg"
        path = root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(size))
        keys.append(key)
    return keys


def bench_directories() -> tuple[pathlib.Path, pathlib.Path]:
    """(work dir, tmpfs dir) of a run; botocore gets credentials (the emulator ignores them)."""
    for name, value in {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                        "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}.items():
        os.environ.setdefault(name, value)
    work = pathlib.Path(tempfile.mkdtemp(prefix="silod-bench-"))
    shm = pathlib.Path(tempfile.mkdtemp(prefix="silod-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    return work, shm


def recreate(root: pathlib.Path, keys: list[str]) -> None:
    """Rewrite every file with its own bytes: fresh files, as hot in the page cache as the cache's copies."""
    for key in keys:
        path = root / key
        data = path.read_bytes()
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)


def local_comparison(root: pathlib.Path, dataset: Any, batch: int, rounds: int) -> tuple[float, float]:
    """files/s of raw local reads vs the silod hit path, one process, same batches. Both keep a
    batch's bytes until the batch is complete (fresh memory for every batch: page faults cost
    as much as the copy, so a loop that reuses one buffer would not be a loader)."""
    import random

    recreate(root, dataset.keys)
    n = len(dataset)
    order = list(range(n))
    random.Random(0).shuffle(order)
    batches = [order[i : i + batch] for i in range(0, n - batch + 1, batch)]
    dataset.read_batch(batches[0])  # warm the channel
    raw_best = silod_best = 0.0
    for _ in range(rounds):
        t0 = time.perf_counter()
        for b in batches:  # a batch's bytes stay alive until it is complete, as in any loader
            batch_bytes = []
            for i in b:
                with open(root / dataset.keys[i], "rb") as f:
                    batch_bytes.append(f.read())
            del batch_bytes
        raw_best = max(raw_best, len(batches) * batch / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        for b in batches:
            dataset.read_batch(b)
        silod_best = max(silod_best, len(batches) * batch / (time.perf_counter() - t0))
    return raw_best, silod_best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=12, help="batches per epoch (default 12)")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--sample-bytes", type=int, default=114_000)
    parser.add_argument("--compute", default="0,0.25,1,auto",
                        help="seconds of emulated GPU compute per batch, comma-separated; 'auto' = 1.5x the plain "
                             "loader's time per batch at the first point (compute 0), rounded up to 0.5 s "
                             "(default 0,0.25,1,auto)")
    parser.add_argument("--point-seconds", type=float, default=25.0,
                        help="a point reads at most this much compute worth of batches, but at least two per "
                             "worker (default 25)")
    parser.add_argument("--bandwidth-mb", type=float, default=100.0, help="store bandwidth, MB/s (default 100)")
    parser.add_argument("--latency-ms", type=float, default=20.0, help="store latency per request, ms (default 20)")
    parser.add_argument("--workers", type=int, default=4, help="DataLoader workers (default 4)")
    parser.add_argument("--quick", action="store_true", help="6 batches of 128, compute 0, 0.5 and auto")
    args = parser.parse_args()
    if args.quick:
        args.batches, args.batch_size, args.compute, args.point_seconds = 6, 128, "0,0.5,auto", 8.0
    computes: list[Any] = [c.strip() if c.strip() == "auto" else float(c) for c in args.compute.split(",")]
    if "auto" in computes and computes[0] != 0:
        parser.error("--compute: 'auto' needs 0 as the first point (it is derived from the plain loader's rate there)")
    print("command: python benchmarks/data_loading.py " + " ".join(sys.argv[1:]))
    # The plain loader's s3fs workers need CPU per request: on a busy machine they slow down and
    # need a longer compute step to be compute-bound, so the load is part of the result.
    print("load average at start: {:.1f} {:.1f} {:.1f}".format(*os.getloadavg()))

    import warnings

    import torch.utils.data

    # 4 workers on 2 cores is the point (they wait on the store, not on the CPU).
    warnings.filterwarnings("ignore", message="This DataLoader will create")

    from silod.data import EpochShuffleSampler, SilodDataset
    from silod.launcher import start_service
    from silod.cli.main import main as silod_main

    work, shm = bench_directories()
    procs: list[Any] = []
    try:
        count = args.batches * args.batch_size
        # The emulator serves ROOT/<bucket>/<key>: the dataset is s3://BUCKET/PREFIX.
        store = work / "s3" / BUCKET / PREFIX
        keys = make_files(store, count, args.sample_bytes)
        dataset_bytes = count * args.sample_bytes
        emulator = start_service("store-emulator", "--root", str(work / "s3"), "--bandwidth-mb-s",
                                 str(args.bandwidth_mb), "--latency-ms", str(args.latency_ms), "--log-level", "warning",
                                 workdir=work / "emulator")
        procs.append(emulator)
        endpoint = f"http://{emulator.address}"
        metadata = start_service("metadata", "--db", f"sqlite:///{work / 'meta.db'}", "--log-level", "warning",
                                 workdir=work / "metadata")
        procs.append(metadata)
        code = silod_main(["dataset", "register", "bench", f"s3://{BUCKET}/{PREFIX}", "--option",
                           f"endpoint_url={endpoint}", "--metadata", metadata.address])
        if code:
            raise SystemExit("registration failed")
        print(f"store emulator: {args.bandwidth_mb:g} MB/s shared, {args.latency_ms:g} ms per request; "
              f"{count} samples of {args.sample_bytes} B ({dataset_bytes / 1e6:.0f} MB), batch {args.batch_size}, "
              f"{args.workers} workers")

        def loader(dataset: Any, sampler: Any = None) -> Any:
            return torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler,
                                               shuffle=sampler is None, num_workers=args.workers,
                                               multiprocessing_context="fork", prefetch_factor=2)

        rows = []
        for i, compute in enumerate(computes):
            if compute == "auto":
                # Long enough for the plain loader to be limited by compute with a margin for the
                # machine's load changing during the run.
                plain_rate = rows[0][1][0] / rows[0][1][1]
                compute = math.ceil(2 * 1.5 * args.batch_size / plain_rate) / 2
            # At least two batches per worker: the first round of batches is loaded in parallel
            # before timing starts, so only the second round shows whether loading keeps up.
            batches = args.batches if not compute else min(
                args.batches, max(2 * args.workers, math.ceil(args.point_seconds / compute)))
            limit = batches if batches < args.batches else 0
            plain = run_epoch(loader(PlainS3Dataset(endpoint, sorted(keys))), compute, max_batches=limit)
            run = shm / f"run-{compute}"
            cache = start_service(
                "cache-server", "--metadata-address", metadata.address, "--memory-cache-dir", str(run / "mem"),
                "--memory-cache-bytes", str(2 * dataset_bytes), "--disk-cache-dir", str(work / f"disk-{compute}"),
                "--disk-cache-bytes", str(dataset_bytes), "--log-level", "warning", workdir=work / f"cache-{compute}",
            )
            procs.append(cache)
            dataset = SilodDataset("bench", cache_addr=cache.address, metadata_addr=metadata.address, job_id="bench",
                                   transform=to_tensor)
            sampler = EpochShuffleSampler(dataset, seed=0, prefetch_ahead=2 * args.batch_size)
            cold = run_epoch(loader(dataset, sampler), compute, sampler, 0, max_batches=limit)
            # A part epoch cached what it read (and what was prefetched): replay that order.
            warm = run_epoch(loader(dataset, sampler), compute, sampler, 0 if limit else 1, max_batches=limit)
            rows.append((compute, plain, cold, warm))
            if i < len(computes) - 1:
                cache.terminate()
                procs.remove(cache)
        # Last, in this process (which then uses gRPC itself and must fork no more workers):
        # the warm cache of the last run against raw reads of the same files.
        local = local_comparison(store, dataset, args.batch_size, 3)

        print()
        print(f"{'compute s/batch':>15} {'batches':>7} {'bound':>6} | {'plain':>6} {'silod cold':>10} {'silod warm':>10} | "
              f"{'cold/plain':>10} {'warm/plain':>10} | loader-blocked share: plain/cold/warm   (samples/s)")
        for compute, plain, cold, warm in rows:
            rate = [s / t for s, t, _ in (plain, cold, warm)]
            bound = args.batch_size / compute if compute else float("inf")
            blocked = "/".join(f"{b / t:.0%}" for _, t, b in (plain, cold, warm))
            print(f"{compute:>15g} {plain[0] // args.batch_size:>7} {bound:>6.0f} | {rate[0]:>6.0f} {rate[1]:>10.0f} "
                  f"{rate[2]:>10.0f} | {rate[1] / rate[0]:>9.3f}x {rate[2] / rate[0]:>9.3f}x | {blocked}")
        raw, hit = local
        print(f"\nlocal hit path, one process, batches of {args.batch_size}: raw local reads {raw:,.0f} files/s, "
              f"silod lease + read {hit:,.0f} files/s = {hit / raw:.0%} of raw")
        # Compute-bound = the plain DataLoader itself was limited by compute: it waited for its
        # workers less than 3% of the time. Only there is "within 3% of plain" a statement about
        # the cache's overhead rather than about the store.
        io_rows = [r for r in rows if r[0] == 0]
        cb_rows = [r for r in rows if r[0] > 0 and r[1][2] <= 0.03 * r[1][1]]
        print("load average at the end: {:.1f} {:.1f} {:.1f}".format(*os.getloadavg()))
        print("\ntargets:")
        if io_rows:
            _, plain, _, warm = io_rows[0]
            ratio = (warm[0] / warm[1]) / (plain[0] / plain[1])
            print(f"  IO-bound warm >= 3x plain: {ratio:.1f}x  {'ok' if ratio >= 3 else 'MISSED'}")
        for compute, plain, cold, warm in cb_rows:
            base = plain[0] / plain[1]
            for name, run in (("cold", cold), ("warm", warm)):
                share = (run[0] / run[1]) / base
                print(f"  compute-bound ({compute:g} s/batch) silod {name} within 3% of plain: {share:.1%}  "
                      f"{'ok' if share >= 0.97 else 'MISSED'}")
        if not cb_rows:
            print("  compute-bound: NOT SHOWN -- the plain DataLoader was IO-bound at every point; add a longer --compute")
        print(f"  local hit path >= 70% of raw reads: {hit / raw:.0%}  {'ok' if hit / raw >= 0.7 else 'MISSED'}")
        return 0
    finally:
        for proc in reversed(procs):
            proc.close()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
