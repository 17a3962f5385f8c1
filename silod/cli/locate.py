"""Where the cluster is, for every client command: one order, everywhere.

For a service's address (``--metadata``, ``--scheduler``, ``--cache``):

1. the command's flag;
2. the environment (``SILOD_METADATA_ADDR``, ``SILOD_SCHEDULER_ADDR``, ``SILOD_CACHE_ADDR``);
3. the ``cluster.json`` of a running ``silod up``, in ``--state-dir`` (``SILOD_STATE_DIR``,
   default ``.silod/cluster``);
4. the user's config file: ``SILOD_CLIENT_CONFIG``, else ``$XDG_CONFIG_HOME/silod/client.yaml``
   (``~/.config/silod/client.yaml``), with the keys ``metadata``, ``scheduler``, ``cache``,
   ``token`` and ``tls_ca_file``;
5. this machine, at the port the deployment files (deploy/systemd, deploy/compose.yaml) give
   the service: a bare-metal install.

The TLS CA file takes the same order without step 3 and 5 (``silod up`` runs without one). The
token too, with the credential ``silod login`` stored (``$XDG_CONFIG_HOME/silod/token``, mode
0600) between the environment and the config file. A command that cannot reach what it found
says where the address came from.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_STATE_DIR = ".silod/cluster"
CLUSTER_FILE = "cluster.json"
CONFIG_ENV = "SILOD_CLIENT_CONFIG"


@dataclass(frozen=True)
class Service:
    flag: str  # --<flag> on the command line
    env: str
    default: str  # this machine, at the service's port in deploy/ (tests/deploy checks they agree)
    label: str


SERVICES = {
    "metadata": Service("metadata", "SILOD_METADATA_ADDR", "127.0.0.1:7070", "metadata service"),
    "scheduler": Service("scheduler", "SILOD_SCHEDULER_ADDR", "127.0.0.1:7073", "scheduler"),
    "cache": Service("cache", "SILOD_CACHE_ADDR", "127.0.0.1:7071", "cache server"),
}


@dataclass(frozen=True)
class Found:
    """An address and where it came from (for messages when it cannot be reached)."""

    address: str
    source: str

    def __str__(self) -> str:
        return f"{self.address} ({self.source})"


class ConfigError(Exception):
    """The user's config file exists but cannot be used: the message names the file and the key."""


def default_state_dir() -> str:
    return os.environ.get("SILOD_STATE_DIR", DEFAULT_STATE_DIR)


def config_path() -> Path:
    explicit = os.environ.get(CONFIG_ENV)
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "silod" / "client.yaml"


def add_flags(parser: argparse.ArgumentParser, *services: str) -> None:
    """The flags that say where the cluster is: one per service the command calls, the state dir
    of ``silod up``, the token and the TLS CA file."""
    for name in services:
        service = SERVICES[name]
        parser.add_argument(f"--{service.flag}", default="", metavar="HOST:PORT",
                            help=f"{service.label} address (env {service.env}; default: from cluster.json, "
                                 f"the client config file, else {service.default})")
    parser.add_argument("--state-dir", default=default_state_dir(),
                        help=f"where `silod up` wrote cluster.json (env SILOD_STATE_DIR; default {DEFAULT_STATE_DIR})")
    parser.add_argument("--token", default="", help="bearer token when the services require one "
                        "(env SILOD_AUTH_TOKEN; else the one `silod login` stored; else `token` in the client "
                        "config file)")
    parser.add_argument("--tls-ca-file", default="", help="PEM CA to verify TLS services "
                        "(env SILOD_TLS_CA_FILE; or `tls_ca_file` in the client config file)")


def read_cluster_file(state_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    import json

    try:
        return json.loads((Path(state_dir) / CLUSTER_FILE).read_text())
    except (OSError, ValueError):
        return None


def read_config() -> dict[str, Any]:
    """The user's config file as a mapping; {} when there is none."""
    path = config_path()
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise ConfigError(f"cannot read the client config file {path}: {exc.strerror}") from None
    import yaml

    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of keys (metadata, scheduler, cache, token, tls_ca_file)")
    known = {*SERVICES, "token", "tls_ca_file"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"{path}: unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})")
    for key, value in data.items():
        if not isinstance(value, str):
            raise ConfigError(f"{path}: {key}: expected a string, got {type(value).__name__}")
    return data


def _from_cluster(args: argparse.Namespace, name: str) -> str:
    info = read_cluster_file(getattr(args, "state_dir", default_state_dir()))
    if not info:
        return ""
    if name == "cache":  # one per node: the node the command names, else the first
        wanted = getattr(args, "node", "") or ""
        for node in info.get("nodes") or []:
            if node.get("cache") and (not wanted or node.get("name") == wanted):
                return str(node["cache"])
        return ""
    return str(info.get(name) or "")


def find(args: argparse.Namespace, name: str) -> Found:
    """The address of service ``name`` for this command, in the order of the module's docstring."""
    service = SERVICES[name]
    if getattr(args, service.flag, ""):
        return Found(getattr(args, service.flag), f"from --{service.flag}")
    if os.environ.get(service.env):
        return Found(os.environ[service.env], f"from {service.env}")
    from_cluster = _from_cluster(args, name)
    if from_cluster:
        return Found(from_cluster, f"from {Path(getattr(args, 'state_dir', default_state_dir())) / CLUSTER_FILE}")
    configured = read_config().get(name)
    if configured:
        return Found(configured, f"from {config_path()}")
    return Found(service.default, f"the default address: none of --{service.flag}, {service.env}, "
                                  f"{Path(getattr(args, 'state_dir', default_state_dir())) / CLUSTER_FILE} "
                                  f"and {config_path()} names one")


LOGIN_FILE_ENV = "SILOD_LOGIN_FILE"


def login_path() -> Path:
    """Where `silod login` keeps the user's credential: beside the default client config file."""
    explicit = os.environ.get(LOGIN_FILE_ENV)
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "silod" / "token"


def read_login() -> str:
    """The credential `silod login` stored; "" when there is none. Read at every command, so a
    new login takes effect at the next one."""
    path = login_path()
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        return ""
    except OSError as exc:
        raise ConfigError(f"cannot read the stored login credential {path}: {exc.strerror}") from None


def credentials(args: argparse.Namespace) -> tuple[str, str]:
    """(token, TLS CA file): the flag, else the environment, else (the token) the stored login,
    else the config file."""
    config: dict[str, Any] | None = None

    def pick(flag: str, env: str, key: str) -> str:
        nonlocal config
        value = getattr(args, flag, "") or os.environ.get(env, "")
        if value:
            return str(value)
        if key == "token" and (stored := read_login()):
            return stored
        if config is None:
            config = read_config()
        return str(config.get(key) or "")

    return pick("token", "SILOD_AUTH_TOKEN", "token"), pick("tls_ca_file", "SILOD_TLS_CA_FILE", "tls_ca_file")
