"""Every ```python block in README.md and docs/*.md runs as written."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = [(page, i, code) for page in PAGES
          for i, code in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), re.DOTALL))]


@pytest.mark.parametrize("page, index, code", BLOCKS, ids=[f"{p.name}#{i}" for p, i, _ in BLOCKS])
def test_doc_example_runs(page, index, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(code, f"{page.name}[{index}]", "exec"), {"__name__": "__doc_example__"})


def test_every_usage_page_has_an_example():
    usage_pages = {p.name for p in PAGES} - {"BENCHMARKS.md"}  # measurements, with their shell commands
    assert {p.name for p, _, _ in BLOCKS} >= usage_pages
