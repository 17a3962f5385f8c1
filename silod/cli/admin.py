"""`silod db`: database administration. A server command: it imports the metadata service's
migrations when run, so it needs the server install."""

from __future__ import annotations

import argparse
import os

from silod.cli.client_commands import _fail


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    db = sub.add_parser("db", help="database administration (schema migrations)")
    db_sub = db.add_subparsers(dest="db_command", metavar="ACTION", required=True)
    upgrade = db_sub.add_parser("upgrade", help="apply the metadata schema migrations (Alembic) and exit")
    upgrade.add_argument("--db", default=os.environ.get("SILOD_DB", "sqlite:///silod-metadata.db"),
                         help="database URL (env SILOD_DB; default sqlite:///silod-metadata.db)")
    upgrade.set_defaults(handler=_db_upgrade)


def _db_upgrade(args: argparse.Namespace) -> int:
    from services.metadata.migrate import upgrade

    try:
        upgrade(args.db)
    except Exception as exc:  # connection refused, bad URL, permissions: report, don't dump a traceback
        return _fail(f"db upgrade failed for {args.db}: {exc}")
    print(f"schema of {args.db} is up to date")
    return 0
