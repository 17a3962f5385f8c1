"""deploy/Dockerfile and .dockerignore, checked without a Docker engine: the runtime image is
python:3.11-slim unless the PYTHON_IMAGE build argument names another base (the tests' compose
run builds it FROM a Debian bookworm root: tests/deploy/test_compose_docker.py), runs as a non-root
user with `silod` as entrypoint, installs the wheel without the dev extra (no torch), and has the
directories the deployments mount volumes on."""

from __future__ import annotations

import fnmatch
import json
import re
import tomllib
from typing import Any

import yaml
from packaging.specifiers import SpecifierSet

from deploy_checks import DEPLOY, ROOT, compose_interpolate

DOCKERFILE = DEPLOY / "Dockerfile"


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def _final_stage() -> list[tuple[str, str]]:
    instructions = _instructions()
    last_from = max(i for i, (k, _) in enumerate(instructions) if k == "FROM")
    return instructions[last_from:]


def test_every_stage_is_python_3_11_slim_unless_the_build_argument_says_otherwise() -> None:
    instructions = _instructions()
    first_from = min(i for i, (k, _) in enumerate(instructions) if k == "FROM")
    args = [a for k, a in instructions[:first_from] if k == "ARG"]
    assert args == ["PYTHON_IMAGE=python:3.11-slim"], args
    bases = [args.split()[0] for keyword, args in instructions if keyword == "FROM"]
    assert bases and all(base == "${PYTHON_IMAGE}" for base in bases), bases
    # The compose file passes the argument through, with the same default.
    build = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["x-silod"]["build"]
    assert build["args"] == {"PYTHON_IMAGE": "${SILOD_PYTHON_IMAGE:-python:3.11-slim}"}
    # The image runs the services, which are tested on Python 3.11 only (the SDK alone supports
    # more: README "Pythons"): the Python `make test` runs, and one pyproject.toml admits.
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert SpecifierSet(project["requires-python"]).contains("3.11.0"), project["requires-python"]
    assert "Programming Language :: Python :: 3.11" in project["classifiers"]
    assert re.search(r"^PYTHON \?= python3\.11$", (ROOT / "Makefile").read_text(), re.M)


def test_runtime_stage_runs_silod_as_non_root() -> None:
    final = _final_stage()
    users = [args for keyword, args in final if keyword == "USER"]
    assert users and users[-1] not in ("root", "0"), users
    (entrypoint,) = [json.loads(args) for keyword, args in final if keyword == "ENTRYPOINT"]
    assert entrypoint == ["silod"]
    # The user is created in this stage with the uid the Kubernetes manifests run as.
    created = " ".join(args for keyword, args in final if keyword == "RUN")
    assert re.search(rf"useradd .*--uid 10001 .*{users[-1]}\b", created)


def test_installs_do_not_pull_the_dev_extra_or_keep_a_pip_cache() -> None:
    pip_runs = [args for keyword, args in _instructions() if keyword == "RUN" and "pip " in args]
    assert pip_runs
    for args in pip_runs:
        assert "--no-cache-dir" in args, args
        # torch, test tools and protoc live in [dev]; services never import them.
        assert "[dev]" not in args and "torch" not in args, args
    dev = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    assert any(d.startswith("torch") for d in dev), "torch moved out of [dev]: recheck the image size"
    runtime = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not any(d.startswith("torch") for d in runtime)


def test_build_context_keeps_the_packages_and_drops_the_venv() -> None:
    ignored = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    assert ".venv" in ignored and ".git" in ignored
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    needed = ["pyproject.toml", project["project"]["readme"]]
    needed += [p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file() and any(
        fnmatch.fnmatch(p.name, pattern) for pattern in project["tool"]["setuptools"]["packages"]["find"]["include"])]
    assert len(needed) > 5
    for path in needed:
        assert not any(fnmatch.fnmatch(path, pattern) for pattern in ignored), f".dockerignore drops {path}"


def test_directories_the_deployments_mount_exist_in_the_image() -> None:
    # Docker gives a new named volume the owner of the directory it covers; a directory the
    # image lacks would be root-owned and unwritable for the silod user. The compose file's
    # silod services mount named volumes in Docker's data root (none today: the directories their
    # nodes share are the host's, which volumes with driver_opts bind), the Kubernetes manifests
    # volumes under /var.
    created = " ".join(args for keyword, args in _final_stage() if keyword == "RUN")
    compose: dict[str, Any] = compose_interpolate(yaml.safe_load((DEPLOY / "compose.yaml").read_text()))
    targets = set()
    for svc in compose["services"].values():
        if svc.get("image", "").startswith("silod:"):
            targets |= {spec.split(":")[1] for spec in svc.get("volumes", []) if not spec.startswith("/")
                        and not (compose["volumes"].get(spec.split(":")[0]) or {}).get("driver_opts")}
    for manifest in sorted((DEPLOY / "k8s").glob("*.yaml")):
        targets |= set(re.findall(r"mountPath: (/var/[\w/.-]+)", manifest.read_text()))
    assert "/var/lib/silod/agent" in targets and "/var/cache/silod/disk" in targets
    for target in sorted(targets):
        assert re.search(rf"mkdir -p [^&]*{re.escape(target)}\b", created), f"image does not create {target}"
