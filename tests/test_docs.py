"""The documents stay a map: a short README whose headline numbers are the generated results
table's, the quick-start markers other tools edit between, and every docs/ page on the mkdocs site
(scripts/docs.sh builds it strictly; CI runs that)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from longft.metrics import results_table

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def test_readme_is_short():
    assert len(README.read_text().splitlines()) <= 250, "README.md: keep it a map; move detail to docs/"


def test_readme_keeps_the_quickstart_markers_once_each():
    text = README.read_text()
    for marker in ("<!-- quickstart-own-data -->", "<!-- /quickstart-own-data -->"):
        assert text.count(marker) == 1, marker
    assert text.index("<!-- quickstart-own-data -->") < text.index("<!-- /quickstart-own-data -->")


def test_readme_headline_numbers_are_in_the_generated_table():
    text = README.read_text()
    table = text[text.index("## Results"):text.index("## Where to go next")]
    generated = results_table.render(ROOT / "bench" / "results")
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert rows, "README.md has no results rows"
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        for cell in cells[1:4]:  # longft tok/s, VRAM, host RSS
            assert re.fullmatch(r"[\d,.]+", cell) and f" {cell} |" in generated, \
                f"README.md's {cell!r} ({cells[0]}) is not in `longft report --benchmarks bench/results`"


def test_every_docs_page_is_on_the_site():
    cfg = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert cfg["strict"] is True
    in_nav = {next(iter(item.values())) for item in cfg["nav"]}
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert pages == in_nav, f"docs/ pages and mkdocs.yml's nav differ: {sorted(pages ^ in_nav)}"
