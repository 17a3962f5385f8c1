"""How long one acknowledged SQLite write of the metadata service takes on this machine's disk:
300 job inserts, each its own transaction (one COMMIT, one fsync of the WAL), median and p99.
Run it quiet, then beside whatever shares the database's disk, and compare (docs/sizing.md,
"Submissions on a busy machine").

    .venv/bin/python benchmarks/metadata_commit_time.py [--dir DIR]   # DIR: on the disk to measure
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.metadata.migrate import upgrade  # noqa: E402
from services.metadata.store import MetadataStore  # noqa: E402
from services.metadata.store.jobs import _insert_job  # noqa: E402
from tests.metadata.metadata_samples import training_spec  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="where the scratch database goes (default: the temp directory)")
    parser.add_argument("--writes", type=int, default=300)
    args = parser.parse_args()
    if args.writes < 1:
        parser.error(f"--writes: at least 1, not {args.writes}")
    if args.dir is not None and not Path(args.dir).is_dir():
        parser.error(f"--dir: {args.dir} is not a directory")
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="silod-commit-") as scratch:
        url = f"sqlite:///{scratch}/metadata.db"
        upgrade(url)
        store = MetadataStore.open(url)
        times = []
        try:
            for i in range(args.writes):
                started = time.perf_counter()
                with store.db.write() as session:
                    _insert_job(session, training_spec(name=f"j{i}"), f"j{i}")
                times.append(time.perf_counter() - started)
        finally:
            store.close()
    times.sort()
    print(f"{args.writes} writes: median {times[len(times) // 2] * 1e3:.1f} ms, "
          f"p99 {times[max(int(len(times) * 0.99) - 1, 0)] * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
