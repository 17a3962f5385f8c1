"""`make demo`: bring up silod on the embedded defaults and walk through the main path.

Today (foundation) that is: the metadata service on a SQLite file, a sample dataset in a
local directory standing in for the remote store, registering its manifest, listing it,
and a clean shutdown. Later issues grow this into the full cluster demo.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import time
from pathlib import Path

from silod.cli.main import main as silod
from silod.launcher import LaunchError, start_service

SAMPLE_FILES = 48
SAMPLE_BYTES = 64 * 1024  # about the size of a small JPEG


def make_sample_dataset(root: Path, seed: int = 7) -> tuple[int, int]:
    """Write class-per-folder random "images"; return (files, bytes)."""
    rng = random.Random(seed)
    total = 0
    for i in range(SAMPLE_FILES):
        folder = root / f"class-{i % 4}"
        folder.mkdir(parents=True, exist_ok=True)
        size = rng.randint(SAMPLE_BYTES // 2, SAMPLE_BYTES * 3 // 2)
        (folder / f"img-{i:04d}.bin").write_bytes(rng.randbytes(size))
        total += size
    return SAMPLE_FILES, total


def _step(n: int, total: int, text: str) -> None:
    print(f"\n[{n}/{total}] {text}", flush=True)


def _run(*argv: str) -> None:
    print("    $ silod " + " ".join(argv), flush=True)
    code = silod(list(argv))
    if code:
        raise SystemExit(f"demo: `silod {' '.join(argv)}` failed with exit code {code}")


def run_demo(workdir: Path) -> int:
    started = time.monotonic()
    if workdir.exists():
        shutil.rmtree(workdir)
    store = workdir / "store" / "sample-images"
    db = workdir / "metadata.db"
    print("silod demo — foundation: metadata store, dataset manifests, clean shutdown")

    _step(1, 4, f"generating a sample dataset in {store}")
    files, size = make_sample_dataset(store)
    print(f"    {files} files, {size / 2**20:.1f} MiB")

    _step(2, 4, f"starting the metadata service on SQLite ({db})")
    try:
        metadata = start_service("metadata", "--db", f"sqlite:///{db}", "--log-format", "text", workdir=workdir / "logs")
    except (LaunchError, TimeoutError) as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 1
    print(f"    serving at {metadata.address} (log: {metadata.log_path})")
    try:
        _step(3, 4, "registering the dataset and reading it back")
        _run("health", metadata.address, "--service", "silod.v1.MetadataService")
        _run("dataset", "register", "sample-images", store.resolve().as_uri(), "--metadata", metadata.address,
             "--description", "demo: random bytes in class folders")
        _run("dataset", "list", "--metadata", metadata.address)
        _run("dataset", "show", "sample-images", "--objects", "5", "--metadata", metadata.address)
    finally:
        _step(4, 4, "stopping the metadata service (SIGTERM: graceful shutdown)")
        code = metadata.terminate(timeout=30)
        print(f"    exited with code {code}")
    print(f"\ndemo finished in {time.monotonic() - started:.1f} s; state kept in {workdir}")
    return 0 if code == 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m silod.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default=os.environ.get("SILOD_DEMO_DIR", ".silod/demo"),
                        help="where the demo keeps its database, store and logs (wiped first)")
    return run_demo(Path(parser.parse_args(argv).workdir))


if __name__ == "__main__":
    sys.exit(main())
