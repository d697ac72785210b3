"""The library stays apart from the programs built on it: nothing in it imports recipes/, bench/ or the CLI."""

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "logitless"
PROGRAMS = ("recipes", "bench", "cli.py", "__main__.py")  # __main__.py: `python -m logitless`, the CLI


def test_the_library_imports_no_program():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.relative_to(PACKAGE).parts[0] in PROGRAMS:
            continue
        for line in path.read_text().splitlines():
            if re.match(r"\s*(from|import) logitless\.(recipes|bench|cli)\b", line):
                offenders.append(f"{path.relative_to(PACKAGE)}: {line.strip()}")
    assert offenders == []
