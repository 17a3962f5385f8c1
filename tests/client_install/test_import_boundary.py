"""The SDK and client commands never import server code, and the SDK has no import circles."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.client_install.boundary import (
    ROOT,
    SDK,
    SERVER_COMMAND_MODULES,
    SERVER_ONLY_DEPENDENCIES,
    SERVER_PACKAGES,
    imports,
    module_name,
    sdk_modules,
)


def test_no_sdk_module_imports_server_code() -> None:
    offences = []
    for path in sdk_modules():
        name = module_name(path)
        for imported, line, at_top in imports(path):
            top = imported.split(".")[0]
            if top not in SERVER_PACKAGES | SERVER_ONLY_DEPENDENCIES:
                continue
            if name in SERVER_COMMAND_MODULES and not at_top:
                continue  # a server command's handler: imported only when the command runs
            offences.append(f"{path.relative_to(ROOT)}:{line} imports {imported}")
    assert offences == []


def test_sdk_has_no_import_circles() -> None:
    """Between modules of silod/ (lazy imports inside functions count too)."""
    modules = {module_name(p): p for p in sdk_modules()}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        graph[name] = set()
        for imported, _, _ in imports(path):
            # `import silod.data.store` needs silod.data (the package) too, which is no cycle of this module's.
            if imported in modules and imported != name and not name.startswith(imported + "."):
                graph[name].add(imported)
    cycles = _cycles(graph)
    assert cycles == [], "import circles: " + "; ".join(" -> ".join(c) for c in cycles)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


# Run in a fresh interpreter in which the server packages and the server-only dependencies
# cannot be imported, as in a client install: every SDK module and the client commands load.
_CLIENT_PROBE = r"""
import importlib, importlib.abc, json, pkgutil, sys
blocked = set(json.loads(sys.argv[1]))
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked: not in a client install)", name=name)
        return None
sys.meta_path.insert(0, Blocker())
import silod
loaded = []
for info in pkgutil.walk_packages(silod.__path__, "silod."):
    if info.name in set(json.loads(sys.argv[2])) or info.name.endswith(".__main__"):
        continue
    importlib.import_module(info.name)
    loaded.append(info.name)
from silod.cli.main import build_parser
for argv in (["--help"], ["jobs", "--help"], ["submit", "--help"], ["dataset", "list", "--help"], ["watch", "--help"]):
    try:
        build_parser(argv).parse_args(argv)
    except SystemExit as exit:
        assert exit.code == 0, (argv, exit.code)
print(json.dumps(loaded))
"""


def test_every_sdk_and_client_module_loads_without_server_code() -> None:
    server_commands = sorted(SERVER_COMMAND_MODULES - {"silod.cli.main"})
    done = subprocess.run(
        [sys.executable, "-c", _CLIENT_PROBE, json.dumps(sorted(SERVER_PACKAGES | SERVER_ONLY_DEPENDENCIES)),
         json.dumps(server_commands)],
        capture_output=True, text=True, timeout=120, cwd=SDK.parent,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = set(json.loads(done.stdout.strip().splitlines()[-1]))
    assert {"silod.job", "silod.data.dataset", "silod.data.sampler", "silod.rpc", "silod.cli.jobs",
            "silod.v1.scheduler_pb2_grpc", "silod.manifest", "silod.jobs.emulated"} <= loaded


def test_a_server_command_from_a_client_install_names_the_extra() -> None:
    probe = r"""
import importlib.abc, sys
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {"simulator", "services", "scheduler", "scipy", "sqlalchemy"}:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Blocker())
from silod.cli.main import main
sys.exit(main(sys.argv[1:]))
"""
    # A service started with its flags (as `silod up` starts them) is told the same, not
    # "unrecognized arguments": its flags are unknown without its module.
    for argv, extra in ((["simulate", "list"], "silod[sim]"), (["metadata"], "silod[server]"),
                        (["metadata", "--listen", "127.0.0.1:0", "--db", "sqlite:///x.db"], "silod[server]"),
                        (["db", "upgrade"], "silod[server]")):
        done = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, timeout=60,
                              cwd=SDK.parent)
        assert done.returncode == 2, (argv, done.stderr)
        assert extra in done.stderr and "Traceback" not in done.stderr, (argv, done.stderr)
