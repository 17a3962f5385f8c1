"""`silod admin leader`: which scheduler leads (the metadata store's leadership lease,
GetLeadership; admin only): its address, epoch and when the lease runs out unless renewed.

What the election does: docs/operators.md "High availability".
"""

from __future__ import annotations

import argparse
import json
from datetime import datetime, timezone

import grpc

from silod.cli import locate
from silod.cli.client_commands import call


def add_parser(admin_sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> argparse.ArgumentParser:
    leader = admin_sub.add_parser(
        "leader", help="which scheduler leads (--leader-election): its address, the epoch, the lease's expiry",
        description="Exit status 0 while a scheduler holds an unexpired lease, 1 when none does (the lease "
                    "lapsed and no standby took it yet, or no scheduler ever ran with --leader-election).")
    leader.add_argument("--json", action="store_true", help="one JSON object")
    leader.set_defaults(handler=_leader)
    locate.add_flags(leader, "metadata")
    return leader


def _leader(args: argparse.Namespace) -> int:
    from silod.v1 import metadata_pb2, metadata_pb2_grpc

    def body(channel: grpc.Channel) -> int:
        lease = metadata_pb2_grpc.MetadataServiceStub(channel).GetLeadership(
            metadata_pb2.GetLeadershipRequest(), timeout=30)
        now = datetime.now(timezone.utc)
        expires = lease.expires_at.ToDatetime(tzinfo=timezone.utc) if lease.epoch else None
        held = expires is not None and expires > now
        if args.json:
            print(json.dumps({"address": lease.address, "holder": lease.holder, "epoch": lease.epoch,
                              "expires_at": expires.isoformat() if expires else None, "held": held}, sort_keys=True))
        elif not lease.epoch:
            print("no scheduler has led with --leader-election (epoch 0): a single scheduler, or none yet")
        elif held:
            print(f"leader   {lease.address}  (holder {lease.holder})\n"
                  f"epoch    {lease.epoch}\n"
                  f"expires  in {(expires - now).total_seconds():.1f} s unless renewed")
        else:
            print(f"no leader: the lease of {lease.address} (epoch {lease.epoch}) ran out "
                  f"{(now - expires).total_seconds():.1f} s ago")
        return 0 if held else 1

    return call(args, "metadata", body)
