"""What the lab runs, read from ``deploy/compose.yaml``: each service's command, environment,
ports, health check, volumes and start order.

The lab runs processes, not containers, so these things are translated and nothing else:
``image: silod`` services run the checkout's ``silod`` console script; a named volume's container
path (in arguments and environment) becomes a directory under the lab's state dir, shared by the
services that mount the same volume (a bind of a Docker host's file, the Engine's socket, is left
out); the ``postgres`` and ``objectstore`` images (or the stand-ins of deploy/local-images) become
a PostgreSQL server and moto's server started from this machine's binaries; Prometheus and the
services that run a shell instead of silod (``entrypoint``: node-dirs, which makes the Docker
host's directories) are left out (:data:`NOT_IN_THE_LAB`); and the agents' container runtime
(ranks as Docker containers, :data:`CONTAINER_RUNTIME_ENV`) gives way to the agent's default, ranks
as its processes. Variables are interpolated as compose does (``${VAR:-default}``, ``${VAR}``,
nested defaults, ``$$``) from the given environment.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

# Images of the compose file that the lab leaves out: they observe the cluster, not run it.
NOT_IN_THE_LAB = ("prometheus",)
# The agents' settings of the container runtime, which needs a Docker Engine: the lab drops them.
CONTAINER_RUNTIME_ENV = ("SILOD_RUNTIME", "SILOD_DOCKER_HOST", "SILOD_CONTAINER_NETWORK", "SILOD_DEFAULT_IMAGE")

import yaml

COMPOSE_FILE = Path(__file__).resolve().parents[2] / "deploy" / "compose.yaml"
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^${}]*))?\}")  # the innermost: no ${ in its default


class ComposeError(ValueError):
    pass


@dataclass
class Service:
    name: str
    kind: str                       # "silod", "postgres" or "objectstore"
    command: list[str]
    environment: dict[str, str]
    healthcheck: list[str]          # argv of the check, [] for none
    ports: list[int]                # container ports it listens on
    depends_on: dict[str, str]      # service -> condition
    volumes: dict[str, str] = field(default_factory=dict)   # container path -> volume name
    one_shot: bool = False          # must exit 0 (depended on with service_completed_successfully)


def interpolate(text: str, env: Mapping[str, str]) -> str:
    def sub(m: re.Match[str]) -> str:
        value = env.get(m.group(1), "")
        return value if value else (m.group(2) or "")
    text = text.replace("$$", "\0")  # compose's $ for a literal $
    while True:  # innermost first: ${A:-${B:-x}}
        done = _VAR.sub(sub, text)
        if done == text:
            return done.replace("\0", "$")
        text = done


def _node_copy(template: dict[str, Any], number: int) -> dict[str, Any]:
    """compose.yaml's own recipe for more nodes: node 1's services with 1 replaced by N."""
    text = json.dumps(template)
    text = re.sub(r"\b(cache|agent|node|cache-disk|cache-mem|agent-work)-1\b", lambda m: f"{m.group(1)}-{number}", text)
    return json.loads(text)


def _inference_copy(template: dict[str, Any], number: int) -> dict[str, Any]:
    """The same for inference nodes: infer-0's services (cache-infer-0, agent-infer-0, their
    volumes and the node name infer-0) with 0 replaced by N."""
    return json.loads(re.sub(r"\binfer-0\b", f"infer-{number}", json.dumps(template)))


def load(nodes: int = 2, env: Mapping[str, str] | None = None, path: Path = COMPOSE_FILE,
         inference_nodes: int = 1) -> dict[str, Service]:
    """The services of ``path`` in start order, with ``nodes`` training cache/agent pairs (>= 1)
    and ``inference_nodes`` inference ones (>= 0)."""
    raw = interpolate(path.read_text(), env or {})
    doc = yaml.safe_load(raw)
    services: dict[str, Any] = copy.deepcopy(doc.get("services") or {})
    for kept in ("cache-0", "agent-0", "cache-1", "agent-1", "cache-infer-0", "agent-infer-0"):
        if kept not in services:
            raise ComposeError(f"{path}: service {kept!r} is missing (the lab copies node 1 and infer-0 for more nodes)")
    for n in range(2, nodes):
        services[f"cache-{n}"] = _node_copy(services["cache-1"], n)
        services[f"agent-{n}"] = _node_copy(services["agent-1"], n)
    for n in range(nodes, 2):
        services.pop(f"cache-{n}")
        services.pop(f"agent-{n}")
    for n in range(1, inference_nodes):
        services[f"cache-infer-{n}"] = _inference_copy(services["cache-infer-0"], n)
        services[f"agent-infer-{n}"] = _inference_copy(services["agent-infer-0"], n)
    if inference_nodes < 1:
        services.pop("cache-infer-0")
        services.pop("agent-infer-0")
    result = {}
    for name, spec in services.items():
        if spec.get("profiles"):
            continue   # run on demand (the cli), not by `up`
        if any(image in str(spec.get("image", "")) for image in NOT_IN_THE_LAB):
            continue   # watches the cluster; nothing in it depends on it (tests/observability runs a Prometheus)
        if spec.get("entrypoint"):
            continue   # a shell for the Docker host (node-dirs): the lab makes its own directories
        result[name] = _service(name, spec, path)
    for service in result.values():
        service.depends_on = {d: c for d, c in service.depends_on.items() if d in result or d not in services}
    return _start_order(result)


def _service(name: str, spec: dict[str, Any], path: Path) -> Service:
    image = str(spec.get("image", ""))
    kind = ("postgres" if "postgres" in image else "objectstore" if "moto" in image or "objectstore" in image
            else "silod" if "silod" in image else "")
    if not kind:
        raise ComposeError(f"{path}: service {name!r}: the lab does not know how to run image {image!r}")
    command = spec.get("command") or []
    if isinstance(command, str):
        raise ComposeError(f"{path}: service {name!r}: command must be a list (exec form)")
    env = {str(k): "" if v is None else str(v) for k, v in (spec.get("environment") or {}).items()}
    if env.get("SILOD_RUNTIME") == "container":  # ranks as the agent's processes (module docstring)
        env = {k: v for k, v in env.items() if k not in CONTAINER_RUNTIME_ENV}
    check = (spec.get("healthcheck") or {}).get("test") or []
    if check and check[0] == "CMD":
        check = check[1:]
    elif check:
        raise ComposeError(f"{path}: service {name!r}: healthcheck test must be [\"CMD\", ...]")
    ports = []
    for p in spec.get("ports") or []:
        ports.append(int(str(p).rsplit(":", 1)[-1].split("/")[0]))
    depends = spec.get("depends_on") or {}
    if isinstance(depends, list):
        depends = {d: "service_started" for d in depends}
    depends = {d: (c or {}).get("condition", "service_started") for d, c in depends.items()}
    volumes = {}
    for v in spec.get("volumes") or []:
        source, target = str(v).split(":")[:2]
        if not source.startswith(("/", ".")):  # named volumes only: a bind names the Docker host's file
            volumes[target] = source
    one_shot = str(spec.get("restart", "")) == "no" and bool(command)
    return Service(name, kind, [str(c) for c in command], env, [str(c) for c in check], ports,
                   depends, volumes, one_shot)


def _start_order(services: dict[str, Service]) -> dict[str, Service]:
    ordered: dict[str, Service] = {}

    def visit(name: str, path: tuple[str, ...]) -> None:
        if name in ordered:
            return
        if name in path:
            raise ComposeError(f"depends_on cycle: {' -> '.join(path + (name,))}")
        if name not in services:
            raise ComposeError(f"{path[-1]} depends on unknown service {name!r}")
        for dep in services[name].depends_on:
            visit(dep, path + (name,))
        ordered[name] = services[name]

    for name in services:
        visit(name, ())
    return ordered


def map_volumes(args: list[str], volumes: Mapping[str, str], root: Path) -> list[str]:
    """Replace container mount paths in ``args`` by the volume's directory under ``root``."""
    out = []
    for a in args:
        for target, source in sorted(volumes.items(), key=lambda kv: -len(kv[0])):
            if a == target or a.startswith(target + "/"):
                a = str(root / source) + a[len(target):]
                break
        out.append(a)
    return out
