"""silod side by side with the loaders job owners pick today, on one throttled S3-protocol store
and the same bytes, against the physical limit of every row.

Run: ``python benchmarks/data_loaders.py`` (about 25 minutes on 2 busy cores, most of it the
plain loaders; ``--quick`` for a smaller run). The anchor loaders come from the ``bench`` extra (``pip install -e '.[bench]'``);
one that is missing or does not import is a row of the table that says why.

The store is ``silod store-emulator`` (one link shared by all connections, ``--bandwidth-mb``
MB/s, ``--latency-ms`` per request), holding the same samples (random bytes, ``--sample-bytes``
each) three ways: one object per sample, WebDataset tar shards, LitData chunks. Every loader
turns a sample into a uint8 tensor in its DataLoader workers (batch ``--batch-size``,
``--workers`` workers, fork), and is timed from the start of the iteration to the last batch,
worker start-up included (every loader pays it).

Loaders: ``plain`` (one s3fs ``cat_file`` per sample, 4 workers: what a user writes first),
``plain-tuned`` (the same with 16 workers and prefetch_factor 8: what a user tunes it to),
``webdataset`` (tar shards streamed through s3fs; shard shuffle plus a 1,000-sample shuffle
buffer, as its docs recommend; ``cache_dir`` keeps the shards on local disk from the first
epoch on), ``litdata`` (optimized chunks, its own S3 client and local chunk cache),
``streaming`` (Mosaic's fork ``streaming-community``: MDS shards of 32 MB, its local cache;
it imports torchvision, which needs a torch it was built for: docs/benchmarks.md shows the
second venv it runs in here), ``silod`` (one object per sample, through ``silod
cache-server``) and ``silod-shards`` (the same tar shards registered with ``--format
tar-shards``).

Rows, each with its physical limit:

- ``cold``: the first epoch, nothing cached. Limit: the link, bandwidth / sample bytes. Beside
  the loaders, ``raw GETs`` (``--loaders raw-gets``): every object read once with 64 requests
  in flight and nothing else, what the store delivers on this machine at that moment.
- ``warm``: the epochs after the first (median of ``--repeats``; min and max printed below
  the table; a loader without a cache reads the store again, one epoch). Limit: the same
  workers reading the same bytes from local files in tmpfs (``local files``: a batch of files
  per ``__getitems__`` call, as silod reads its leased files; for ``silod-shards``, ``local
  shards``: the same tar shards in tmpfs, each sample's byte range read and decoded by the same
  transform), one such epoch run right before each warm epoch of the loader, so each
  pair sees the same machine: the cell's share is against the median of the loader's own
  local epochs, and the min / median / max of the per-pair ratios is printed below the table.
- ``cache=1/2``: the dataset is twice the cache (silod: a memory tier of half the dataset,
  uniform caching), second epoch. Limit: the link for the half that is not cached,
  bandwidth / (sample bytes x 1/2), at most the local limit.
- ``2 jobs``: two jobs on one node read the dataset at the same time, each its own order;
  samples/s of both together. Limit: every byte crosses the link once,
  2 x bandwidth / sample bytes.
- ``compute``: ``--compute`` seconds of emulated GPU work (a sleep) per batch, warm where the
  loader has a cache. Limit: batch / compute.

Peak memory is the peak PSS (proportional set size: shared pages counted once across the
forked workers) of the loader's processes -- the training process and its workers, plus the
cache server for silod -- sampled every second (a sweep of ~10 processes' smaps_rollup costs
~25 ms of CPU: every 100 ms, a quarter of a core taken from the loaders on this 2-core machine),
and the cache server's own peak RSS (the kernel's high-water mark, exact).

The store emulator stands for another machine: it runs in a session of its own, so the kernel's
autogroup scheduling gives it a CPU share of its own instead of taking it from the loader
under test, whose processes (the cache server included) share one.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import statistics
import sys
import tarfile
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
try:
    import silod  # noqa: F401
except ImportError:  # run from a clone without installing
    sys.path.insert(0, str(HERE.parent))

from silod.data.shards import index_tar  # noqa: E402
from data_loading import PlainS3Dataset, bench_directories, make_files, to_tensor  # noqa: E402  (the sibling benchmark)

BUCKET = "bench"
SAMPLES_PER_SHARD = 256


# -- measuring ----------------------------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    out = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


PSS_INTERVAL_S = 1.0


def _proc_kib(pid: int, file: str, name: str) -> int:
    """Bytes of the ``name:`` line (in kB) of ``/proc/<pid>/<file>``; 0 once the process is gone."""
    try:
        with open(f"/proc/{pid}/{file}") as f:
            for line in f:
                if line.startswith(name):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _peak_rss_bytes(pid: int) -> int:
    """The kernel's high-water mark of ``pid``'s resident set (VmHWM)."""
    return _proc_kib(pid, "status", "VmHWM:")


def start_store(root: pathlib.Path, bandwidth_mb: float, latency_ms: float, workdir: pathlib.Path) -> Any:
    """``silod store-emulator`` over ``root``, in a session of its own (see the module's doc)."""
    import subprocess

    from silod.launcher import LaunchError, ServiceProcess

    workdir.mkdir(parents=True, exist_ok=True)
    ready, log = workdir / "emulator.ready", workdir / "emulator.log"
    argv = [sys.executable, "-m", "silod.cli", "store-emulator", "--root", str(root), "--listen", "127.0.0.1:0",
            "--ready-file", str(ready), "--bandwidth-mb-s", str(bandwidth_mb), "--latency-ms", str(latency_ms),
            "--log-level", "warning"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    service = ServiceProcess("store-emulator", proc, log, workdir, False)
    deadline = time.monotonic() + 60
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            service.kill()
            raise LaunchError(f"the store emulator did not start; log:\n{service.log()}")
        time.sleep(0.05)
    service.address = ready.read_text().strip()
    return service


def _pss_bytes(pid: int) -> int:
    return _proc_kib(pid, "smaps_rollup", "Pss:")


def _run_delay(pid: int) -> float:
    """Seconds the threads of ``pid`` have spent runnable but waiting for a CPU (schedstat)."""
    total = 0
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        pass
    return total / 1e9


class PeakMemory:
    """Peak PSS of this process, its descendants except ``exclude`` (the store, the metadata
    service), and ``extra`` (the cache server), sampled in a thread; and how long the job's
    processes (this one and its descendants) waited for a CPU meanwhile (sampled too: the last
    moments of a worker that exits between two samples are missed)."""

    def __init__(self, exclude: set[int], extra: list[int]) -> None:
        self.exclude, self.extra, self.peak = exclude, extra, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._delay_start = {os.getpid(): _run_delay(os.getpid())}
        self._delay: dict[int, float] = {}

    @property
    def job_wait(self) -> float:
        return sum(d - self._delay_start.get(pid, 0.0) for pid, d in self._delay.items())

    def _tree(self) -> list[int]:
        pids, todo = [], [os.getpid()]
        while todo:
            pid = todo.pop()
            if pid in self.exclude:
                continue
            pids.append(pid)
            todo += _children(pid)
        return pids + [p for p in self.extra if p not in pids]

    def _run(self) -> None:
        while True:
            stopping = self._stop.is_set()
            tree = self._tree()
            for pid in tree:
                if pid not in self.extra:
                    self._delay[pid] = _run_delay(pid)
            if stopping:
                return
            self.peak = max(self.peak, sum(_pss_bytes(p) for p in tree))
            self._stop.wait(PSS_INTERVAL_S)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _cpu_seconds(*groups: list[int]) -> tuple[float, ...]:
    """User + system CPU seconds of this process and its reaped children (the training process
    and the DataLoader workers of finished epochs), then of each group of ``pids``."""
    import resource

    own = sum(resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime
              for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    totals = [own]
    for pids in groups:
        total = 0.0
        for pid in pids:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            except OSError:
                pass
        totals.append(total)
    return tuple(totals)


class RawGets:
    """One "epoch" of the link probe: every object GET once, 64 at a time, nothing else."""

    def __init__(self, store: Any, keys: list[str], in_flight: int = 64) -> None:
        self.store, self.keys, self.in_flight = store, keys, in_flight

    def __iter__(self) -> Any:
        import asyncio

        async def run() -> list[int]:
            slots = asyncio.Semaphore(self.in_flight)

            async def one(key: str) -> int:
                async with slots:
                    return len(await self.store.read_async(key))

            try:
                return await asyncio.gather(*(one(k) for k in self.keys))
            finally:
                await self.store.aclose()

        sizes = asyncio.run(run())
        yield sizes


def timed_epoch(loader: Any, compute_s: float = 0.0, max_batches: int = 0) -> tuple[int, float]:
    """(samples, seconds) of one epoch (or its first ``max_batches``), from the start of the
    iteration (worker start-up included: every loader pays it) to the end of the last batch."""
    started = time.perf_counter()
    samples = batches = 0
    for batch in loader:
        if compute_s:
            time.sleep(compute_s)
        samples += len(batch)
        batches += 1
        if batches == max_batches:
            break
    elapsed = time.perf_counter() - started
    if os.environ.get("BENCH_DEBUG"):
        print(f"    {samples} samples in {elapsed:.2f}s", flush=True)
    return samples, elapsed


def concurrent_jobs(make: Callable[[], Any], jobs: int) -> tuple[int, float]:
    """``jobs`` epochs at once, each in a job process of its own: (samples of all, seconds of the
    slowest). Each job's loader is made, then its process forked, before the next is made (a
    loader made later must not change an earlier one: silod's job id is set per epoch). Two
    jobs on a node are two processes; two DataLoaders forking their workers from two threads
    of one process could hang for good (seen on this branch and on main)."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    go = ctx.Event()
    pipes, procs = [], []
    for _ in range(jobs):
        loader = make()
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_job_process, args=(loader, go, writer))
        proc.start()
        pipes.append(reader)
        procs.append(proc)
    go.set()
    results = [pipe.recv() for pipe in pipes]
    for proc in procs:
        proc.join()
    return sum(r[0] for r in results), max(r[1] for r in results)


def _job_process(loader: Any, go: Any, writer: Any) -> None:
    go.wait()
    writer.send(timed_epoch(loader))


@dataclass
class Usage:
    """What one measured epoch took: wall seconds and the CPU seconds of the job's processes
    (training process and DataLoader workers), of the cache server and of the store emulator."""

    samples: int = 0
    wall: float = 0.0
    cpu_job: float = 0.0
    cpu_cache: float = 0.0
    cpu_store: float = 0.0
    cache_rss: int = 0  # the cache server's peak RSS so far (bytes)
    wait_job: float = 0.0  # seconds runnable but waiting for a CPU (all threads added up)
    wait_cache: float = 0.0
    wait_store: float = 0.0

    def __str__(self) -> str:
        cache = f" + cache {self.cpu_cache:.2f}" if self.cpu_cache else ""
        rss = f"; cache server peak RSS {self.cache_rss / 2**20:,.0f} MiB" if self.cache_rss else ""
        return (f"wall {self.wall:.2f} s, CPU job {self.cpu_job:.2f}{cache} + store {self.cpu_store:.2f} s "
                f"({1e3 * (self.cpu_job + self.cpu_cache) / max(1, self.samples):.2f} ms a sample without the store)"
                f"{rss}; waited for a CPU: job {self.wait_job:.2f}"
                + (f" + cache {self.wait_cache:.2f}" if self.cpu_cache else "") + f" + store {self.wait_store:.2f} s")


@dataclass
class Cell:
    rate: float = 0.0  # samples/s
    limit: float = 0.0
    pss: int = 0
    note: str = ""
    usage: Usage = field(default_factory=Usage)


@dataclass
class Table:
    rows: list[str]
    cells: dict[tuple[str, str], Cell] = field(default_factory=dict)
    loaders: list[str] = field(default_factory=list)

    def put(self, loader: str, row: str, cell: Cell) -> None:
        if loader not in self.loaders:
            self.loaders.append(loader)
        self.cells[(loader, row)] = cell
        shown = (f"{cell.rate:,.0f}/s {cell.rate / cell.limit:.0%} {cell.pss / 2**20:,.0f} MiB; {cell.usage}"
                 if cell.rate else cell.note)
        print(f"  {loader:<13} {row:<10} {shown}", flush=True)

    def render(self) -> str:
        lines = [f"{'loader':<13} | " + " | ".join(f"{r:^26}" for r in self.rows)]
        lines.append(f"{'':<13} | " + " | ".join(f"{'samples/s  of limit  PSS':^26}" for _ in self.rows))
        for loader in self.loaders:
            parts = []
            for row in self.rows:
                cell = self.cells.get((loader, row))
                if cell is None:
                    parts.append(f"{'-':^26}")
                elif not cell.rate:
                    parts.append(f"{cell.note[:26]:^26}")
                else:
                    parts.append(f"{cell.rate:>9,.0f} {cell.rate / cell.limit:>8.0%} {cell.pss / 2**20:>5,.0f}M")
            lines.append(f"{loader:<13} | " + " | ".join(parts))
        return "\n".join(lines)


# -- the stores ---------------------------------------------------------------------------------------


def write_shards(root: pathlib.Path, files: pathlib.Path, keys: list[str]) -> list[str]:
    """The per-sample files as WebDataset shards (member ``<sample>.jpg``); returns shard keys."""
    root.mkdir(parents=True, exist_ok=True)
    shards = []
    for s in range(0, len(keys), SAMPLES_PER_SHARD):
        name = f"train-{s // SAMPLES_PER_SHARD:04d}.tar"
        with tarfile.open(root / name, "w", format=tarfile.USTAR_FORMAT) as archive:
            for key in keys[s : s + SAMPLES_PER_SHARD]:
                archive.add(files / key, arcname=key.replace("/", "_").replace(".jpg", "") + ".jpg")
        shards.append(name)
    return shards


def write_mds(root: pathlib.Path, files: pathlib.Path, keys: list[str]) -> None:
    """The samples as Mosaic streaming MDS shards of 32 MB (its own writer), in the store."""
    from streaming import MDSWriter

    with MDSWriter(out=str(root), columns={"data": "bytes"}, size_limit="32mb") as writer:
        for key in keys:
            writer.write({"data": (files / key).read_bytes()})


def write_litdata(root: pathlib.Path, files: pathlib.Path, keys: list[str], work: pathlib.Path) -> str:
    """The samples as LitData optimized chunks (its own writer), copied into the store."""
    import litdata

    out = work / "litdata-out"
    litdata.optimize(fn=_litdata_sample, inputs=[str(files / k) for k in keys], output_dir=str(out),
                     chunk_bytes="32MB", num_workers=1, mode="overwrite")
    shutil.copytree(out, root)
    return ""


def _litdata_sample(path: str) -> dict[str, Any]:
    with open(path, "rb") as f:
        return {"data": f.read()}


# -- the loaders ---------------------------------------------------------------------------------------


class WdsTensor:
    def __call__(self, sample: tuple[bytes]) -> Any:
        return to_tensor(sample[0])


def open_s3_for_webdataset(endpoint: str) -> Callable[..., Any]:
    """gopen handler for s3:// URLs (webdataset ships none that speaks to an endpoint_url)."""
    state: dict[str, Any] = {}

    def opener(url: str, mode: str = "rb", bufsize: int = 8192, **kw: Any) -> Any:
        if state.get("pid") != os.getpid():
            import s3fs

            state["fs"] = s3fs.S3FileSystem(endpoint_url=endpoint, skip_instance_cache=True)
            state["pid"] = os.getpid()
        return state["fs"].open(url, "rb", block_size=8 << 20, cache_type="readahead")

    return opener


def lit_tensor(sample: dict[str, bytes]) -> Any:
    return to_tensor(sample["data"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=8192, help="samples in the dataset (default 8192, 934 MB: "
                        "a cold epoch of 9.3 s at the link, so that start-up and the last batch do not weigh "
                        "as in a 2.3 s epoch)")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--sample-bytes", type=int, default=114_000)
    parser.add_argument("--bandwidth-mb", type=float, default=100.0)
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--compute", type=float, default=2.5, help="seconds of emulated compute per batch "
                        "in the compute row (default 2.5: more than the plain loader needs per batch)")
    parser.add_argument("--compute-batches", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=5, help="warm epochs per loader, each right after an epoch of "
                        "local files: the table shows the medians, min and max are printed below it (default 5)")
    parser.add_argument("--loaders", default="raw-gets,plain,plain-tuned,webdataset,streaming,litdata,silod,silod-shards")
    parser.add_argument("--rows", default="cold,warm,cache=1/2,2 jobs,compute")
    parser.add_argument("--quick", action="store_true", help="1024 samples, compute 1.5 s")
    args = parser.parse_args()
    if args.quick:
        args.samples, args.compute = 1024, 1.5
    loaders = [name.strip() for name in args.loaders.split(",")]
    rows = [row.strip() for row in args.rows.split(",")]
    print("command: python benchmarks/data_loaders.py " + " ".join(sys.argv[1:]))
    print("load average at start: {:.1f} {:.1f} {:.1f}".format(*os.getloadavg()), flush=True)

    import torch.utils.data

    warnings.filterwarnings("ignore", message="This DataLoader will create")
    from silod.cli.main import main as silod_main
    from silod.data import EpochShuffleSampler, SilodDataset
    from silod.data.store import ObjectStore
    from silod.launcher import start_service

    work, shm = bench_directories()
    services: list[Any] = []
    caches: list[Any] = []
    try:
        store = work / "s3" / BUCKET
        keys = make_files(store / "train", args.samples, args.sample_bytes)  # where PlainS3Dataset reads
        shard_keys = write_shards(store / "shards", store / "train", keys)
        dataset_bytes = args.samples * args.sample_bytes
        streaming_problem = ""
        if "streaming" in loaders:
            try:
                write_mds(store / "mds", store / "train", keys)
            except Exception as exc:  # noqa: BLE001 -- the table says why (an import that fails, say)
                streaming_problem = f"{type(exc).__name__}: {exc}"
        litdata_problem = ""
        if "litdata" in loaders:
            try:
                write_litdata(store / "litdata", store / "train", keys, work)
            except Exception as exc:  # noqa: BLE001 -- the table says why
                litdata_problem = f"{type(exc).__name__}: {exc}"
        local = shm / "local"
        shutil.copytree(store / "train", local)
        emulator = start_store(work / "s3", args.bandwidth_mb, args.latency_ms, work / "emulator")
        metadata = start_service("metadata", "--db", f"sqlite:///{work / 'meta.db'}", "--log-level", "warning",
                                 workdir=work / "metadata")
        services += [emulator, metadata]
        endpoint = f"http://{emulator.address}"
        for name, uri, fmt in (("bench", f"s3://{BUCKET}/train", "objects"),
                               ("bench-shards", f"s3://{BUCKET}/shards", "tar-shards")):
            if silod_main(["dataset", "register", name, uri, "--format", fmt, "--option", f"endpoint_url={endpoint}",
                           "--metadata", metadata.address]):
                raise SystemExit(f"registration of {uri} failed")
        print(f"store emulator: {args.bandwidth_mb:g} MB/s shared, {args.latency_ms:g} ms per request; {args.samples} "
              f"samples of {args.sample_bytes:,} B ({dataset_bytes / 1e6:.0f} MB; {len(shard_keys)} shards), "
              f"batch {args.batch_size}, {args.workers} workers", flush=True)

        service_pids = {p.pid for p in services}
        link = args.bandwidth_mb * 1e6 / args.sample_bytes  # samples/s the link carries

        def loader_of(dataset: Any, sampler: Any = None, workers: int = args.workers, prefetch: int = 2,
                      batch_size: int | None = args.batch_size) -> Any:
            return torch.utils.data.DataLoader(dataset, batch_size=batch_size, sampler=sampler,
                                               shuffle=sampler is None and batch_size is not None
                                               and not isinstance(dataset, torch.utils.data.IterableDataset),
                                               num_workers=workers, multiprocessing_context="fork",
                                               prefetch_factor=prefetch, persistent_workers=False)

        def measure(make: Callable[[], Any], extra_pids: list[int] | None = None, compute: float = 0.0,
                    max_batches: int = 0, jobs: int = 1) -> tuple[float, int, Usage]:
            cpu0 = _cpu_seconds(extra_pids or [], [emulator.pid])
            wait0 = [sum(_run_delay(p) for p in pids) for pids in (extra_pids or [], [emulator.pid])]
            with PeakMemory(service_pids | {c.pid for c in caches if c.pid not in (extra_pids or [])},
                            extra_pids or []) as memory:
                if jobs == 1:
                    samples, seconds = timed_epoch(make(), compute, max_batches)
                else:
                    samples, seconds = concurrent_jobs(make, jobs)
            job_cpu, cache_cpu, store_cpu = (b - a for a, b in zip(cpu0, _cpu_seconds(extra_pids or [], [emulator.pid])))
            wait_cache, wait_store = (sum(_run_delay(p) for p in pids) - w
                                      for pids, w in zip((extra_pids or [], [emulator.pid]), wait0))
            usage = Usage(samples, seconds, job_cpu, cache_cpu, store_cpu,
                          sum(_peak_rss_bytes(pid) for pid in extra_pids or []), memory.job_wait, wait_cache, wait_store)
            if os.environ.get("BENCH_DEBUG"):
                print(f"    {usage}", flush=True)
            return samples / seconds, memory.peak, usage

        spreads: dict[str, list[float]] = {}
        ratios: dict[str, list[float]] = {}  # warm epoch / the local epoch just before it
        local_pairs: dict[str, list[float]] = {}  # those local epochs (samples/s)
        local_peaks: dict[str, int] = {}  # and their peak PSS
        # The warm limit: the same workers reading the same files from tmpfs.
        paths = [str(local / key) for key in keys]

        class LocalFiles(torch.utils.data.Dataset):  # type: ignore[type-arg]
            """The files read as cheaply as a map-style dataset can: a batch per call (as silod's
            ``__getitems__``), paths made once."""

            def __len__(self) -> int:
                return len(paths)

            def __getitem__(self, i: int) -> Any:
                return self.__getitems__([i])[0]

            def __getitems__(self, indices: list[int]) -> list[Any]:
                out = []
                for i in indices:
                    with open(paths[i], "rb") as f:
                        out.append(to_tensor(f.read()))
                return out

        # The warm limit of a sharded dataset: the same tar shards in tmpfs, each sample read at its
        # byte range and decoded by the same transform as silod's shard samples.
        shutil.copytree(store / "shards", shm / "local-shards")
        ranges = []
        for shard in shard_keys:
            with open(shm / "local-shards" / shard, "rb") as f:
                ranges += [(str(shm / "local-shards" / shard), r.offset, r.length) for r in index_tar(f, shard)]

        class LocalShards(torch.utils.data.Dataset):  # type: ignore[type-arg]
            """The tar shards read as plainly as the files above: a batch per call, each sample's
            byte range with a seek and a read of its known length."""

            def __len__(self) -> int:
                return len(ranges)

            def __getitem__(self, i: int) -> Any:
                return self.__getitems__([i])[0]

            def __getitems__(self, indices: list[int]) -> list[Any]:
                out = []
                for i in indices:
                    path, offset, length = ranges[i]
                    with open(path, "rb") as f:
                        f.seek(offset)
                        out.append(_shard_tensor(f.read(length)))
                return out

        local_runs = sorted((measure(lambda: loader_of(LocalFiles())) for _ in range(args.repeats)), key=lambda r: r[0])
        local_rate, local_pss = statistics.median(r[0] for r in local_runs), max(r[1] for r in local_runs)
        spreads["local files"] = [r[0] for r in local_runs]
        limits = {"cold": link, "warm": local_rate, "cache=1/2": min(local_rate, 2 * link), "2 jobs": 2 * link,
                  "compute": args.batch_size / args.compute}
        table = Table(rows)
        table.put("local files", "warm", Cell(local_rate, local_rate, local_pss, usage=local_runs[len(local_runs) // 2][2]))
        if "cold" in rows and "raw-gets" in loaders:
            # What the store delivers here and now to a client that does nothing but GETs with
            # 64 requests in flight (the lean asyncio client, in this process).
            probe = ObjectStore(f"s3://{BUCKET}/train", {"endpoint_url": endpoint})
            rate, pss, usage = measure(lambda: RawGets(probe, keys))
            table.put("raw GETs", "cold", Cell(rate, link, pss, usage=usage))
        loaders = [name for name in loaders if name != "raw-gets"]

        def run_rows(name: str, epoch: Callable[[str], Any], has_cache: bool, extra: Callable[[], list[int]],
                     setup: Callable[[str], None] = lambda row: None, skip: dict[str, str] | None = None,
                     local: Any = LocalFiles) -> None:
            """``local``: the dataset of the warm limit's epochs, run side by side with this loader's."""
            for row in rows:
                if row in (skip or {}):
                    table.put(name, row, Cell(note=(skip or {})[row]))
                    continue
                try:
                    setup(row)
                    if row == "cold":
                        rate, pss, usage = measure(lambda: epoch("cold"), extra())
                    elif row == "warm":
                        if has_cache:
                            measure(lambda: epoch("cold"), extra())  # the first epoch fills the cache
                        # Side by side: each warm epoch right after an epoch of local files, so a
                        # pair sees the same machine; the limit is the median of this loader's pairs.
                        runs, locals_ = [], []
                        # A loader without a cache reads the store again: its warm epoch is a cold one.
                        for _ in range(args.repeats if has_cache else 1):
                            local_rate_, local_pss_, _ = measure(lambda: loader_of(local()))
                            locals_.append(local_rate_)
                            local_peaks[name] = max(local_peaks.get(name, 0), local_pss_)
                            runs.append(measure(lambda: epoch("warm" if has_cache else "cold"), extra()))
                        rate, pss = statistics.median(r[0] for r in runs), max(r[1] for r in runs)
                        spreads[name] = [r[0] for r in runs]
                        ratios[name] = [r[0] / lo for r, lo in zip(runs, locals_)]
                        local_pairs[name] = locals_
                        middle = sorted(runs, key=lambda r: r[0])[len(runs) // 2][2]
                        table.put(name, row, Cell(rate, statistics.median(locals_), pss, usage=middle))
                        continue
                    elif row == "cache=1/2":
                        if has_cache:
                            measure(lambda: epoch("cold"), extra())  # the first epoch fills the cache
                        rate, pss, usage = measure(lambda: epoch("warm" if has_cache else "cold"), extra())
                    elif row == "2 jobs":
                        rate, pss, usage = measure(lambda: epoch("cold"), extra(), jobs=2)
                    else:
                        if has_cache:
                            measure(lambda: epoch("cold"), extra())
                        rate, pss, usage = measure(lambda: epoch("warm"), extra(), compute=args.compute,
                                                   max_batches=args.compute_batches)
                    table.put(name, row, Cell(rate, limits[row], pss, usage=usage))
                except Exception as exc:  # noqa: BLE001 -- one broken loader must not hide the others
                    table.put(name, row, Cell(note=f"failed: {type(exc).__name__}"))
                    print(f"    {name} {row}: {type(exc).__name__}: {exc}", flush=True)

        no_pids: Callable[[], list[int]] = list
        for name in loaders:
            print(f"{name}:", flush=True)
            if name in ("plain", "plain-tuned"):
                workers, prefetch = (args.workers, 2) if name == "plain" else (16, 8)
                plain = PlainS3Dataset(endpoint, keys)  # reads s3://bench/train/<key>
                run_rows(name, lambda phase, w=workers, p=prefetch: loader_of(plain, workers=w, prefetch=p), False,
                         no_pids)
            elif name == "webdataset":
                try:
                    import webdataset as wds
                except ImportError as exc:
                    table.put(name, rows[0], Cell(note=f"not installed: {exc}"))
                    continue
                wds.gopen_schemes["s3"] = open_s3_for_webdataset(endpoint)
                urls = [f"s3://{BUCKET}/shards/{s}" for s in shard_keys]
                cache_dir = {"path": ""}

                def wds_epoch(phase: str) -> Any:
                    if phase == "cold":  # every cold run starts with an empty shard cache
                        cache_dir["path"] = tempfile.mkdtemp(prefix="wds-", dir=work)
                    pipeline = (wds.WebDataset(urls, shardshuffle=len(urls), cache_dir=cache_dir["path"],
                                               empty_check=False, nodesplitter=wds.single_node_only)
                                .shuffle(1000).to_tuple("jpg").map(WdsTensor())
                                .batched(args.batch_size, collation_fn=torch.stack))
                    return wds.WebLoader(pipeline, batch_size=None, num_workers=args.workers,
                                         multiprocessing_context="fork", prefetch_factor=2)

                run_rows(name, wds_epoch, True, no_pids, skip={"cache=1/2": "cache_dir: no size bound"})
            elif name == "streaming":
                if streaming_problem:
                    table.put(name, rows[0], Cell(note=f"fails: {streaming_problem.split(':')[0]}"))
                    print(f"    streaming: {streaming_problem}", flush=True)
                    continue
                import streaming
                from streaming.base.util import clean_stale_shared_memory

                class MosaicTensors(streaming.StreamingDataset):  # type: ignore[misc]
                    def __getitem__(self, index: int) -> Any:
                        return to_tensor(super().__getitem__(index)["data"])

                os.environ["S3_ENDPOINT_URL"] = endpoint  # its boto3 client's endpoint
                mosaic: dict[str, Any] = {"path": "", "row": "", "live": []}

                def mosaic_epoch(phase: str) -> Any:
                    # One StreamingDataset per local directory at a time (its shared memory is
                    # keyed by it): the previous epoch's goes first.
                    if mosaic["row"] != "2 jobs":  # two live jobs: each keeps its own
                        mosaic["live"].clear()
                        clean_stale_shared_memory()
                    if phase == "cold":
                        mosaic["path"] = tempfile.mkdtemp(prefix="mds-", dir=work)
                    # Its cache bound is in whole shards, evicted least recently used.
                    bound = {"cache_limit": dataset_bytes // 2} if mosaic["row"] == "cache=1/2" else {}
                    dataset = MosaicTensors(remote=f"s3://{BUCKET}/mds", local=mosaic["path"], shuffle=True,
                                            batch_size=args.batch_size, **bound)
                    # It fetched its index with a boto3 client that forked workers would share
                    # (one connection pool in five processes: each epoch then stalled ~60 s on a
                    # read timeout). Its own clean_up() drops it, as its pickling does for spawn.
                    for stream in dataset.streams:
                        stream._downloader.clean_up()
                    mosaic["live"].append(dataset)
                    return loader_of(dataset)

                print(f"    streaming-community {streaming.__version__}", flush=True)
                run_rows(name, mosaic_epoch, True, no_pids, lambda row: mosaic.update(row=row))
            elif name == "litdata":
                if litdata_problem:
                    table.put(name, rows[0], Cell(note="optimize failed"))
                    print(f"    litdata: {litdata_problem}", flush=True)
                    continue
                import litdata
                import litdata.streaming.downloader as lit_downloader

                # Its obstore client refuses plain http (the emulator on loopback) and LitData
                # exposes no option for it: allow it, as a user with an http endpoint would have to.
                lit_downloader._OBSTORE_CLIENT_OPTIONS = {**lit_downloader._OBSTORE_CLIENT_OPTIONS, "allow_http": "true"}
                lit: dict[str, Any] = {"path": "", "row": ""}

                def lit_epoch(phase: str) -> Any:
                    if phase == "cold":
                        lit["path"] = tempfile.mkdtemp(prefix="litdata-", dir=work)
                    # Its cache bound is a whole number of chunks, at least one.
                    bound = {"max_cache_size": dataset_bytes // 2} if lit["row"] == "cache=1/2" else {}
                    dataset = litdata.StreamingDataset(
                        f"s3://{BUCKET}/litdata", shuffle=True, cache_dir=lit["path"],
                        storage_options={"endpoint_url": endpoint}, transform=lit_tensor, **bound)
                    return litdata.StreamingDataLoader(dataset, batch_size=args.batch_size, num_workers=args.workers,
                                                       prefetch_factor=2, multiprocessing_context="fork")

                run_rows(name, lit_epoch, True, no_pids, lambda row: lit.update(row=row))
            elif name in ("silod", "silod-shards"):
                registered = "bench" if name == "silod" else "bench-shards"
                transform = to_tensor if name == "silod" else _shard_tensor
                state: dict[str, Any] = {}

                def new_cache(row: str, registered: str = registered) -> None:
                    for cache in caches:
                        cache.terminate()
                    caches.clear()
                    memory = dataset_bytes // 2 if row == "cache=1/2" else 2 * dataset_bytes
                    run = tempfile.mkdtemp(prefix="cache-", dir=shm)
                    cache = start_service("cache-server", "--metadata-address", metadata.address,
                                          "--memory-cache-dir", run, "--memory-cache-bytes", str(memory),
                                          "--disk-cache-bytes", "0", "--default-policy",
                                          "uniform" if row == "cache=1/2" else "lrfu-cost",
                                          "--log-level", "warning", workdir=work / f"cache-{name}-{row}")
                    caches.append(cache)
                    state["dataset"] = SilodDataset(registered, cache_addr=cache.address,
                                                    metadata_addr=metadata.address, job_id="bench",
                                                    transform=transform)
                    state["epoch"] = 0
                    state["job"] = 0

                def silod_epoch(phase: str) -> Any:
                    dataset = state["dataset"]
                    state["job"] += 1
                    dataset.job_id = f"bench-{state['job']}"
                    sampler = EpochShuffleSampler(dataset, seed=state["job"], prefetch_ahead=4 * args.batch_size)
                    sampler.set_epoch(state["epoch"])
                    state["epoch"] += 1
                    return loader_of(dataset, sampler)

                run_rows(name, silod_epoch, True, lambda: [c.pid for c in caches], new_cache,
                         local=LocalFiles if name == "silod" else LocalShards)
                if name == "silod-shards" and name in local_pairs:
                    shard_rates = local_pairs[name]
                    spreads["local shards"] = shard_rates
                    table.put("local shards", "warm", Cell(statistics.median(shard_rates),
                                                           statistics.median(shard_rates), local_peaks[name]))
        print()
        print(table.render())
        print(f"\nlimits (samples/s): cold {limits['cold']:,.0f} (link), warm {limits['warm']:,.0f} (local files), "
              f"cache=1/2 {limits['cache=1/2']:,.0f}, 2 jobs {limits['2 jobs']:,.0f}, compute {limits['compute']:,.0f}")
        print(f"warm epochs, min / median / max of {args.repeats} (samples/s), and of the ratio to the local "
              "epoch run just before each (local shards for silod-shards):")
        for name, rates in spreads.items():
            pairs = ratios.get(name)
            paired = (f"   ratio {min(pairs):.0%} / {statistics.median(pairs):.0%} / {max(pairs):.0%}" if pairs else "")
            print(f"  {name:<13} {min(rates):>9,.0f} {statistics.median(rates):>9,.0f} {max(rates):>9,.0f}{paired}")
        print("load average at the end: {:.1f} {:.1f} {:.1f}".format(*os.getloadavg()))
        return 0
    finally:
        for proc in caches + services:
            proc.terminate()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


def _shard_tensor(data: bytes) -> Any:
    from silod.data.shards import decode_sample

    return to_tensor(decode_sample(data)["jpg"])


if __name__ == "__main__":
    sys.exit(main())
