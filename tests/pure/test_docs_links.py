"""Every relative link in README.md and docs/*.md leads somewhere: its file exists (relative to
the linking file's folder) and its ``#anchor``, if any, is a heading of the target (GitHub's
slug of it). Links to the web (``http(s)://``, ``mailto:``) are not followed."""

from __future__ import annotations

import re
from pathlib import Path

from tests.helpers.paths import REPO

ROOT = REPO

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
CODE_SPAN = re.compile(r"`+[^`\n]*`+")
# [text](target) or [text](target "title"); the text may wrap onto the next line. Images too.
LINK = re.compile(r"\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.M)
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def without_code(text: str) -> str:
    """``text`` with fenced blocks and code spans blanked out (a link there is not a link)."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text without markup, lower case, punctuation other
    than ``-`` and ``_`` dropped, spaces as ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of ``path``, with GitHub's ``-1``, ``-2`` for repeated ones."""
    seen: dict[str, int] = {}
    found = set()
    for match in HEADING.finditer(FENCE.sub("", path.read_text())):
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """Each relative link of ``path`` that resolves to nothing, saying why (paths shown
    relative to ``root``)."""
    broken = []
    for match in LINK.finditer(without_code(path.read_text())):
        target = match.group(1)
        if EXTERNAL.match(target):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{_shown(path, root)}: ({target})"
        if not dest.exists():
            broken.append(f"{where}: no such file {_shown(dest, root)}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{where}: no heading #{anchor} in {_shown(dest, root)}")
    return broken


def _shown(path: Path, root: Path) -> str:
    return str(path.relative_to(root)) if path.is_relative_to(root) else str(path)


def test_the_slug_is_githubs():
    assert slug("At scale: the simulator") == "at-scale-the-simulator"
    assert slug("The benchmarks' peers") == "the-benchmarks-peers"
    assert slug("Failures, growth, checkpoints") == "failures-growth-checkpoints"
    assert slug("`ringleader plan` and run_dir") == "ringleader-plan-and-run_dir"


def test_a_broken_link_is_caught(tmp_path):
    (tmp_path / "there.md").write_text("# A heading\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](there.md) [ok](there.md#a-heading) [ok](#mine) [web](https://example.com/x)\n"
        "[gone](missing.md) [no anchor](there.md#nope) [mine, no anchor](#nope)\n"
        "`[in code](missing.md)`\n\n```\n[in a block](missing.md)\n```\n\n## Mine\n"
    )
    problems = broken_links(page, tmp_path)
    assert len(problems) == 3, problems
    assert "missing.md" in problems[0] and "#nope" in problems[1] and "#nope" in problems[2]


def test_every_relative_link_in_readme_and_docs_resolves():
    files = markdown_files()
    assert len(files) > 2
    problems = [problem for path in files for problem in broken_links(path)]
    assert not problems, "broken links:\n" + "\n".join(problems)
