"""Client-side subcommands of ``silod``: they talk to running services over gRPC."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import grpc

from silod.cli import locate
from silod.rpc.identifiers import DATASET_NAME, JOB_ID, NODE_NAME, TENANT, Rule

MANIFEST_CHUNK = 5000  # objects per streamed message: keeps each well under gRPC's 4 MiB limit


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Add the client subcommands to the ``silod`` parser."""
    health = sub.add_parser("health", help="exit 0 if the service at ADDR (default: every service of the cluster) "
                            "reports SERVING (for healthchecks)")
    health.add_argument("address", metavar="ADDR", nargs="?", default="",
                        help="HOST:PORT of any silod gRPC service, or the http://HOST:PORT/healthz URL of the "
                             "dashboard; default: each service of the cluster, found as every command finds it")
    health.add_argument("--service", default="", help="service name to check; default: the whole server")
    health.add_argument("--timeout", type=float, default=3.0, help="seconds to wait (default 3)")
    locate.add_flags(health, "metadata", "scheduler")
    health.set_defaults(handler=_health)

    dataset = sub.add_parser("dataset", help="register and inspect datasets")
    ds_sub = dataset.add_subparsers(dest="dataset_command", metavar="ACTION", required=True)
    reg = ds_sub.add_parser("register", help="list the store at URI and register its manifest under NAME")
    reg.add_argument("name", type=identifier(DATASET_NAME), help=f"dataset name ({DATASET_NAME.description})")
    reg.add_argument("uri", help="file:///path or s3://bucket/prefix")
    reg.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                     help="fsspec storage option, e.g. endpoint_url=http://127.0.0.1:9000 (repeatable)")
    reg.add_argument("--replace", action="store_true", help="replace the manifest of an existing dataset")
    reg.add_argument("--description", default="")
    reg.add_argument("--tenant", type=identifier(TENANT), default=None,
                     help="the tenant that owns the dataset (default: your only tenant; an admin's: default); "
                          "a replacement keeps the dataset's tenant")
    reg.add_argument("--shared", action="store_true",
                     help="readable by every tenant, and every job may name it (admins only)")
    reg.add_argument("--format", choices=("objects", "tar-shards"), default="objects",
                     help="objects: one sample per object (default); tar-shards: WebDataset-style .tar shards, "
                          "indexed now (every shard is read once) so samples are read by byte range")
    reg.set_defaults(handler=_dataset_register)
    lst = ds_sub.add_parser("list", help="list registered datasets (a user's: their tenant's and the shared ones)")
    lst.add_argument("--tenant", type=identifier(TENANT), default=None,
                     help="the datasets this tenant may read: its own and the shared ones (default: all you may see)")
    lst.set_defaults(handler=_dataset_list)
    show = ds_sub.add_parser("show", help="show one dataset and the first objects of its manifest")
    show.add_argument("name", type=identifier(DATASET_NAME))
    show.add_argument("--objects", type=int, default=10, help="manifest entries to print (default 10)")
    show.set_defaults(handler=_dataset_show)
    for p in (reg, lst, show):
        locate.add_flags(p, "metadata")
    preload = ds_sub.add_parser("preload", help="ask a node's cache server to fetch a dataset (or some keys) ahead of use")
    preload.add_argument("name", type=identifier(DATASET_NAME), help="registered dataset name")
    preload.add_argument("--node", default="", type=identifier(NODE_NAME, required=False),
                         help="the node whose cache server `silod up` started (default: the first)")
    preload.add_argument("--job", default="", type=identifier(JOB_ID, required=False), help="charge the fetches to this job's quota and IO rate "
                         "(default: node-wide preload into the shared cache)")
    preload.add_argument("--key", action="append", default=[], help="only this object key (repeatable; default all)")
    locate.add_flags(preload, "cache")
    preload.set_defaults(handler=_dataset_preload)


def identifier(rule: Rule, *, required: bool = True) -> object:
    """An argparse ``type`` that refuses what is not a valid identifier of ``rule``'s kind
    (silod/rpc/identifiers.py), before the command calls anything."""

    def parse(value: str) -> str:
        problem = None if (not value and not required) else rule.problem(value)
        if problem is not None:
            raise argparse.ArgumentTypeError(problem)
        return value

    parse.__name__ = rule.kind
    return parse


def _channel(address: str, args: argparse.Namespace) -> grpc.Channel:
    from silod.rpc.channels import open_channel

    token, tls_ca_file = locate.credentials(args)
    return open_channel(address, token=token, tls_ca_file=tls_ca_file)


