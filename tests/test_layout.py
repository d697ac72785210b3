"""The library stays apart from the programs built on it: nothing in it imports recipes/, bench/, the demo or the
CLI; the demo sits above the recipes and the benchmarks, and the recipes never import a benchmark."""

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "logitless"
PROGRAMS = ("recipes", "bench", "demo.py", "cli.py", "__main__.py")  # __main__.py: `python -m logitless`, the CLI


def test_the_recipes_and_the_benchmarks_do_not_import_the_demo_which_uses_both():
    offenders = [f"{path.relative_to(PACKAGE)}: {line.strip()}" for folder in ("recipes", "bench")
                 for path in (PACKAGE / folder).rglob("*.py") for line in path.read_text().splitlines()
                 if re.match(r"\s*(from|import) logitless(\.demo\b| import demo\b)", line)
                 or (folder == "recipes" and re.match(r"\s*(from|import) logitless\.bench\b", line))]
    assert offenders == []


def test_the_library_imports_no_program():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.relative_to(PACKAGE).parts[0] in PROGRAMS:
            continue
        for line in path.read_text().splitlines():
            if re.match(r"\s*(from|import) logitless\.(recipes|bench|demo|cli)\b", line):
                offenders.append(f"{path.relative_to(PACKAGE)}: {line.strip()}")
    assert offenders == []
