"""Every relative link of the README, docs/ and bench/README.md names a file of the repository (and a
heading of it, where it names one)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", ROOT / "bench" / "README.md", *(ROOT / "docs").glob("*.md")])

FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]*`")
#: ``[text](target)`` and ``![alt](target)``, the text holding at most one level of brackets.
LINK = re.compile(r"\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
EXTERNAL = ("http://", "https://", "mailto:")


def prose(text: str) -> str:
    """The text without fenced code blocks and code spans: a link written there is not a link."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def links(text: str) -> list[str]:
    """The targets of the markdown links in ``text``, in order."""
    return LINK.findall(prose(text))


def anchors(text: str) -> set[str]:
    """The anchors GitHub gives the headings of a page (lower case, punctuation dropped, spaces to
    hyphens, a repeated one numbered ``-1``, ``-2``, …)."""
    seen: dict[str, int] = {}
    for title in HEADING.findall(FENCE.sub("", text)):
        slug = re.sub(r"[^\w\- ]", "", title.replace("`", "").strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        if count:
            seen[f"{slug}-{count}"] = 1
    return set(seen)


def broken(page: Path, root: Path = ROOT) -> list[str]:
    """Each relative link of ``page`` that names no file under ``root``, or no heading of its page."""
    text = page.read_text(encoding="utf-8")
    problems = []
    for target in links(text):
        if target.startswith(EXTERNAL):
            continue
        path_part, _, anchor = target.partition("#")
        path = (page.parent / path_part).resolve() if path_part else page
        if not path.is_relative_to(root.resolve()):
            problems.append(f"{target}: outside the repository")
        elif not path.exists():
            problems.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path.read_text(encoding="utf-8")):
            problems.append(f"{target}: no heading #{anchor} in {path.relative_to(root.resolve())}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_resolves(page: Path) -> None:
    """Each relative link of the page names a file in the repository, and a heading where it names one."""
    assert broken(page) == []


def test_the_pages_are_there() -> None:
    """The README and the documentation pages the README links to exist and are checked here."""
    names = {p.relative_to(ROOT).as_posix() for p in PAGES}
    assert {"README.md", "docs/README.md", "bench/README.md", "docs/reliability.md"} <= names


def test_a_broken_link_a_missing_anchor_and_a_way_out_are_each_found(tmp_path: Path) -> None:
    """A missing file, a missing heading and a path leaving the repository are reported; code is not
    read as links, and a heading's anchor is found the way GitHub spells it."""
    (tmp_path / "docs").mkdir()
    other = "# Other\n\n## What `plan` prints: the numbers\n\n## Twice\n\n## Twice\n"
    (tmp_path / "docs" / "other.md").write_text(other)
    page = tmp_path / "docs" / "page.md"
    page.write_text(
        "[ok](other.md#what-plan-prints-the-numbers) [again](other.md#twice-1) [self](#a-page)\n"
        "[gone](missing.md) [no heading](other.md#nowhere) [out](../../elsewhere.md)\n"
        "`[code](not-a-link.md)`\n```\n[fenced](also-not.md)\n```\n# A page\n"
    )
    assert broken(page, root=tmp_path) == [
        "missing.md: no such file",
        "other.md#nowhere: no heading #nowhere in docs/other.md",
        "../../elsewhere.md: outside the repository",
    ]
