"""docs/performance.md and the README's Performance tables are exactly what `python -m bench.headline --write`
makes from the result files, so a figure copied by hand, or a result file changed under it, cannot drift.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from bench import headline

REPO = Path(__file__).resolve().parents[2]


def test_docs_performance_is_regenerated_exactly_from_the_result_files():
    assert (REPO / "docs" / "performance.md").read_text() == headline.render(), \
        "docs/performance.md differs from its result files: run `python -m bench.headline --write`"


def test_the_readme_performance_tables_are_regenerated_exactly():
    readme = (REPO / "README.md").read_text()
    assert headline.with_readme_block(readme, headline.readme_block()) == readme, \
        "README.md's Performance tables differ from the result files: run `python -m bench.headline --write`"


def test_every_figure_in_the_readme_tables_links_to_a_result_file_that_holds_it():
    block = headline.readme_block()
    lines = block.splitlines()
    body = [line for line, after in zip(lines, [*lines[1:], ""], strict=True)  # table rows, headers left out
            if line.startswith("| ") and not after.startswith("|---") and not line.startswith("|---")]
    cells = [c for line in body for c in line.strip("|").split("|")[1:]]
    figures = [c for c in cells if re.search(r"\d", c)]
    assert figures and all(re.fullmatch(r" \[[^\]]+\]\(bench/results/[^)]+\.md\)( \([^)]+\))? ", c) or c == " - "
                           for c in figures), figures
    for stem in set(re.findall(r"\(bench/results/([^)]+)\.md\)", block)):
        assert (REPO / "bench" / "results" / f"{stem}.md").exists() and (REPO / "bench" / "results" / f"{stem}.json").exists()


def test_a_changed_result_file_changes_the_page(tmp_path):
    results = tmp_path / "results"
    shutil.copytree(REPO / "bench" / "results", results)
    before = headline.render(results)
    decision = results / "2026-12-02-decision.json"
    data = json.loads(decision.read_text())
    data["rows"][0]["p50_us"] = 123456.0
    decision.write_text(json.dumps(data))
    after = headline.render(results)
    assert after != before and "123456.0" in after and "123456.0" not in before
