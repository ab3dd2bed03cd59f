"""The user docs hold together: every relative link of the README, ``docs/*.md`` and ``patterns/README.md``
reaches a file that exists, and every ``#anchor`` a heading of its page; the README stays a first screen and an
index (under 300 lines); no change-history notes ("issue N") in the user docs; the figures the README quotes
are the ones ``tools/doc_figures.py`` measured (``docs/figures.json``). Reads files only: well under a second.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.helpers import REPO

README = REPO / "README.md"
PAGES = sorted([README, REPO / "patterns" / "README.md", *(REPO / "docs").glob("*.md")])
#: ``[text](target)``, not an image; the target without spaces (markdown's own rule for bare targets)
LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def _prose(text: str) -> str:
    """``text`` without its fenced code blocks (a link-like string in code is not a link)."""
    kept, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            kept.append(line)
    return "\n".join(kept)


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`([^`]*)`", r"\1", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    slugs: dict[str, int] = {}
    found = set()
    for line in _prose(page.read_text()).splitlines():
        match = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if match:
            slug = _slug(match.group(2))
            seen = slugs.get(slug, 0)
            found.add(slug if not seen else f"{slug}-{seen}")
            slugs[slug] = seen + 1
    return found


def _links(page: Path) -> list[str]:
    return [target for target in LINK.findall(_prose(page.read_text()))
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target)]  # http:, https:, mailto:


def test_the_pages_exist():
    names = {page.name for page in PAGES}
    for name in ("how-it-works.md", "families.md", "using-the-backend.md", "check.md", "verl.md", "hybrid-models.md",
                 "torchair.md", "performance.md", "supported-stacks.md", "bad-inputs.md", "limitations.md",
                 "development.md", "install.md"):
        assert name in names, name


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_and_anchor_resolves(page):
    broken = []
    for target in _links(page):
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no file {resolved.relative_to(REPO) if resolved.is_relative_to(REPO) else resolved}")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"{target}: no heading with anchor #{anchor} in {resolved.relative_to(REPO)}")
    assert not broken, f"{page.relative_to(REPO)}:\n  " + "\n  ".join(broken)


def test_the_readme_is_a_first_screen_and_an_index():
    lines = README.read_text().splitlines()
    assert len(lines) < 300, f"README.md has {len(lines)} lines; move reference material to a docs/ page"
    linked = {Path(target.partition("#")[0]).name for target in _links(README) if target.startswith("docs/")}
    documented = {page.name for page in (REPO / "docs").glob("*.md")} - {"README.md"}
    assert documented <= linked, f"docs pages the README's index does not link: {sorted(documented - linked)}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_no_change_history_in_user_docs(page):
    history = re.findall(r"[^.\n]{0,40}\b(?:[Ii]ssue \d+|[Ss]ince issue|[Bb]efore issue)\b[^.\n]{0,40}", page.read_text())
    assert not history, history


def _readme_block_after(marker: str) -> list[str]:
    text = README.read_text()
    start = text.index(marker)
    block = text[start:].split("```", 2)[1]
    return block.split("\n", 1)[1].rstrip("\n").splitlines()


def test_the_readme_check_sample_is_the_measured_one():
    """The check output the README shows, its progress-line count and its times are ``docs/figures.json``'s
    (``tools/doc_figures.py``); after re-measuring, paste the new figures."""
    figures = json.loads((REPO / "docs" / "figures.json").read_text())["checks"]
    measured = figures["qwen2.5-0.5b-2-layers"]
    assert measured["verdict"] == "PASS", measured
    shown = _readme_block_after("The first prints ")
    assert shown == measured["output"], "README's check sample differs from docs/figures.json"
    text = README.read_text()
    assert f"({measured['progress_lines']} lines for its {measured['stages']} stages)" in text
    for key in ("qwen2.5-0.5b-2-layers", "qwen3.5-0.8b-4-layers", "qwen2.5-0.5b-all-layers"):
        entry = figures[key]
        seconds = round(entry["seconds"])
        said = f"{seconds} s" if seconds < 100 else f"{seconds // 60} min {seconds % 60:02d} s"
        line = next(line for line in text.splitlines() if line.split("#")[0].strip() == entry["command"])
        assert f"({said})" in line or f"({said};" in line or f", {said})" in line, (key, said, line)