def unreachable(found: locate.Found) -> int:
    return _fail(f"UNAVAILABLE: cannot reach the silod cluster at {found}; is it running? start one with `silod up`")


def _fail(message: str) -> int:
    print(f"silod: {message}", file=sys.stderr)
    return 1


def _rpc_failure(exc: grpc.RpcError) -> int:
    """Status name plus each problem the server listed, one line each (the field first); no traceback."""
    from silod.rpc.errors import describe

    for line in describe(exc):
        print(f"silod: {line}", file=sys.stderr)
    return 1


def _http_health(args: argparse.Namespace) -> int:
    """The dashboard is HTTP: 200 from its /healthz is SERVING."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(args.address, timeout=args.timeout) as reply:
            ok = reply.status == 200
    except urllib.error.HTTPError as exc:
        return _fail(f"{args.address}: HTTP {exc.code}")
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return _fail(f"{args.address}: {getattr(exc, 'reason', exc)}")
    print("SERVING" if ok else "NOT_SERVING")
    return 0 if ok else 1


def _health(args: argparse.Namespace) -> int:
    if not args.address:
        return _cluster_health(args)
    if args.address.startswith(("http://", "https://")):
        return _http_health(args)
    try:
        status = _grpc_health(args.address, args)
    except grpc.RpcError as exc:
        return _rpc_failure(exc)
    print(status)
    return 0 if status == "SERVING" else 1


def _grpc_health(address: str, args: argparse.Namespace) -> str:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with _channel(address, args) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def _cluster_health(args: argparse.Namespace) -> int:
    """Every gRPC service of the cluster: those `silod up` lists in cluster.json, else the
    metadata service and the scheduler as every command finds them. One line each."""
    try:
        info = locate.read_cluster_file(args.state_dir)
        if info and not (args.metadata or args.scheduler):
            targets = [(name, str(info[name])) for name in ("metadata", "estimator", "scheduler", "allocation")
                       if info.get(name)]
            for node in info.get("nodes") or []:
                targets += [(f"{kind} {node.get('name', '?')}", str(node[kind])) for kind in ("cache", "agent")
                            if node.get(kind)]
        else:
            targets = [(name, locate.find(args, name).address) for name in ("metadata", "scheduler")]
    except locate.ConfigError as exc:
        return _fail(str(exc))
    healthy = True
    width = max(len(name) for name, _ in targets)
    for name, address in targets:
        try:
            status = _grpc_health(address, args)
        except grpc.RpcError as exc:
            status = f"{exc.code().name}: {exc.details()}"
        healthy &= status == "SERVING"
        print(f"{name:<{width}}  {address:<21}  {status}")
    return 0 if healthy else 1


def all_pages(fetch: "Callable[[str], Any]", items: str) -> list[Any]:
    """Every item of a paged List call: ``fetch(page_token)`` returns a page with ``items`` and
    ``next_page_token``."""
    rows: list[Any] = []
    token = ""
    while True:
        page = fetch(token)
        rows.extend(getattr(page, items))
        token = page.next_page_token
        if not token:
            return rows


def call(args: argparse.Namespace, service: str, body: "Callable[[grpc.Channel], int]") -> int:
    """``body(channel)`` against ``service`` (found by silod.cli.locate): its exit status, or the
    refusal said one line per problem, or where the address came from when nothing answers."""
    try:
        found = locate.find(args, service)
        with _channel(found.address, args) as channel:
            try:
                return int(body(channel) or 0)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.UNAVAILABLE:
                    return unreachable(found)
                return _rpc_failure(exc)
            except KeyboardInterrupt:
                return 130
    except locate.ConfigError as exc:
        return _fail(str(exc))


def _parse_options(pairs: list[str]) -> dict[str, str]:
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--option: expected KEY=VALUE, got {pair!r}")
        options[key] = value
    return options


def _registration_stream(args: argparse.Namespace, options: dict[str, str],
                         objects: Iterable[object]) -> Iterator[object]:
    from silod.v1 import common_pb2, metadata_pb2

    spec = common_pb2.DatasetSpec(name=args.name, uri=args.uri, storage_options=options, description=args.description,
                                  tenant=args.tenant or "", shared=args.shared)
    chunk: list[common_pb2.DatasetObject] = []
    first = True
    for obj in objects:
        chunk.append(obj)
        if len(chunk) == MANIFEST_CHUNK:
            yield metadata_pb2.RegisterDatasetRequest(spec=spec if first else None, objects=chunk, replace=args.replace)
            first, chunk = False, []
    if first or chunk:
        yield metadata_pb2.RegisterDatasetRequest(spec=spec if first else None, objects=chunk, replace=args.replace)


def _dataset_register(args: argparse.Namespace) -> int:
    from silod.manifest import ManifestError
    from silod.v1 import metadata_pb2_grpc

    try:
        options = _parse_options(args.option)
        # Fail on a bad URI before opening a stream, so the error names the argument.
        from silod.manifest import list_objects

        if args.format == "tar-shards":
            from silod.data.shards import sample_objects

            # Indexed before the stream opens: a shard that cannot be read fails here, named.
            objects: Iterable[object] = list(sample_objects(args.uri, options))
        else:
            next(iter(list_objects(args.uri, options)), None)
            objects = list_objects(args.uri, options)
    except (ValueError, ManifestError) as exc:
        return _fail(str(exc))

    def body(channel: grpc.Channel) -> int:
        try:
            dataset = metadata_pb2_grpc.MetadataServiceStub(channel).RegisterDataset(
                _registration_stream(args, options, objects), timeout=600
            )
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.ALREADY_EXISTS:
                return _fail(f"{exc.details()} (run again with --replace to register the new manifest)")
            raise
        print(f"registered {dataset.spec.name}: {dataset.num_objects} objects, {_human_bytes(dataset.total_bytes)}, "
              f"manifest version {dataset.manifest_version}, tenant {dataset.spec.tenant}"
              + (" (shared with every tenant)" if dataset.spec.shared else ""))
        return 0

    return call(args, "metadata", body)


def _dataset_list(args: argparse.Namespace) -> int:
    from silod.v1 import metadata_pb2, metadata_pb2_grpc

    def body(channel: grpc.Channel) -> int:
        stub = metadata_pb2_grpc.MetadataServiceStub(channel)
        rows = all_pages(lambda token: stub.ListDatasets(
            metadata_pb2.ListDatasetsRequest(page_size=100, page_token=token, tenant=args.tenant or ""), timeout=30),
            "datasets")
        print(f"{'NAME':<24} {'TENANT':<16} {'OBJECTS':>9} {'SIZE':>10} {'VERSION':>7}  URI")
        for d in rows:
            tenant = d.spec.tenant + (" (shared)" if d.spec.shared else "")
            print(f"{d.spec.name:<24} {tenant:<16} {d.num_objects:>9} {_human_bytes(d.total_bytes):>10} "
                  f"{d.manifest_version:>7}  {d.spec.uri}")
        return 0

    return call(args, "metadata", body)


def _dataset_show(args: argparse.Namespace) -> int:
    from silod.v1 import metadata_pb2, metadata_pb2_grpc

    def body(channel: grpc.Channel) -> int:
        stub = metadata_pb2_grpc.MetadataServiceStub(channel)
        d = stub.GetDataset(metadata_pb2.GetDatasetRequest(name=args.name), timeout=30)
        objects = stub.ListDatasetObjects(
            metadata_pb2.ListDatasetObjectsRequest(name=args.name, page_size=max(1, min(args.objects, 10000))),
            timeout=30).objects if args.objects > 0 else []
        _print_dataset(d, objects)
        return 0

    return call(args, "metadata", body)


def _print_dataset(d: Any, objects: Any) -> None:
    print(f"name:             {d.spec.name}\nuri:              {d.spec.uri}\nobjects:          {d.num_objects}")
    print(f"tenant:           {d.spec.tenant}{' (shared with every tenant)' if d.spec.shared else ''}")
    print(f"size:             {_human_bytes(d.total_bytes)} ({d.total_bytes} bytes)")
    print(f"manifest version: {d.manifest_version}")
    for obj in objects:
        print(f"  {obj.key}  {obj.size_bytes} B  etag {obj.etag}")
    if d.num_objects > len(objects):
        print(f"  ... {d.num_objects - len(objects)} more")


def _dataset_preload(args: argparse.Namespace) -> int:
    from silod.v1 import cache_pb2, cache_pb2_grpc

    def body(channel: grpc.Channel) -> int:
        reply = cache_pb2_grpc.CacheServiceStub(channel).Prefetch(
            cache_pb2.PrefetchRequest(job_id=args.job, dataset=args.name, keys=args.key), timeout=120)
        print(f"queued {reply.objects_queued} objects ({_human_bytes(reply.bytes_queued)}) of {args.name} "
              f"at {locate.find(args, 'cache').address}; fetching in the background")
        return 0

    return call(args, "cache", body)


def _human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"
