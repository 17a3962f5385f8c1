"""`silod admin tenant quota NAME ...`: show, set or clear a tenant's quota (SetTenantQuota).

Flags change only what they name; the rest of the quota stays as it is. ``--clear`` removes the
quota (the tenant then has no guarantee). What the fields mean: docs/tenants.md.
"""

from __future__ import annotations

import argparse
import math
import re

import grpc

from silod.cli.client_commands import _fail, call

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKMGTP]i?)?B?\s*$")
_UNITS = {"": 1, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15,
          "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "ki": 2**10}


def add_parser(tenant_sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> argparse.ArgumentParser:
    quota = tenant_sub.add_parser(
        "quota", help="show, set or clear a tenant's quota (nominal GPUs, cache and remote IO ceilings)",
        description="Without flags: show the quota. Flags change only what they name.")
    quota.add_argument("name", help="tenant name")
    quota.add_argument("--gpus", type=str, default=None, metavar="N",
                       help="nominal GPUs of any type (untyped clusters); 0 removes that entry")
    quota.add_argument("--gpus-type", action="append", default=[], metavar="TYPE=N",
                       help="nominal GPUs of one GPU type, e.g. v100=8 (repeatable; N=0 removes it)")
    quota.add_argument("--cache-bytes", default=None, metavar="BYTES",
                       help="ceiling on the cache its jobs are granted, all nodes: 200G, 1.5Ti, 0; 'none' = no ceiling")
    quota.add_argument("--remote-io", default=None, metavar="SHARE",
                       help="ceiling on its jobs' remote IO: a fraction of the storage budget (0.25 or 25%%); "
                            "'none' = no ceiling")
    quota.add_argument("--borrowing-limit", default=None, metavar="N",
                       help="GPUs it may hold beyond its nominal ones; 'none' = no limit")
    quota.add_argument("--lending-limit", default=None, metavar="N",
                       help="of its idle nominal GPUs, how many may be lent; 'none' = all")
    quota.add_argument("--clear", action="store_true", help="remove the quota")
    quota.set_defaults(handler=_quota)
    return quota


def describe(quota) -> str:  # type: ignore[no-untyped-def]
    """One line: ``gpus 8, v100=4; cache 200 GB; remote IO 25%; borrow <= 4; lend <= 2``."""
    gpus = ", ".join(f"{e.gpu_type}={e.gpus}" if e.gpu_type else str(e.gpus) for e in quota.gpus) or "none"
    parts = [f"gpus {gpus}"]
    parts.append(f"cache {_bytes(quota.cache_bytes)}" if quota.HasField("cache_bytes") else "cache no ceiling")
    parts.append(f"remote IO {quota.remote_io_share:.0%}" if quota.HasField("remote_io_share") else "remote IO no ceiling")
    if quota.HasField("borrowing_limit_gpus"):
        parts.append(f"borrow <= {quota.borrowing_limit_gpus}")
    if quota.HasField("lending_limit_gpus"):
        parts.append(f"lend <= {quota.lending_limit_gpus}")
    return "; ".join(parts)


def _bytes(value: int) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= size:
            return f"{value / size:g} {unit}"
    return f"{value} B"


class _Bad(ValueError):
    pass


def _count(flag: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise _Bad(f"{flag}: expected a whole number of GPUs >= 0, got {text!r}") from None
    if value < 0:
        raise _Bad(f"{flag}: expected a whole number of GPUs >= 0, got {text!r}")
    return value


def _size(text: str) -> int:
    match = _SIZE.match(text)
    if not match:
        raise _Bad(f"--cache-bytes: expected bytes such as 200G, 1.5Ti or 0, or 'none', got {text!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2) or ""])


def _share(text: str) -> float:
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 <= value <= 1):
        raise _Bad(f"--remote-io: expected a fraction in [0, 1] (0.25) or a percentage (25%), or 'none', got {text!r}")
    return value


def apply_flags(quota, args: argparse.Namespace) -> None:  # type: ignore[no-untyped-def]
    """Change ``quota`` (access_pb2.TenantQuota) by the flags given; _Bad naming the flag."""
    gpus = {e.gpu_type: e.gpus for e in quota.gpus}
    if args.gpus is not None:
        gpus[""] = _count("--gpus", args.gpus)
    for pair in args.gpus_type:
        kind, sep, count = pair.partition("=")
        if not sep or not kind.strip():
            raise _Bad(f"--gpus-type: expected TYPE=N such as v100=8, got {pair!r}")
        gpus[kind.strip()] = _count(f"--gpus-type {kind.strip()}", count)
    del quota.gpus[:]
    for kind in sorted(gpus):
        if gpus[kind] > 0:
            quota.gpus.add(gpu_type=kind, gpus=gpus[kind])
    for flag, field, parse in (("cache_bytes", "cache_bytes", _size), ("remote_io", "remote_io_share", _share),
                               ("borrowing_limit", "borrowing_limit_gpus", lambda t: _count("--borrowing-limit", t)),
                               ("lending_limit", "lending_limit_gpus", lambda t: _count("--lending-limit", t))):
        text = getattr(args, flag)
        if text is None:
            continue
        if text.strip().lower() == "none":
            quota.ClearField(field)
        else:
            setattr(quota, field, parse(text))


def _quota(args: argparse.Namespace) -> int:
    from silod.v1 import access_pb2, metadata_pb2_grpc

    sets = any(v is not None for v in (args.gpus, args.cache_bytes, args.remote_io, args.borrowing_limit,
                                       args.lending_limit)) or bool(args.gpus_type)
    if args.clear and sets:
        return _fail("--clear: give it alone, without the flags that set a quota")
    changes = args.clear or sets
    try:
        apply_flags(access_pb2.TenantQuota(), args)  # bad flags are refused before anything is asked
    except _Bad as exc:
        return _fail(str(exc))

    def body(channel: grpc.Channel) -> int:
        stub = metadata_pb2_grpc.MetadataServiceStub(channel)
        current = next((t for t in stub.ListTenants(access_pb2.ListTenantsRequest(), timeout=30).tenants
                        if t.name == args.name), None)
        if current is None:
            return _fail(f"NOT_FOUND: name: no tenant {args.name!r} (see `silod admin tenant list`)")
        if not changes:
            print(f"{current.name}: {describe(current.quota) if current.HasField('quota') else 'no quota'}")
            return 0
        request = access_pb2.SetTenantQuotaRequest(name=args.name)
        if not args.clear:
            quota = access_pb2.TenantQuota()
            if current.HasField("quota"):
                quota.CopyFrom(current.quota)
            quota.ClearField("updated_at")
            try:
                apply_flags(quota, args)
            except _Bad as exc:
                return _fail(str(exc))
            request.quota.CopyFrom(quota)
        reply = stub.SetTenantQuota(request, timeout=30)
        print(f"{reply.name}: {describe(reply.quota) if reply.HasField('quota') else 'no quota'}")
        return 0

    return call(args, "metadata", body)
