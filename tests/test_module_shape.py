"""The cache server, the live scheduler, the policies, the simulator and the worker agent stay in
rooms a newcomer can read (docs/architecture.md, "Inside the cache server", "Inside the live
scheduler", "Policies and the simulator" and "Inside the worker agent"): no module over 450
lines, no class over 300, and imports among each package's modules that run one way."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("cache_server", "scheduler/live", "scheduler/policies", "simulator", "worker_agent", "worker_agent/runtimes")
MAX_MODULE_LINES = 450
MAX_CLASS_LINES = 300


def _modules(package: str) -> dict[str, Path]:
    dotted = package.replace("/", ".")
    return {f"{dotted}.{path.stem}": path for path in sorted((ROOT / package).glob("*.py")) if path.stem != "__init__"}


def _imports(path: Path, package: str, known: set[str]) -> set[str]:
    """The package's modules ``path`` imports, at the top or inside functions (either can close a
    cycle at run time); TYPE_CHECKING-only imports too, since they name a dependency."""
    dotted = package.replace("/", ".")
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module in known:
                found.add(node.module)
            elif node.module == dotted:
                found |= {f"{dotted}.{alias.name}" for alias in node.names} & known
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names} & known
    return found


@pytest.mark.parametrize("package", PACKAGES)
def test_no_module_or_class_is_too_long(package: str) -> None:
    for name, path in _modules(package).items():
        lines = len(path.read_text().splitlines())
        assert lines <= MAX_MODULE_LINES, f"{name}: {lines} lines (split it by concern)"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                size = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                assert size <= MAX_CLASS_LINES, f"{name}.{node.name}: {size} lines"


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_among_the_packages_modules_run_one_way(package: str) -> None:
    modules = _modules(package)
    graph = {name: _imports(path, package, set(modules)) - {name} for name, path in modules.items()}
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for target in sorted(graph[name]):
            if state.get(target) == 1:
                cycle = path[path.index(target):] + [target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target, [*path, target])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
