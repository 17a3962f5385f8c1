"""Every link between the project's pages resolves: the file exists and, for a #fragment, so does
the heading it names (GitHub's anchors: lower case, punctuation dropped, spaces to hyphens)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("deploy/**/*.md"),
                *ROOT.glob("benchmarks/**/*.md")])
LINK = re.compile(r"(?<!\!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def _text_outside_code(path: Path, inline: bool = True) -> str:
    """The page without fenced code blocks (and without inline code unless ``inline`` is False)."""
    lines, fenced = [], False
    for line in path.read_text().splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(re.sub(r"`[^`]*`", "", line) if inline else line)  # inline code is not a link
    return "\n".join(lines)


def anchor(heading: str) -> str:
    text = re.sub(r"`", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in _text_outside_code(path, inline=False).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            slug = anchor(m.group(1))
            n = seen.get(slug, 0)
            found.add(slug if n == 0 else f"{slug}-{n}")
            seen[slug] = n + 1
    return found


def broken_links(page: Path) -> list[str]:
    problems = []
    for target in LINK.findall(_text_outside_code(page)):
        if re.match(r"^[a-z]+:", target) or target.startswith("mailto:"):
            continue  # a URL: not checked here (no network)
        path_part, _, fragment = target.partition("#")
        linked = (page.parent / path_part).resolve() if path_part else page
        if not linked.exists():
            problems.append(f"{target}: no such file")
        elif fragment and linked.suffix == ".md" and fragment not in anchors(linked):
            problems.append(f"{target}: no heading #{fragment} in {linked.name}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_resolves(page: Path) -> None:
    assert broken_links(page) == []


def test_a_broken_link_is_caught(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other page\n\n## A section: with `code`\n")
    page.write_text("[ok](other.md#a-section-with-code) [bad](missing.md) [gone](other.md#nowhere)\n"
                    "```\n[in code](nowhere.md)\n```\n")
    assert broken_links(page) == ["missing.md: no such file", "other.md#nowhere: no heading #nowhere in other.md"]
