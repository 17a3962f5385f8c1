"""CPU cost of the metadata store's per-node work: a heartbeat (the write every node makes every
``heartbeat_s``, and the scheduler makes for it after plan acks) and a ListNodes of every node
(the scheduler's node watch, every second, and each round's snapshot).

    .venv/bin/python benchmarks/metadata_node_writes.py [--nodes 1000] [--db sqlite:///F | postgresql://...]

Through the store's own code on one thread, without gRPC (which adds its own per call), timed
as this process's CPU time: a figure that holds on a loaded machine, where wall-clock times
measure the neighbours. docs/sizing.md turns these into cores per node count.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.metadata.migrate import upgrade_engine  # noqa: E402
from services.metadata.store import MetadataStore  # noqa: E402
from silod.v1 import common_pb2  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--db", default="", help="database URL (default: a fresh SQLite file)")
    args = parser.parse_args(argv)
    url = args.db or f"sqlite:///{tempfile.mkdtemp(prefix='silod-nodes-')}/m.db"
    store = MetadataStore.open(url)
    upgrade_engine(store.db.engine)
    for i in range(args.nodes):
        store.nodes.upsert(common_pb2.NodeSpec(name=f"n{i}", gpus=8, pool=common_pb2.NODE_POOL_TRAINING,
                                               agent_address="127.0.0.1:1"))
    started = time.process_time()
    for version in range(1, 4):
        for i in range(args.nodes):
            store.nodes.heartbeat(f"n{i}", version)
    heartbeat_ms = (time.process_time() - started) * 1000 / (3 * args.nodes)
    started = time.process_time()
    for _ in range(5):
        listed = store.nodes.list(alive_only=True, liveness_window_s=60)
    list_ms = (time.process_time() - started) * 1000 / 5
    assert len(listed) == args.nodes
    store.close()
    result = {"nodes": args.nodes, "database": url.split(":", 1)[0], "heartbeat_cpu_ms": round(heartbeat_ms, 2),
              "list_nodes_cpu_ms": round(list_ms, 1)}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
