"""ARCHITECTURE.md is true to the code: every module it names exists, and every module is named."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "logitless"


def _named() -> set[str]:
    """The modules ARCHITECTURE.md names: every `path.py` in backticks, a path below src/logitless/ (tests/ and
    files outside the package left out)."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    return {name for name in re.findall(r"`([\w/]+\.py)`", text) if not name.startswith("tests/")}


def test_every_module_named_exists():
    assert sorted(name for name in _named() if not (PACKAGE / name).is_file()) == []


def test_every_module_is_named():
    modules = {str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
               if path.name != "__init__.py" or path.parent == PACKAGE}
    assert sorted(modules - _named()) == []


def test_the_names_are_paths_below_the_package():
    """A bare file name (`grpo_options.py`) would be ambiguous between packages: every name has its directory."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    bare = {name for name in re.findall(r"`(\w+\.py)`", text) if not (PACKAGE / name).is_file()}
    assert bare == set()
