"""Every link in the README, the docs and the notebooks resolves inside the repository: its file
exists, and an anchor into a markdown page names one of that page's headings."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py"))]
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#+\s+(.+?)\s*$", re.MULTILINE)


def slug(heading: str) -> str:
    """A heading's anchor as GitHub writes it: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def links(page: Path) -> list[str]:
    text = page.read_text()
    if page.suffix == ".py":  # a notebook's markdown cells are comment lines
        text = "\n".join(line.removeprefix("# ") for line in text.splitlines() if line.startswith("#"))
    return [target for target in _LINK.findall(text) if not re.match(r"[a-z]+:", target)]


def broken(page: Path, root: Path = ROOT) -> list[str]:
    found = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            found.append(f"{target}: no such file")
        elif not file.is_relative_to(root):
            found.append(f"{target}: outside the repository")
        elif anchor and file.suffix == ".md" and anchor not in {slug(h) for h in _HEADING.findall(file.read_text())}:
            found.append(f"{target}: no heading #{anchor} in {file.name}")
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_resolves_inside_the_repository(page):
    assert not broken(page), f"{page.relative_to(ROOT)}: {broken(page)}"


def test_the_checker_sees_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n[ok](page.md#title) [gone](missing.md) [anchor](page.md#nowhere) [web](https://x.y)\n")
    assert broken(page, tmp_path) == ["missing.md: no such file", "page.md#nowhere: no heading #nowhere in page.md"]
