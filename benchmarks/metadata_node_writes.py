"""CPU cost of the metadata store's per-node work: a heartbeat (the write every node makes every
``heartbeat_s``, and the scheduler makes for it after plan acks) and a ListNodes of every node
(what the scheduler's node watch and each round's snapshot asked before they followed changes).

    .venv/bin/python benchmarks/metadata_node_writes.py [--nodes 1000] [--batch 100] [--db sqlite:///F | postgresql://...]
    .venv/bin/python benchmarks/metadata_node_writes.py --scratch-postgres postgresql://postgres@127.0.0.1:5432/postgres

``--db`` wants an empty, or new, database. ``--scratch-postgres`` creates a database of its own
on that server and drops it afterwards.

Figures: ``heartbeat_cpu_ms``, a heartbeat without GPU figures (an emulated node, or the
scheduler forwarding a plan ack); ``heartbeat_in_batch_cpu_ms`` and ``_wall_ms``, one such
heartbeat stored in a batch of ``--batch`` (as the service stores those that arrive together),
beside ``heartbeat_in_batch_one_by_one_*``, the same batches stored a statement per heartbeat
(the same thing on SQLite; on PostgreSQL the store makes a batch one statement); ``list_nodes_cpu_ms``, a ListNodes of every node after such
heartbeats; ``list_node_changes_cpu_ms``, what the scheduler asks instead (the
changes since its last listing: none after heartbeats alone, and the names of the nodes not
alive); ``heartbeat_gpus_cpu_ms``, a heartbeat carrying 8 GPUs' NVML figures (the path that
reads and rewrites the node's gpu_health); ``list_nodes_after_gpu_heartbeats_cpu_ms``, the first
ListNodes after every node sent such a heartbeat (each row has changed since the last listing).

Through the store's own code on one thread, without gRPC (which adds its own per call), timed
as this process's CPU time: a figure that holds on a loaded machine, where wall-clock times
measure the neighbours. Each timed part starts after a full garbage collection, so that the one
a part's garbage is due for does not land in the next (a single ListNodes, say).
docs/sizing.md turns these into cores per node count.
"""

from __future__ import annotations

import argparse
import gc
import json
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.metadata.migrate import upgrade_engine  # noqa: E402
from services.metadata.store import MetadataStore  # noqa: E402
from silod.v1 import common_pb2  # noqa: E402


GPUS = 8


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=100, help="heartbeats stored together (heartbeat_many)")
    add_database_arguments(parser)
    args = parser.parse_args(argv)
    if args.nodes < 1 or args.batch < 1:
        parser.error("--nodes and --batch must be at least 1")
    with database(args) as url:
        print(json.dumps(run(url, args.nodes, args.batch)))
    return 0


def add_database_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--db", default="", help="database URL (default: a fresh SQLite file)")
    parser.add_argument("--scratch-postgres", default="", metavar="URL",
                        help="a PostgreSQL server (URL of any database on it) to create a scratch database on")


@contextmanager
def database(args: argparse.Namespace) -> Iterator[str]:
    """The URL of the database that ``add_database_arguments``' flags name (a scratch one dropped afterwards)."""
    if args.scratch_postgres:
        with scratch_postgres(args.scratch_postgres) as url:
            yield url
    else:
        yield args.db or f"sqlite:///{tempfile.mkdtemp(prefix='silod-bench-')}/m.db"


def _heartbeat_batches(store: MetadataStore, nodes: int, batch: int, first_version: int) -> dict[str, float]:
    """Every node's heartbeat in batches of ``batch`` (heartbeat_many, as the service stores the
    heartbeats that arrive together), the store's way (one statement a batch on PostgreSQL) and
    one statement per heartbeat (the same on SQLite), alternately, five times each: per heartbeat, the median CPU time
    of this process and wall time (on PostgreSQL the wall time also holds the server's work and
    every round trip, which the transaction's row locks wait out)."""
    grouped_way = store.nodes.grouped_heartbeats
    ways = (False, True) if grouped_way else (False,)  # SQLite: one statement per heartbeat only
    times: dict[bool, list[tuple[float, float]]] = {way: [] for way in ways}
    version = first_version
    for _ in range(5):
        for grouped in ways:
            store.nodes.grouped_heartbeats = grouped
            gc.collect()
            cpu, wall = time.process_time(), time.perf_counter()
            for start in range(0, nodes, batch):
                results = store.nodes.heartbeat_many([(f"n{i}", version) for i in range(start, min(nodes, start + batch))])
                assert all(r.applied_plan_version == version for r in results), results
            times[grouped].append(((time.process_time() - cpu) * 1000 / nodes, (time.perf_counter() - wall) * 1000 / nodes))
            version += 1
    store.nodes.grouped_heartbeats = grouped_way
    figures = {"heartbeat_batch": batch}
    for grouped, name in ((grouped_way, "heartbeat_in_batch"), (False, "heartbeat_in_batch_one_by_one")):
        figures[f"{name}_cpu_ms"] = round(statistics.median(c for c, _ in times[grouped]), 3)
        figures[f"{name}_wall_ms"] = round(statistics.median(w for _, w in times[grouped]), 3)
    return figures


