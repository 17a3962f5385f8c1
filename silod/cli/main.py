"""Entry point of the ``silod`` console script.

Service subcommands are looked up in SERVICES and imported lazily, so that ``silod --help``
and the client commands stay fast and do not need the server-side dependencies loaded.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
from dataclasses import dataclass

from silod.cli.settings_flags import add_settings_flags, settings_overrides


@dataclass(frozen=True)
class ServiceCommand:
    module: str          # module exposing ``Settings`` and ``definition(settings)``
    summary: str         # one line for ``silod --help``
    status: str = ""     # what is not implemented yet, shown in --help


SERVICES: dict[str, ServiceCommand] = {
    "metadata": ServiceCommand(
        "services.metadata.service",
        "metadata store: datasets, jobs, nodes, plans, metrics (SQLite or PostgreSQL)",
    ),
    "estimator": ServiceCommand(
        "estimator.service",
        "performance estimator (SiloD cache/IO model, Pollux goodput model)",
    ),
    "scheduler": ServiceCommand(
        "scheduler.service",
        "job front door (JobService), allocation service and scheduling rounds",
    ),
    "cache-server": ServiceCommand(
        "cache_server.service",
        "per-node tiered dataset cache (memory and disk tiers, quotas, IO rates, leases)",
    ),
    "worker-agent": ServiceCommand(
        "worker_agent.service",
        "per-node agent that runs job processes (plan watch, checkpoint/resize, progress, logs)",
    ),
}


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The full parser; only the service named in ``argv`` gets its settings flags loaded.

    Importing a service module pulls in its server-side dependencies, so ``silod --help``
    and the client commands never import any of them.
    """
    chosen = next((a for a in (argv or []) if not a.startswith("-")), None)
    parser = argparse.ArgumentParser(
        prog="silod",
        description="silod: a GPU cluster manager in which the job scheduler and the dataset cache decide together.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, svc in SERVICES.items():
        summary = f"[not implemented yet] {svc.summary}" if svc.status else svc.summary
        description = (f"{svc.summary}. {svc.status}." if svc.status else f"{svc.summary}.") + (
            " Every flag can also be set as a SILOD_<NAME> environment variable or in --config."
        )
        p = sub.add_parser(name, help=summary, description=description)
        p.add_argument("--config", metavar="FILE", help="YAML or TOML file of settings (env SILOD_CONFIG)")
        if name == chosen:
            add_settings_flags(p, importlib.import_module(svc.module).Settings)
        p.set_defaults(handler=_run_service, service=name)
    if chosen in SERVICES:
        # A service process parses only its own command: the client, simulator and dashboard
        # commands import numpy, aiohttp and the simulator (~0.6 s of CPU at every start).
        return parser
    from silod.cli import client_commands

    client_commands.register(sub)
    _register_optional(sub, "simulator.cli")
    _register_optional(sub, "silod.cli.up")
    _register_optional(sub, "silod.cli.jobs")
    _register_optional(sub, "silod.dashboard.cli")
    _register_optional(sub, "silod.devstore.cli")
    _register_optional(sub, "silod.lab.cli")
    return parser


def _register_optional(sub: "argparse._SubParsersAction[argparse.ArgumentParser]", module: str) -> None:
    """Add the subcommands of ``module`` (its ``register(sub)``) if it exists in this build."""
    try:
        registrar = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and module.startswith(exc.name):
            return
        raise
    registrar.register(sub)


def _run_service(args: argparse.Namespace) -> int:
    from services.runtime.server import run
    from services.runtime.settings import ConfigError, load_settings

    module = importlib.import_module(SERVICES[args.service].module)
    try:
        settings = load_settings(module.Settings, args.config, **settings_overrides(args, module.Settings))
    except ConfigError as exc:
        print(f"silod {args.service}: configuration error: {exc}", file=sys.stderr)
        return 2
    return run(module.definition(settings), settings)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    if getattr(args, "service", None) is None and hasattr(signal, "SIGPIPE"):
        # Client commands piped into `head` should stop quietly, as Unix tools do. Services
        # keep Python's default: a closed stdout must not kill a server.
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    return int(args.handler(args) or 0)
