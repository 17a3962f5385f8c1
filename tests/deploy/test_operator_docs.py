"""The operator documentation shows only commands that exist: every `silod ...` line in its
code blocks parses with the real CLI parser, `make` targets exist and paths under deploy/ are
real files."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from deploy_checks import ROOT, parse_cli

DOCS = [ROOT / "docs" / "operators.md", ROOT / "deploy" / "README.md", ROOT / "deploy" / "k8s" / "README.md",
        ROOT / "docs" / "configuration.md", ROOT / "README.md"]
COMPOSE_CLI = "docker compose -f deploy/compose.yaml run --rm"


def _code_lines(path: Path) -> list[str]:
    """Shell lines of the fenced ```sh blocks, continuation lines joined, comments dropped."""
    lines: list[str] = []
    for block in re.findall(r"```sh\n(.*?)```", path.read_text(), flags=re.S):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            line = re.sub(r"\s+#.*$", "", line.strip())
            if line and not line.startswith("#"):
                lines.append(line)
    return lines


def _silod_argvs(path: Path) -> list[list[str]]:
    out = []
    for line in _code_lines(path):
        words = shlex.split(line.rstrip("&").strip())
        if words[0] in ("silod", "/opt/silod/bin/silod"):
            out.append(words[1:])
        elif "--" in words and words[words.index("--") + 1:][:1] == ["silod"]:
            # `kubectl exec POD -- silod ARGS`
            out.append(words[words.index("--") + 2:])
        elif words[:2] == ["docker", "run"]:
            # `docker run [options] silod:TAG ARGS`: ARGS go to the image's entrypoint, silod.
            image = next(i for i, w in enumerate(words) if w.startswith("silod:"))
            out.append(words[image + 1:])
        elif line.startswith(COMPOSE_CLI) and "--entrypoint" not in words:
            # `run --rm [-v X] cli ARGS`: ARGS go to the image's entrypoint, silod.
            rest = words[len(COMPOSE_CLI.split()):]
            while rest[0].startswith("-"):
                rest = rest[2:] if rest[0] in ("-v", "-e") else rest[1:]
            assert rest[0] == "cli", line
            out.append(rest[1:])
    return out


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_documented_silod_commands_parse(path: Path) -> None:
    argvs = _silod_argvs(path)
    if path in DOCS[:2]:
        assert argvs, f"{path.name}: no silod command found; is the extraction broken?"
    for argv in argvs:
        parse_cli(argv)


def test_operators_guide_covers_every_way_to_run_and_every_service() -> None:
    argvs = _silod_argvs(ROOT / "docs" / "operators.md")
    commands = {argv[0] for argv in argvs}
    assert {"up", "health", "db", "dataset", "jobs", "logs", "submit"} <= commands
    text = (ROOT / "docs" / "operators.md").read_text()
    for heading in ("## One machine", "## Bare metal with systemd", "## Kubernetes", "## Health, metrics and logs",
                    "## Auth token and TLS", "## PostgreSQL: migrations and backups"):
        assert heading in text


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_referenced_files_and_make_targets_exist(path: Path) -> None:
    text = path.read_text()
    for ref in set(re.findall(r"(?<![\w/])deploy/[\w./*-]+[\w*]", text)):
        assert list(ROOT.glob(ref)), f"{path.name} mentions {ref}, which does not exist"
    makefile = (ROOT / "Makefile").read_text()
    for target in set(re.findall(r"`make ([\w-]+)`", text)):
        assert re.search(rf"^{re.escape(target)}:", makefile, flags=re.M), f"{path.name}: no make target {target}"
    for link in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
        assert (path.parent / link).exists(), f"{path.name}: broken link {link}"


def test_extraction_finds_a_bad_flag() -> None:
    # Guards the tests above: a documented flag that does not exist must be caught.
    with pytest.raises(AssertionError, match="rejected"):
        parse_cli(["health", "127.0.0.1:7070", "--timeout-s", "1"])


def _section(path: Path, heading: str) -> str:
    """The text from ``heading`` to the next heading of its level or above."""
    text = path.read_text()
    start = text.index(heading + "\n")
    level = heading.split(" ")[0]
    ends = [m.start() for m in re.finditer(r"^#{1,%d} " % len(level), text[start + len(heading):], flags=re.M)]
    return text[start:start + len(heading) + (ends[0] if ends else len(text))]


def test_the_compose_section_is_what_the_compose_test_runs_in_its_order() -> None:
    """docs/operators.md "Docker Compose": its `docker`, `export` and `.venv/bin/python` commands are
    compose_guide.GUIDE's, one for one and in the same order (test_compose_docker.py runs those),
    but the base image's `docker import` (tests/support/docker_engine.py makes the tests' base so)."""
    from compose_guide import GUIDE, pattern

    section = _section(ROOT / "docs" / "operators.md", "### Docker Compose")
    lines: list[str] = []
    for block in re.findall(r"```sh\n(.*?)```", section, flags=re.S):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            line = re.sub(r"\s+#.*$", "", line.strip())
            if line.startswith(("docker ", "export ", ".venv/bin/python ")):
                lines.append(line)
    assert len(lines) == len(GUIDE), "\n".join(lines)
    for line, step in zip(lines, GUIDE):
        assert pattern(step).match(line), f"the guide shows\n  {line}\nwhere the test runs {step}:\n  {GUIDE[step]}"
    # The base of the images: the recipe of tests/support/docker_engine.py.
    from tests.support import docker_engine

    assert f"--include={','.join(docker_engine.BASE_PACKAGES)} bookworm" in section
    assert docker_engine.DEBIAN_MIRROR in section