def run(url: str, nodes: int, batch: int = 100) -> dict[str, object]:
    store = MetadataStore.open(url)
    upgrade_engine(store.db.engine)
    for i in range(nodes):
        store.nodes.upsert(common_pb2.NodeSpec(name=f"n{i}", gpus=GPUS, pool=common_pb2.NODE_POOL_TRAINING,
                                               agent_address="127.0.0.1:1"))
    gc.collect()
    started = time.process_time()
    for version in range(1, 4):
        for i in range(nodes):
            store.nodes.heartbeat(f"n{i}", version)
    heartbeat_ms = (time.process_time() - started) * 1000 / (3 * nodes)
    batched = _heartbeat_batches(store, nodes, batch, first_version=4)
    gc.collect()
    started = time.process_time()
    for _ in range(5):
        listed = store.nodes.list(alive_only=True, liveness_window_s=60)
    list_ms = (time.process_time() - started) * 1000 / 5
    assert len(listed) == nodes
    # What the scheduler asks instead, each round and each watch poll: what changed since its last
    # listing (nothing, after heartbeats alone), and the names of the nodes not alive (none).
    cursor = store.nodes.listing().cursor
    gc.collect()
    started = time.process_time()
    for _ in range(5):
        changes = store.nodes.listing(changed_after=cursor, liveness_window_s=60)
    changes_ms = (time.process_time() - started) * 1000 / 5
    assert changes.nodes == [] and changes.not_alive == [] and not changes.whole
    telemetry = [common_pb2.GpuTelemetry(index=g, utilization_ratio=0.5, memory_used_bytes=2**30,
                                         memory_total_bytes=16 * 2**30, temperature_celsius=40.0,
                                         ecc_uncorrectable_errors=0) for g in range(GPUS)]
    gc.collect()
    started = time.process_time()
    for i in range(nodes):
        store.nodes.heartbeat(f"n{i}", 100, gpu_telemetry=telemetry)
    heartbeat_gpus_ms = (time.process_time() - started) * 1000 / nodes
    gc.collect()
    started = time.process_time()
    listed = store.nodes.list(alive_only=True, liveness_window_s=60)
    list_after_gpus_ms = (time.process_time() - started) * 1000
    assert len(listed) == nodes and all(len(node.gpu_telemetry) == GPUS for node in listed)
    store.close()
    return {"nodes": nodes, "database": url.split(":", 1)[0].split("+", 1)[0],
            "heartbeat_cpu_ms": round(heartbeat_ms, 2), **batched, "list_nodes_cpu_ms": round(list_ms, 1),
            "list_node_changes_cpu_ms": round(changes_ms, 2),
            "heartbeat_gpus_cpu_ms": round(heartbeat_gpus_ms, 2),
            "list_nodes_after_gpu_heartbeats_cpu_ms": round(list_after_gpus_ms, 1)}


@contextmanager
def scratch_postgres(server_url: str) -> Iterator[str]:
    """A new database on the server of ``server_url``, dropped afterwards."""
    url = make_url(server_url)
    if url.drivername == "postgresql":
        url = url.set(drivername="postgresql+psycopg2")
    name = f"silod_nodes_bench_{secrets.token_hex(4)}"
    admin = create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as connection:
            connection.execute(text(f'CREATE DATABASE "{name}"'))
        try:
            yield url.set(database=name).render_as_string(hide_password=False)
        finally:
            with admin.connect() as connection:
                connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        admin.dispose()


if __name__ == "__main__":
    sys.exit(main())
