"""Shared checks for the deployment files: a `silod` command line plus its SILOD_* environment
must be exactly what the real CLI parser and the real settings classes accept.

Parsing with the production parser and loading with the production ``load_settings`` (rather
than matching flag names with a regex) means a renamed flag, a removed setting, a typo in an
environment variable or a value the validators refuse all fail here, not at deploy time.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import urllib.parse
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from services.runtime.settings import ServiceSettings, load_settings, split_host_port
from silod.cli.main import SERVICES, build_parser
from silod.cli.settings_flags import settings_overrides

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"

# Environment variables the client commands read (silod/cli/*.py); they are not settings fields.
CLIENT_ENV = {"SILOD_METADATA_ADDR", "SILOD_SCHEDULER_ADDR", "SILOD_CACHE_ADDR", "SILOD_AUTH_TOKEN",
              "SILOD_TLS_CA_FILE", "SILOD_STATE_DIR", "SILOD_DB"}

# Which service a `<x>_address` setting points at.
ADDRESS_TARGETS = {"metadata_address": "metadata", "estimator_address": "estimator",
                   "scheduler_address": "scheduler", "cache_address": "cache-server"}
# The nodes' --scheduler-address names the allocation service (silod allocation), which follows the
# schedulers: the deployments serve the nodes' plan watches, acks and reports apart from the rounds.
NODE_KINDS = ("worker-agent", "cache-server")


def address_target(kind: str, setting: str) -> str:
    """The kind of service that ``setting`` of a ``kind`` service must name."""
    if setting == "scheduler_address" and kind in NODE_KINDS:
        return "allocation"
    return ADDRESS_TARGETS[setting]


CLIENT_ADDRESS_TARGETS = {"SILOD_METADATA_ADDR": "metadata", "SILOD_SCHEDULER_ADDR": "scheduler",
                          "SILOD_CACHE_ADDR": "cache-server"}


def parse_cli(argv: Sequence[str]) -> argparse.Namespace:
    """Parse ``silod ARGV`` with the real parser; a usage error becomes an AssertionError."""
    argv = list(argv)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return build_parser(argv).parse_args(argv)
    except SystemExit as exc:
        raise AssertionError(f"`silod {' '.join(argv)}` is rejected by the CLI parser: {err.getvalue().strip()}") from None


def settings_class(service: str) -> type[ServiceSettings]:
    from services.runtime.config_reference import service_settings

    return dict(service_settings())[service]


@contextlib.contextmanager
def environment(env: Mapping[str, str]) -> Iterator[None]:
    """Exactly ``env`` for the SILOD_* part of os.environ (the test runner's own are hidden)."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("SILOD_")}
    try:
        for key in saved:
            del os.environ[key]
        os.environ.update({k: v for k, v in env.items() if k.startswith("SILOD_")})
        yield
    finally:
        for key in [k for k in os.environ if k.startswith("SILOD_")]:
            del os.environ[key]
        os.environ.update(saved)


def load_service(argv: Sequence[str], env: Mapping[str, str], where: str) -> tuple[str, ServiceSettings]:
    """Parse a service command line and load its settings from flags + ``env``.

    Fails if the command is not a service, a SILOD_* variable is not one of the service's
    settings (pydantic-settings silently ignores unknown variables, so a typo would otherwise
    pass unnoticed) or the settings do not validate.
    """
    with environment(env):
        # The parser reads some defaults from the environment, so parse inside it too.
        args = parse_cli(argv)
        service = getattr(args, "service", None)
        assert service is not None, f"{where}: `silod {' '.join(argv)}` is not a service command"
        cls = settings_class(service)
        unknown = sorted(k for k in env if k.startswith("SILOD_") and k != "SILOD_CONFIG"
                         and k.removeprefix("SILOD_").lower() not in cls.model_fields)
        assert not unknown, f"{where}: {unknown} are not settings of `silod {service}`"
        settings = load_settings(cls, None, **settings_overrides(args, cls))
    return service, settings


def check_client_command(argv: Sequence[str], env: Mapping[str, str], where: str) -> argparse.Namespace:
    """A non-service command (db upgrade, health, ...): parses, and its SILOD_* env is known."""
    unknown = sorted(k for k in env if k.startswith("SILOD_") and k not in CLIENT_ENV)
    assert not unknown, f"{where}: {unknown} are not read by `silod {' '.join(argv[:2])}`"
    with environment(env):
        args = parse_cli(argv)
    assert getattr(args, "service", None) is None, f"{where}: expected a client command, got a service"
    return args


def port_of(address: str) -> int:
    """The port of HOST:PORT, or of an http(s):// URL (the dashboard's health check)."""
    if address.startswith(("http://", "https://")):
        return urllib.parse.urlsplit(address).port or (443 if address.startswith("https") else 80)
    return split_host_port(address)[1]


def host_port(address: str) -> tuple[str, int]:
    return split_host_port(address)


def addresses(settings: ServiceSettings) -> dict[str, str]:
    """The non-empty ``*_address`` settings that point at another silod service."""
    return {k: getattr(settings, k) for k in ADDRESS_TARGETS if getattr(settings, k, "")}


def each_address(settings: ServiceSettings) -> list[tuple[str, str]]:
    """(setting, HOST:PORT) for every address of :func:`addresses`, a comma-separated list
    (``--scheduler-address a,b``: the schedulers that take turns leading) giving one pair each."""
    return [(k, a.strip()) for k, v in addresses(settings).items() for a in v.split(",") if a.strip()]


# The innermost ${VAR...}: its default holds no further substitution.
_INTERPOLATION = re.compile(r"\$\{(\w+)(?::?-([^${}]*))?\}")


def compose_interpolate(value: Any, env: Mapping[str, str] | None = None) -> Any:
    """Compose's ${VAR:-default} / ${VAR-default} / ${VAR}, nested defaults included, and $$ for
    a $: with the variables of ``env`` set (none by default: the file's defaults)."""
    env = env or {}
    if isinstance(value, str):
        escaped = value.replace("$$", "\0")
        while True:
            done = _INTERPOLATION.sub(lambda m: env.get(m.group(1)) or m.group(2) or "", escaped)
            if done == escaped:
                return done.replace("\0", "$")
            escaped = done
    if isinstance(value, list):
        return [compose_interpolate(v, env) for v in value]
    if isinstance(value, dict):
        return {k: compose_interpolate(v, env) for k, v in value.items()}
    return value


def shutdown_needs_s(service: str, settings: ServiceSettings) -> float:
    """Seconds a service may take to stop after SIGTERM before the supervisor must not kill it:
    the server's grace for calls in flight, plus for an agent the time its tasks get to
    checkpoint (worker_agent/agent.py's shutdown stops tasks first)."""
    return settings.shutdown_grace_s + (getattr(settings, "stop_grace_s", 0.0) if service == "worker-agent" else 0.0)


def check_advertised_cache(agent: ServiceSettings, cache: ServiceSettings, where: str) -> None:
    """The agent advertises its node's cache to the scheduler (NodeSpec), which bounds cache
    quotas by it (scheduler/invariants.py); it must be what the cache server really has."""
    assert (agent.cache_capacity_bytes, agent.memory_cache_bytes) == (cache.disk_cache_bytes, cache.memory_cache_bytes), (
        f"{where}: agent advertises disk {agent.cache_capacity_bytes} / memory {agent.memory_cache_bytes} B, "
        f"cache server has {cache.disk_cache_bytes} / {cache.memory_cache_bytes} B"
    )


def check_gpus_per_node(loaded: list[tuple[str, ServiceSettings]], where: str) -> None:
    """The estimator packs jobs onto nodes of ``gpus_per_node`` GPUs; the example nodes
    (emulated: no NVML in the image) report ``gpus``; the two must agree."""
    estimators = [s for kind, s in loaded if kind == "estimator"]
    agents = [s for kind, s in loaded if kind == "worker-agent"]
    assert estimators and agents
    assert {s.gpus_per_node for s in estimators} == {a.gpus for a in agents}, f"{where}: GPUs per node disagree"
