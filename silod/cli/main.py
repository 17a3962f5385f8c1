"""Entry point of the ``silod`` console script.

Commands that run server code (the services in SERVICES, and SERVER_COMMANDS: `silod up`, the
simulator, the dashboard, ...) are listed here by module name and imported only when that
command runs. So ``silod --help`` and the client commands (submit, jobs, watch, logs, cancel,
dataset, health, admin, login) work from the client install (``pip install silod``) and stay fast; a server
command run from a client install says which extra to install.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
from dataclasses import dataclass

from silod.cli.settings_flags import add_settings_flags, settings_overrides

SERVER_EXTRA_HINT = "pip install 'silod[server]'"


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
    "allocation": ServiceCommand(
        "scheduler.allocation.service",
        "allocation service apart from the rounds: the nodes' plan watches, acks and task reports",
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


@dataclass(frozen=True)
class ServerCommand:
    module: str          # module whose ``register(sub)`` adds the command's full parser
    summary: str         # one line for ``silod --help``
    extra: str = "server"  # the install extra that brings its dependencies


SERVER_COMMANDS: dict[str, ServerCommand] = {
    "up": ServerCommand("silod.cli.up", "run a whole silod cluster on this machine (emulated nodes) until Ctrl-C"),
    "db": ServerCommand("silod.cli.admin", "database administration (schema migrations)"),
    "simulate": ServerCommand("simulator.cli", "trace-driven cluster simulation of the scheduling policies", "sim"),
    "dashboard": ServerCommand(
        "services.dashboard.cli", "read-only web dashboard: nodes and GPUs, jobs, cache, plans, charts over time, a page per job"),
    "store-emulator": ServerCommand(
        "services.devstore.cli",
        "serve a directory over the S3 protocol with a shared bandwidth limit and a latency per request"),
    "lab": ServerCommand(
        "silod.lab.cli", "a multi-host silod cluster on this machine: deploy/compose.yaml's services in network "
        "namespaces (root)"),
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
            try:
                add_settings_flags(p, importlib.import_module(svc.module).Settings)
            except ModuleNotFoundError:
                # A client install, or a server install missing a dependency: the flags are
                # unknown, so main lets them pass and _run_service names the missing module
                # (rather than argparse's "unrecognized arguments").
                p.set_defaults(flags_unknown=True)
        p.set_defaults(handler=_run_service, service=name)
    if chosen in SERVICES:
        # A service process parses only its own command: the client, simulator and dashboard
        # commands import numpy, aiohttp and the simulator (~0.6 s of CPU at every start).
        return parser
    from silod.cli import access, client_commands, jobs, nodes

    client_commands.register(sub)
    jobs.register(sub)
    nodes.register(sub)
    access.register(sub)
    for name, command in SERVER_COMMANDS.items():
        if name == chosen:
            _register_server_command(sub, name, command)
        else:  # listed in --help without importing it
            sub.add_parser(name, help=command.summary, add_help=False).set_defaults(handler=_not_chosen)
    return parser


def _register_server_command(sub: "argparse._SubParsersAction[argparse.ArgumentParser]", name: str,
                             command: ServerCommand) -> None:
    try:
        importlib.import_module(command.module).register(sub)
    except ModuleNotFoundError as exc:  # a client install: the command's dependencies are not there
        extra = f"pip install 'silod[{command.extra}]'"
        message = f"silod {name} needs the {command.extra} install ({extra}): no module named {exc.name!r}"
        refusal = sub.add_parser(name, help=command.summary, add_help=False)
        refusal.add_argument("arguments", nargs=argparse.REMAINDER)  # whatever follows: the refusal comes first
        refusal.set_defaults(handler=lambda _args: _refuse(message))


def _not_chosen(args: argparse.Namespace) -> int:  # pragma: no cover - build_parser always picks the command
    return _refuse("internal error: the command's parser was not built")


def _refuse(message: str) -> int:
    print(message, file=sys.stderr)
    return 2


def _run_service(args: argparse.Namespace) -> int:
    try:
        from services.runtime.server import run
        from services.runtime.settings import ConfigError, load_settings

        module = importlib.import_module(SERVICES[args.service].module)
    except ModuleNotFoundError as exc:
        return _refuse(f"silod {args.service} needs the server install ({SERVER_EXTRA_HINT}): "
                       f"no module named {exc.name!r}")
    try:
        settings = load_settings(module.Settings, args.config, **settings_overrides(args, module.Settings))
    except ConfigError as exc:
        print(f"silod {args.service}: configuration error: {exc}", file=sys.stderr)
        return 2
    return run(module.definition(settings), settings)


def main(argv: list[str] | None = None) -> int:
    """The ``silod`` program (``argv`` None: its arguments are sys.argv), or one command of it
    called from Python (``argv`` given)."""
    called_as_program = argv is None
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "flags_unknown", False):
        parser.parse_args(argv)  # argparse's own error for what it does not know
    if called_as_program and getattr(args, "service", None) is None and hasattr(signal, "SIGPIPE"):
        # Client commands piped into `head` should stop quietly, as Unix tools do. Services
        # keep Python's default: a closed stdout must not kill a server. Only the program
        # itself: a process that calls main() (a test, a notebook) would otherwise die of the
        # next write to any closed socket or pipe, without a word.
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    try:
        return int(args.handler(args) or 0)
    except ModuleNotFoundError as exc:  # a server command's code or dependency absent: a client install
        command = SERVER_COMMANDS.get(getattr(args, "command", ""))
        if command is None or not exc.name:
            raise
        return _refuse(f"silod {args.command} needs the {command.extra} install "
                       f"(pip install 'silod[{command.extra}]'): no module named {exc.name!r}")
