"""The metadata service's CPU per Heartbeat RPC when a thousand nodes beat at once: the load of a
1,000-node cluster, whose nodes beat every 5 s (200 a second), sent here as fast as the service
answers them so that the figure is its cost, not the clock's.

    .venv/bin/python benchmarks/metadata_heartbeat_rpc.py [--nodes 1000] [--rounds 5] [--concurrency 200] [--scratch-postgres URL]

A real metadata process on a fresh SQLite database (``--scratch-postgres URL``: a database of its
own on that PostgreSQL server, dropped afterwards); the nodes register, then every node beats
``--rounds`` times (``--concurrency`` RPCs in flight, one channel). Figures: ``service_cpu_ms``,
the service process's CPU time per heartbeat (Linux /proc; gRPC, the thread hop and the write
included), ``heartbeats_per_s`` and the RPC latency p50/p99; ``registration_cpu_ms`` and
``registrations_per_s``, the same for the nodes' UpsertNode calls (``--concurrency`` in flight).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.live_scheduler import cpu_seconds  # noqa: E402
from benchmarks.metadata_node_writes import scratch_postgres  # noqa: E402
from silod.launcher import start_service  # noqa: E402
from silod.rpc.channels import open_channel  # noqa: E402
from silod.v1 import common_pb2, metadata_pb2, metadata_pb2_grpc  # noqa: E402


async def register(address: str, nodes: int, concurrency: int) -> None:
    channel = open_channel(address, aio=True, default_timeout_s=60)
    stub = metadata_pb2_grpc.MetadataServiceStub(channel)
    gate = asyncio.Semaphore(concurrency)  # 2,000 sent at once were CANCELLED

    async def one(i: int) -> None:
        async with gate:
            await stub.UpsertNode(metadata_pb2.UpsertNodeRequest(spec=common_pb2.NodeSpec(
                name=f"n{i}", gpus=8, pool=common_pb2.NODE_POOL_TRAINING, agent_address="127.0.0.1:1")))

    await asyncio.gather(*(one(i) for i in range(nodes)))
    await channel.close()


async def beat(address: str, nodes: int, rounds: int, concurrency: int, first_version: int = 1
               ) -> tuple[float, list[float]]:
    channel = open_channel(address, aio=True, default_timeout_s=60)
    stub = metadata_pb2_grpc.MetadataServiceStub(channel)
    todo = iter([(first_version + r, i) for r in range(rounds) for i in range(nodes)])
    latencies: list[float] = []

    async def worker() -> None:
        for version, i in todo:
            started = time.perf_counter()
            await stub.Heartbeat(metadata_pb2.HeartbeatRequest(node=f"n{i}", applied_plan_version=version))
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    await channel.close()
    return elapsed, latencies


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=200)
    parser.add_argument("--scratch-postgres", default="", metavar="URL",
                        help="a PostgreSQL server (URL of any database on it) to create a scratch database on")
    args = parser.parse_args(argv)
    for flag in ("nodes", "rounds", "concurrency"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag}: must be >= 1, got {getattr(args, flag)}")
    with tempfile.TemporaryDirectory(prefix="silod-hb-") as tmp, contextlib.ExitStack() as stack:
        db = (stack.enter_context(scratch_postgres(args.scratch_postgres)) if args.scratch_postgres
              else f"sqlite:///{tmp}/m.db")
        with start_service("metadata", "--db", db, "--log-level", "warning", workdir=tmp) as md:
            cpu0, started = cpu_seconds(md.pid), time.perf_counter()
            asyncio.run(register(md.address, args.nodes, args.concurrency))
            registered_s, registration_cpu = time.perf_counter() - started, cpu_seconds(md.pid) - cpu0
            asyncio.run(beat(md.address, args.nodes, 1, args.concurrency))  # warm
            cpu0 = cpu_seconds(md.pid)
            elapsed, latencies = asyncio.run(beat(md.address, args.nodes, args.rounds, args.concurrency, 2))
            cpu = cpu_seconds(md.pid) - cpu0
    count = len(latencies)
    latencies.sort()
    print(json.dumps({"nodes": args.nodes, "database": "postgresql" if args.scratch_postgres else "sqlite",
                      "heartbeats": count, "service_cpu_ms": round(cpu * 1000 / count, 3),
                      "heartbeats_per_s": round(count / elapsed), "p50_ms": round(latencies[count // 2] * 1000, 1),
                      "p99_ms": round(latencies[int(count * 0.99)] * 1000, 1),
                      "registration_cpu_ms": round(registration_cpu * 1000 / args.nodes, 3),
                      "registrations_per_s": round(args.nodes / registered_s)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
