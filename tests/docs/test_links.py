"""Every relative link in the manuals resolves: README.md, docs/**/*.md and bench/README.md.

A link is `[text](target)` or `![alt](target)` outside code; its file must exist (relative to the page) and
its `#anchor`, when it has one and points into markdown, must be a heading there (GitHub's anchors).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = sorted([REPO / "README.md", REPO / "bench" / "README.md", *(REPO / "docs").rglob("*.md")])

LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
CODE_SPAN = re.compile(r"`[^`\n]*`")


def _prose(text: str) -> str:
    """The page without fenced code, indented code blocks or code spans: links there are not links."""
    text = FENCE.sub("", text)
    text = "\n".join(line for line in text.splitlines() if not line.startswith("    "))
    return CODE_SPAN.sub("", text)


def anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", FENCE.sub("", text), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(page: Path) -> list[str]:
    out = []
    for target in LINK.findall(_prose(page.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.exists():
            out.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            out.append(f"{target}: no heading #{anchor} in {path_part or page.name}")
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page):
    assert broken_links(page) == []


def test_a_missing_file_or_heading_is_reported(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## The section's title (v2)\n")
    page = tmp_path / "page.md"
    page.write_text("See [ok](other.md#the-sections-title-v2), [gone](missing.md), [bad](other.md#nope),\n"
                    "[here](#top), `[code](ignored.md)`, [web](https://example.com/x.md).\n\n# Top\n\n"
                    "```\n[fenced](ignored.md)\n```\n")
    assert broken_links(page) == ["missing.md: no such file", "other.md#nope: no heading #nope in other.md"]


def test_the_manuals_link_to_the_docs_and_the_results():
    readme = (REPO / "README.md").read_text()
    assert "](docs/performance.md)" in readme and "](docs/design/README.md)" in readme
    assert "](bench/results/" in readme  # the Performance figures link to their result files
