"""``silod lab up|down|link|workload``: the multi-host lab (see :mod:`silod.lab.cluster`).

Only argparse at import: the lab and server code load when the command runs.
"""

from __future__ import annotations

import argparse
import sys


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser("lab", help="a multi-host silod cluster on this machine: deploy/compose.yaml's services in network namespaces (root)",
                       description="Run deploy/compose.yaml's services as processes, each in its own network "
                                   "namespace on a bridge (addresses from 198.18.0.0/24, service names as host names).")
    lab_sub = p.add_subparsers(dest="lab_command", metavar="ACTION")
    lab_sub.required = True
    up = lab_sub.add_parser("up", help="start the lab and keep it up until Ctrl-C, then remove it")
    up.add_argument("--nodes", type=int, default=2, help="training nodes: cache-server/worker-agent pairs, each pair on its own hosts (default 2)")
    up.add_argument("--inference-nodes", type=int, default=1,
                    help="inference-pool nodes, copies of compose's cache-infer-0/agent-infer-0 (default 1)")
    up.add_argument("--state-dir", default=".silod/lab", help="logs and volumes (default .silod/lab)")
    up.set_defaults(handler=_up)
    down = lab_sub.add_parser("down", help="remove every lab namespace, link and process left behind")
    down.set_defaults(handler=_down)
    link = lab_sub.add_parser("link", help="pull (down) or plug back (up) a lab host's network link")
    link.add_argument("host", help="compose service name, e.g. agent-1")
    link.add_argument("state", choices=("down", "up"))
    link.set_defaults(handler=_link)
    work = lab_sub.add_parser("workload", help="run the demo's mixed workload (silod/demo.py) on a running lab, "
                              "showing which host each job runs on")
    work.add_argument("--short", action="store_true",
                      help="two training jobs and three inference tasks at a quarter of the demo's size (tests/lab runs this)")
    work.add_argument("--state-dir", default=".silod/lab", help="the running lab's state dir (default .silod/lab)")
    work.set_defaults(handler=_workload)


def _up(args: argparse.Namespace) -> int:
    import signal
    import threading

    from silod.lab import netns
    from silod.lab.cluster import Lab, LabError

    reason = netns.available()
    if reason:
        print(f"silod lab: {reason}", file=sys.stderr)
        return 2
    if args.nodes < 1:
        print("silod lab: --nodes must be >= 1", file=sys.stderr)
        return 2
    if args.inference_nodes < 0:
        print("silod lab: --inference-nodes must be >= 0", file=sys.stderr)
        return 2
    lab = Lab(args.state_dir, nodes=args.nodes, inference_nodes=args.inference_nodes)
    try:
        lab.up()
    except LabError as exc:
        print(f"silod lab: {exc}", file=sys.stderr)
        return 1
    for name, address in lab.hosts().items():
        print(f"{name:14} {address}  (sudo ip netns exec {lab.net.hosts[name].netns} ...)")
    print(f"dashboard: http://{lab.address('dashboard')}/  (reachable from this host through the bridge)")
    print(f"logs: {lab.state_dir / 'logs'}; Ctrl-C stops and removes the lab")
    print(f"the demo's workload on it: sudo {sys.argv[0]} lab workload --state-dir {args.state_dir}")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        while not stop.wait(1.0):
            dead = [n for n, p in lab.procs.items() if p.poll() is not None and not lab.services[n].one_shot]
            if dead:
                print(f"silod lab: {', '.join(dead)} exited; log tail:\n{lab.log(dead[0])[-2000:]}", file=sys.stderr)
                return 1
    finally:
        lab.down()
    return 0


def _workload(args: argparse.Namespace) -> int:
    import grpc

    from silod.lab import netns
    from silod.lab.workload import LabInfo, WorkloadError, demo_workload, run_workload, short_workload

    reason = netns.available()
    if reason:   # registering the datasets runs inside a lab host's namespace
        print(f"silod lab: {reason}", file=sys.stderr)
        return 2
    try:
        lab = LabInfo.load(args.state_dir)
        result = run_workload(lab, short_workload() if args.short else demo_workload(),
                              out=lambda line: print(line, flush=True))
    except WorkloadError as exc:
        print(f"silod lab: {exc}", file=sys.stderr)
        return 1
    except grpc.RpcError as exc:
        print(f"silod lab: the lab did not answer: {exc.code().name}: {exc.details()} "
              f"(is `silod lab up --state-dir {args.state_dir}` still running?)", file=sys.stderr)
        return 1
    return 0 if result.succeeded else 1


def _down(args: argparse.Namespace) -> int:
    from silod.lab import netns

    removed = netns.remove_leftovers()
    print(f"removed {len(removed)}: {' '.join(removed)}" if removed else "nothing to remove")
    return 0


def _link(args: argparse.Namespace) -> int:
    from silod.lab import netns

    net_host = f"{netns.PREFIX}-{args.host}"
    try:
        # The root-namespace end of the host's link is the bridge port whose peer is in net_host.
        out = netns._ip("-n", net_host, "-o", "link", "show", "eth0")
    except netns.NetnsError as exc:
        print(f"silod lab: no lab host {args.host!r}: {exc}", file=sys.stderr)
        return 2
    index = out.split("@if")[1].split(":")[0]
    for line in netns._ip("-o", "link", "show").splitlines():
        if line.startswith(f"{index}:"):
            veth = line.split(":")[1].strip().split("@")[0]
            netns._ip("link", "set", veth, args.state)
            print(f"{args.host}: link {args.state} ({veth})")
            return 0
    print(f"silod lab: link of {args.host!r} not found", file=sys.stderr)
    return 1
