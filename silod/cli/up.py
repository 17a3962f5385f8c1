"""`silod up`: a whole silod cluster on this machine, as supervised child processes.

Metadata (SQLite under --state-dir unless --db), estimator, scheduler, the allocation service
(`silod allocation`: the nodes watch their plans, ack and report there, apart from the rounds), the web dashboard
(unless --no-dashboard; its URL is printed) and N emulated nodes (a worker agent, plus a
cache server unless --no-cache), all on loopback with OS-chosen
ports. --fleet N adds N nodes that all live in one process (worker_agent/fleet.py; their ranks
are emulated), for clusters of hundreds or thousands of nodes. The addresses are printed and written to ``<state-dir>/cluster.json``, where every
client command (`silod submit`, `silod dataset`, `silod health`, ...) finds them
(silod.cli.locate). If a child dies, `silod up` says which
and shows its log tail, then stops the rest (exit 1). SIGINT/SIGTERM stop everything
cleanly (agents first, then cache servers, allocation service, scheduler, estimator, metadata) and exit 0.
With auth on (SILOD_AUTH_TOKEN set), each node's agent and cache server get a node credential of
their own (``<state-dir>/nodes/<name>/node-credential``) instead of the cluster token.
Run as root, the nodes contain their ranks (docs/operators.md, "Job containment"), which may
read the directory silod up was started in (--contained-read-paths); the table says how each
node runs them.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from silod.cli.locate import CLUSTER_FILE, DEFAULT_STATE_DIR, default_state_dir, read_cluster_file


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser("up", help="run a whole silod cluster on this machine (emulated nodes) until Ctrl-C",
                       description=__doc__)
    p.add_argument("--state-dir", default=default_state_dir(),
                   help=f"database, logs, node work dirs and cluster.json (env SILOD_STATE_DIR; default {DEFAULT_STATE_DIR})")
    p.add_argument("--db", default="", help="metadata database URL; default sqlite:///<state-dir>/metadata.db")
    p.add_argument("--nodes", type=int, default=2, help="emulated nodes (default 2)")
    p.add_argument("--fleet", type=int, default=0, metavar="N",
                   help="N more nodes (fleet-0, ...) in one process (worker_agent/fleet.py): registered, heartbeating, "
                        "watching and acking plans with the agent's protocol, their ranks emulated (no processes; a "
                        "rank runs --fleet-task-seconds); for clusters of hundreds of nodes; --nodes may then be 0")
    p.add_argument("--fleet-task-seconds", type=float, default=60.0,
                   help="seconds an emulated rank of the fleet runs before it exits 0 (default 60; 0: until the plan "
                        "takes it away)")
    p.add_argument("--gpus-per-node", type=int, default=4, help="GPUs per emulated node (default 4)")
    p.add_argument("--cluster", default="", metavar="FILE",
                   help="cluster YAML in the simulator's format (nodes: [{count: 2, gpus: 4, gpu_type: v100}, "
                        "{count: 1, gpus: 4, gpu_type: k80, pool: inference}]); replaces --nodes, "
                        "--gpus-per-node and --inference-nodes")
    p.add_argument("--gpu-type", default="", help="GPU type of every emulated node (e.g. v100; default untyped)")
    p.add_argument("--policy", default="", help="scheduling policy (fifo, sjf, tiresias, gavel, themis, pollux, deepboot); default: the scheduler's")
    p.add_argument("--interval-s", type=float, default=0.0, help="seconds between scheduling rounds; default: the scheduler's")
    p.add_argument("--inference-nodes", type=int, default=0,
                   help="emulated nodes of the inference pool (named infer-0, ...; their idle GPUs may be lent "
                        "to training by the deepboot policy; default 0)")
    p.add_argument("--cache", default="", choices=("", "silod", "lru", "static", "none"),
                   help="cache mode of the scheduler: silod (co-allocated quotas and IO rates), lru, static or "
                        "none; default: the scheduler's")
    p.add_argument("--storage-bandwidth-bytes-per-s", type=float, default=0.0, metavar="B",
                   help="bytes/s the cluster may read from remote storage, shared out as per-job IO rates "
                        "by --cache silod (default 0: unlimited)")
    p.add_argument("--cache-disk-bytes", type=int, default=10 << 30,
                   help="bytes of each node's disk cache tier, also advertised to the scheduler (default 10 GiB)")
    p.add_argument("--cache-memory-bytes", type=int, default=512 << 20,
                   help="bytes of each node's memory cache tier (default 512 MiB)")
    p.add_argument("--no-cache", action="store_true", help="do not start a cache server per node")
    p.add_argument("--dashboard-port", type=int, default=0,
                   help="port of the web dashboard on 127.0.0.1 (default 0: a free port, printed)")
    p.add_argument("--no-dashboard", action="store_true", help="do not start the web dashboard")
    p.add_argument("--runtime", default="auto", choices=("auto", "contained", "process"),
                   help="how the nodes run ranks: contained (a uid, namespaces and cgroup per job; needs root), "
                        "process (as this user, uncontained); auto (default): contained when run as root")
    p.add_argument("--allow-uncontained", action="store_true",
                   help="with auth on, run ranks uncontained anyway (not root); without it silod up refuses")
    p.add_argument("--contained-read-paths", default=None, metavar="PATHS",
                   help="comma-separated paths contained ranks may read besides the system, the interpreter and "
                        "silod (job code, local datasets); default: the directory silod up is started in")
    p.add_argument("--log-level", default="warning", help="log level of the services (default warning)")
    p.set_defaults(handler=_up)


class _Stop(Exception):
    pass


def _node_layout(args: argparse.Namespace) -> list[tuple[str, str, int, str]]:
    """``(pool, name, gpus, gpu_type)`` of every emulated node, from ``--cluster`` or the count flags."""
    if not args.cluster:
        if args.gpu_type:
            from simulator.cluster import cluster_from_dict  # deferred: a server package
            from simulator.errors import SimulatorInputError

            try:
                cluster_from_dict({"nodes": 1, "gpu_type": args.gpu_type}, "--gpu-type")  # validates the type
            except SimulatorInputError as exc:
                raise ValueError(str(exc)) from None
        return ([("training", f"node-{i}", args.gpus_per_node, args.gpu_type) for i in range(args.nodes)]
                + [("inference", f"infer-{i}", args.gpus_per_node, args.gpu_type) for i in range(args.inference_nodes)])
    from simulator.cluster import load_cluster
    from simulator.errors import SimulatorInputError

    try:
        spec = load_cluster(args.cluster)
    except SimulatorInputError as exc:
        raise ValueError(f"--cluster: {exc}") from None
    return [(node.pool, node.name, node.gpus, node.gpu_type or args.gpu_type) for node in spec.nodes]


def _up(args: argparse.Namespace) -> int:
    from silod.launcher import LaunchError, ServiceProcess, start_service

    if args.nodes < (0 if args.fleet > 0 else 1) or args.gpus_per_node < 1:
        print("silod up: --nodes and --gpus-per-node must be >= 1 (--nodes may be 0 with --fleet)", file=sys.stderr)
        return 2
    if args.fleet < 0 or args.fleet_task_seconds < 0:
        print("silod up: --fleet and --fleet-task-seconds must be >= 0", file=sys.stderr)
        return 2
    if args.inference_nodes < 0:
        print("silod up: --inference-nodes must be >= 0", file=sys.stderr)
        return 2
    try:
        layout = _node_layout(args)
    except ValueError as exc:
        print(f"silod up: {exc}", file=sys.stderr)
        return 2
    if not args.storage_bandwidth_bytes_per_s >= 0 or args.storage_bandwidth_bytes_per_s == float("inf"):
        print("silod up: --storage-bandwidth-bytes-per-s must be a finite number >= 0 (0: unlimited)", file=sys.stderr)
        return 2
    if args.cache_disk_bytes < 0 or args.cache_memory_bytes < 0:
        print("silod up: --cache-disk-bytes and --cache-memory-bytes must be >= 0", file=sys.stderr)
        return 2
    if os.environ.get("SILOD_AUTH_TOKEN") and not args.allow_uncontained and (
            args.runtime == "process" or (args.runtime == "auto" and os.geteuid() != 0)):
        print("silod up: with auth on, ranks must be contained (any rank run as this user could read the nodes' "
              "credentials and signal other tenants' ranks): run silod up as root, or pass --allow-uncontained to "
              "accept uncontained ranks", file=sys.stderr)
        return 2
    read_paths = os.getcwd() if args.contained_read_paths is None else args.contained_read_paths
    if hasattr(signal, "SIGPIPE"):
        # main() gives client commands the Unix default (die on a closed stdout); a supervisor
        # must outlive its terminal or pipe, or its children are orphaned.
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    state = Path(args.state_dir).resolve()
    logs = state / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    cluster_file = state / CLUSTER_FILE
    cluster_file.unlink(missing_ok=True)
    db = args.db or f"sqlite:///{state / 'metadata.db'}"
    common = ("--log-level", args.log_level)

    stop: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        stop.append(signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    # (name, process) in start order; shutdown goes in the reverse order of tiers.
    children: list[tuple[str, ServiceProcess]] = []
    agents: list[tuple[str, ServiceProcess]] = []
    caches: list[tuple[str, ServiceProcess]] = []
    core: list[tuple[str, ServiceProcess]] = []

    scrape: list[tuple[str, str, str]] = []  # (Prometheus job, instance name, HOST:PORT of /metrics)

    def start(name: str, command: str, *flags: str, tier: list[tuple[str, ServiceProcess]],
              port: int = 0, env: dict[str, str] | None = None) -> ServiceProcess:
        if stop:
            raise _Stop
        # Every process exports Prometheus metrics on a port of its own (the dashboard on its
        # listen port); prometheus-targets.json lists them for a scraper.
        metrics = [] if command == "dashboard" else ["--metrics-port", str(_free_port()), "--metrics-host", "127.0.0.1"]
        proc = start_service(command, *flags, *metrics, *common, workdir=logs, timeout_s=60, port=port, env=env)
        children.append((name, proc))
        tier.append((name, proc))
        scrape.append((f"silod-{command}", name, f"127.0.0.1:{metrics[1]}" if metrics else proc.address))
        return proc

    code = 0
    side = ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 1))
    try:
        md = start("metadata", "metadata", "--db", db, tier=core)
        # A service start is mostly seconds of imports on one core, so independent starts go
        # side by side: the dashboard (it needs only the metadata service) beside the
        # estimator and scheduler, then the nodes, one per CPU.
        dash_future = None if args.no_dashboard else side.submit(
            start, "dashboard", "dashboard", "--metadata-address", md.address, tier=core, port=args.dashboard_port)
        est = start("estimator", "estimator", "--metadata-address", md.address,
                    "--gpus-per-node", str(args.gpus_per_node), tier=core)
        sched_flags = ["--metadata-address", md.address, "--estimator-address", est.address]
        if args.policy:
            sched_flags += ["--policy", args.policy]
        if args.interval_s > 0:
            sched_flags += ["--interval-s", f"{args.interval_s:g}"]
        if args.cache:
            sched_flags += ["--cache-mode", args.cache]
        if args.storage_bandwidth_bytes_per_s > 0:
            sched_flags += ["--storage-bandwidth-bytes-per-s", f"{args.storage_bandwidth_bytes_per_s:g}"]
        sch = start("scheduler", "scheduler", *sched_flags, tier=core)
        # The nodes' plan watches, acks and task reports, apart from the rounds (fed by the scheduler).
        alloc = start("allocation", "allocation", "--metadata-address", md.address,
                      "--scheduler-address", sch.address, tier=core)
        dashboard = f"http://{dash_future.result().address}/" if dash_future is not None else ""
        def start_node(pool: str, name: str, gpus: int, gpu_type: str) -> dict[str, Any]:
            node_dir = state / "nodes" / name
            node: dict[str, Any] = {"name": name, "pool": pool, "gpus": gpus, "gpu_type": gpu_type,
                                    "work_dir": str(node_dir / "work")}
            agent_flags = ["--node-name", name, "--gpus", str(gpus), "--work-dir", str(node_dir / "work"),
                           "--pool", pool, "--metadata-address", md.address, "--scheduler-address", alloc.address]
            if gpu_type:
                agent_flags += ["--gpu-type", gpu_type]
            agent_flags += ["--runtime", args.runtime, "--contained-read-paths", read_paths]
            if args.allow_uncontained:
                agent_flags += ["--allow-uncontained"]
            identity = _node_identity(md.address, name, node_dir)  # auth on: a node credential, no cluster token
            if not args.no_cache:
                cache = start(f"cache-server {name}", "cache-server", "--metadata-address", md.address, "--node", name,
                              "--scheduler-address", alloc.address,
                              "--disk-cache-dir", str(node_dir / "cache-disk"),
                              "--disk-cache-bytes", str(args.cache_disk_bytes),
                              "--memory-cache-bytes", str(args.cache_memory_bytes),
                              "--memory-cache-dir", str(node_dir / "cache-mem"),
                              # --cache lru: jobs get no quota and share the cache, which must then be LRU
                              # (the cache server's own default is lrfu-cost).
                              *(("--default-policy", "lru") if args.cache == "lru" else ()), tier=caches, env=identity)
                node["cache"] = cache.address
                # The scheduler sizes cache quotas by what the agent advertises: the same tiers.
                agent_flags += ["--cache-address", cache.address,
                                "--cache-capacity-bytes", str(args.cache_disk_bytes),
                                "--memory-cache-bytes", str(args.cache_memory_bytes)]
            agent = start(f"worker-agent {name}", "worker-agent", *agent_flags, tier=agents, env=identity)
            node["agent"] = agent.address
            node["runtime"] = _runtime_of(agent.address)
            return node

        # Each node starts its cache server, then its agent (which needs the cache's address).
        futures = [side.submit(start_node, *entry) for entry in layout]
        wait(futures)
        nodes = [f.result() for f in futures]  # re-raises the first failure (_Stop, LaunchError, ...)
        info = {"pid": os.getpid(), "state_dir": str(state), "db": db, "metadata": md.address,
                "estimator": est.address, "scheduler": sch.address, "allocation": alloc.address,
                "dashboard": dashboard, "nodes": nodes}
        if args.fleet > 0:
            info["fleet"] = _start_fleet(args, md.address, alloc.address, state, agents, children, stop)
        info["prometheus_targets"] = str(_write_scrape_targets(state, scrape))
        tmp = cluster_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(info, indent=2) + "\n")
        tmp.replace(cluster_file)
        try:
            _print_table(info, logs)
        except (OSError, ValueError):
            pass
        died = _supervise(children, stop)
        if died is not None:
            name, proc = died
            _say(f"\nsilod up: {name} exited unexpectedly with code {proc.proc.returncode}; log tail "
                 f"({proc.log_path}):\n{_tail(proc.log())}\nsilod up: stopping the rest of the cluster", err=True)
            code = 1
    except _Stop:
        pass
    except (LaunchError, TimeoutError) as exc:
        _say(f"silod up: {exc}", err=True)
        code = 1
    finally:
        # Starts in flight finish (and so are in the tiers below) before anything is stopped.
        side.shutdown(wait=True, cancel_futures=True)
        cluster_file.unlink(missing_ok=True)
        _say("silod up: stopping the cluster")
        for tier in (agents, caches, list(reversed(core))):
            for name, proc in tier:
                try:
                    rc = proc.terminate(timeout=20)
                except TimeoutError as exc:
                    _say(f"silod up: {name}: {exc}", err=True)
                    code = 1
                    continue
                if rc not in (0, -signal.SIGTERM) and code == 0 and proc is not None and not stop:
                    code = 1
        for s, handler in old.items():
            signal.signal(s, handler)
    if code == 0:
        _say("silod up: all services stopped")
    return code


def _node_identity(metadata: str, node: str, node_dir: Path) -> dict[str, str] | None:
    """With auth on (SILOD_AUTH_TOKEN in the environment): a node credential minted for ``node``,
    written to ``<node_dir>/node-credential`` (mode 0600), and the environment its worker agent and
    cache server start with: that file, and no cluster token. None with auth off."""
    cluster_token = os.environ.get("SILOD_AUTH_TOKEN", "")
    if not cluster_token:
        return None
    from silod.rpc.channels import open_channel
    from silod.v1 import access_pb2, metadata_pb2_grpc

    import grpc

    from silod.launcher import LaunchError

    description = f"silod up: emulated node {node}"
    try:
        with open_channel(metadata, token=cluster_token) as channel:
            stub = metadata_pb2_grpc.MetadataServiceStub(channel)
            # The previous run's credential of this node goes: one live credential per emulated node.
            for old in stub.ListCredentials(access_pb2.ListCredentialsRequest(
                    kind=access_pb2.PRINCIPAL_KIND_NODE, name=node)).credentials:
                if old.description == description:
                    stub.RevokeCredential(access_pb2.RevokeCredentialRequest(id=old.id))
            issued = stub.CreateCredential(access_pb2.CreateCredentialRequest(
                kind=access_pb2.PRINCIPAL_KIND_NODE, name=node, description=description))
    except grpc.RpcError as exc:
        raise LaunchError(f"cannot create the credential of node {node}: {exc.code().name}: {exc.details()}") from None
    node_dir.mkdir(parents=True, exist_ok=True)
    path = node_dir / "node-credential"
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(issued.token + "\n")
    return {"SILOD_AUTH_TOKEN": "", "SILOD_NODE_CREDENTIAL_FILE": str(path)}


def _start_fleet(args: argparse.Namespace, metadata: str, scheduler: str, state: Path,
                 agents: list[tuple[str, Any]], children: list[tuple[str, Any]], stop: list[int]) -> dict[str, Any]:
    """The --fleet nodes, one process; stopped with the agents."""
    from worker_agent.fleet import FleetSettings, start_fleet  # deferred: server code

    if stop:
        raise _Stop
    settings = FleetSettings(nodes=args.fleet, gpus=args.gpus_per_node, metadata_address=metadata,
                             scheduler_address=scheduler, gpu_type=args.gpu_type,
                             task_seconds=args.fleet_task_seconds)
    try:
        fleet = start_fleet(settings, state / "logs" / "fleet")
    except RuntimeError as exc:
        raise TimeoutError(str(exc)) from None
    agents.append(("node fleet", fleet))
    children.append(("node fleet", fleet))
    return {"nodes": args.fleet, "gpus": args.gpus_per_node, "names": f"{settings.prefix}0..{args.fleet - 1}",
            "pid": fleet.pid, "log": str(fleet.log_path)}


def _say(text: str, err: bool = False) -> None:
    """Print, ignoring a closed stdout/stderr (the cluster must still be shut down)."""
    try:
        print(text, file=sys.stderr if err else sys.stdout, flush=True)
    except (OSError, ValueError):
        pass


def _supervise(children: list[tuple[str, Any]], stop: list[int]) -> tuple[str, Any] | None:
    while not stop:
        for name, proc in children:
            if not proc.running():
                return name, proc
        time.sleep(0.2)
    return None


def _runtime_of(agent: str) -> str:
    """How the agent runs ranks (its NodeSpec.runtime): contained, process, ..."""
    from silod.rpc.channels import open_channel
    from silod.v1 import worker_agent_pb2, worker_agent_pb2_grpc

    try:
        with open_channel(agent, token=os.environ.get("SILOD_AUTH_TOKEN", "")) as channel:  # the cluster token
            status = worker_agent_pb2_grpc.WorkerAgentServiceStub(channel).GetNodeStatus(
                worker_agent_pb2.GetNodeStatusRequest(), timeout=10)
    except Exception:  # noqa: BLE001 - shown as unknown; the cluster runs all the same
        return ""
    return status.spec.runtime


def _tail(text: str, lines: int = 30) -> str:
    return "\n".join("    " + line for line in text.splitlines()[-lines:])


def _print_table(info: dict[str, Any], logs: Path) -> None:
    rows = [("metadata", info["metadata"]), ("estimator", info["estimator"]), ("scheduler", info["scheduler"]),
            ("allocation", info["allocation"])]
    for node in info["nodes"]:
        rows.append((f"{node['name']} worker-agent", f"{node['agent']}  (ranks {node.get('runtime') or '?'})"))
        if "cache" in node:
            rows.append((f"{node['name']} cache-server", node["cache"]))
    fleet = info.get("fleet")
    if fleet:
        rows.append((f"node fleet ({fleet['names']})", f"pid {fleet['pid']}"))
    width = max(len(r[0]) for r in rows)
    inference = sum(1 for n in info["nodes"] if n.get("pool") == "inference")
    pools = f", {inference} of them inference" if inference else ""
    gpus = info["nodes"][0]["gpus"] if info["nodes"] else fleet["gpus"] if fleet else 0
    count = len(info["nodes"]) + (fleet["nodes"] if fleet else 0)
    print(f"silod cluster is up ({count} nodes x {gpus} GPUs{pools})")
    print(f"  {'SERVICE':<{width}}  ADDRESS")
    for name, addr in rows:
        print(f"  {name:<{width}}  {addr}")
    if info.get("dashboard"):
        print(f"dashboard: {info['dashboard']}")
    print(f"addresses: {Path(info['state_dir']) / CLUSTER_FILE}   logs: {logs}")
    print(f"metrics: {info['prometheus_targets']} (Prometheus file_sd targets of every process)")
    print("submit jobs with `silod submit job.yaml`; Ctrl-C stops the cluster", flush=True)


def _free_port() -> int:
    """A loopback port free now (the OS picks it); the child binds it a moment later."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _write_scrape_targets(state: Path, scrape: list[tuple[str, str, str]]) -> Path:
    """Prometheus file-based service discovery (file_sd_configs): one target group per process,
    labelled with its job (silod-scheduler, silod-worker-agent, ...) and its name here."""
    groups = [{"targets": [address], "labels": {"job": job, "silod_process": name}} for job, name, address in scrape]
    path = state / "prometheus-targets.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(groups, indent=2) + "\n")
    tmp.replace(path)
    return path
