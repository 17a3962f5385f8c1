"""The layering the folders show, as data the packaging tests check.

``silod`` is what a job owner installs (``pip install silod``): the job SDK, the client commands,
the generated contracts (``silod.v1``) and the client-side RPC helpers (``silod.rpc``). The
server packages (the services, the scheduler, the simulator) import it, never the other way
round, except commands that start servers, which import server code inside the command's
handler only."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SDK = ROOT / "silod"
SERVER_PACKAGES = frozenset({"services", "scheduler", "estimator", "cache_server", "worker_agent", "simulator", "lab"})
# Third-party packages only the server, simulator or test installs have.
SERVER_ONLY_DEPENDENCIES = frozenset({
    "sqlalchemy", "alembic", "psycopg2", "scipy", "matplotlib", "prometheus_client", "pydantic", "pydantic_settings",
    "grpc_reflection", "aiodocker",
})
# Modules of commands that start servers: server imports inside functions are allowed there.
SERVER_COMMAND_MODULES = frozenset({"silod.cli.main", "silod.cli.up", "silod.cli.admin", "silod.demo", "silod.launcher"})


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sdk_modules() -> Iterator[Path]:
    for path in sorted(SDK.rglob("*.py")):
        if "v1" not in path.relative_to(SDK).parts[:1]:  # generated stubs import only grpc/protobuf
            yield path


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(path: Path) -> Iterator[tuple[str, int, bool]]:
    """(imported module, line, at module level) of every import statement of ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    package = module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else module_name(path)
    top_level = {id(node) for node in tree.body}
    typing_only = {id(inner) for node in ast.walk(tree) if isinstance(node, ast.If) and _is_type_checking(node.test)
                   for stmt in node.body for inner in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in typing_only:  # `if TYPE_CHECKING:` imports never run
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno, id(node) in top_level
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                name = f"{base}.{node.module}" if node.module else base
            else:
                name = node.module or ""
            at_top = id(node) in top_level
            yield name, node.lineno, at_top
            for alias in node.names:  # `from silod.data import store` imports silod.data.store
                yield f"{name}.{alias.name}", node.lineno, at_top
