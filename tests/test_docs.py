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


def _grade_defaults_table() -> dict[str, tuple[str, str]]:
    """docs/grade.md's defaults table: field -> (`logitless grade` default, library `GradeConfig` default)."""
    lines = (ROOT / "docs" / "grade.md").read_text().splitlines()
    header = next(i for i, line in enumerate(lines)
                  if line.startswith("| field |") and "`logitless grade` default" in line)
    columns = [cell.strip() for cell in lines[header].strip("|").split("|")]
    assert columns[1:3] == ["`logitless grade` default", "library `GradeConfig` default"], columns
    rows = {}
    for line in lines[header + 2:]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        rows[cells[0].strip("`")] = (cells[1], cells[2])
    return rows


def _cell_value(cell: str):
    import ast

    return ast.literal_eval(cell.strip("`"))


def test_grade_doc_defaults_are_the_commands_and_the_librarys():
    """The table in docs/grade.md shows what `logitless grade` runs with (GradeRunConfig, its `.grade`
    flattened, the run's own fields winning) and, separately, the library dataclass GradeConfig's defaults."""
    import dataclasses

    from logitless.grade import GradeConfig
    from logitless.recipes.grade import GradeRunConfig

    run = GradeRunConfig()
    command = {**dataclasses.asdict(run.grade),
               **{f.name: getattr(run, f.name) for f in dataclasses.fields(run) if f.name != "grade"}}
    library = dataclasses.asdict(GradeConfig())
    table = _grade_defaults_table()
    assert set(table) == set(library), "docs/grade.md: the table's fields are GradeConfig's"
    for name, (command_cell, library_cell) in table.items():
        for cell, expected, where in ((command_cell, command[name], "logitless grade"),
                                      (library_cell, library[name], "GradeConfig")):
            value = _cell_value(cell)
            assert value == expected and type(value) is type(expected), \
                f"docs/grade.md: {name} shows {cell} as {where}'s default, which is {expected!r}"


def test_user_docs_and_docstrings_speak_to_users():
    """No project history ("seed 002's design", "issue 10") and no pointer to a file outside the repository."""
    history = re.compile(r"\bseeds? 00\d\b|\bseed's (shape|design|example)|\bissue \d+\b|DESIGN\.md", re.IGNORECASE)
    files = [*PAGES, ROOT / "ARCHITECTURE.md", *sorted((ROOT / "src" / "logitless").rglob("*.py")),
             *sorted((ROOT / "configs").glob("*.yaml"))]
    found = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}" for path in files
             for number, line in enumerate(path.read_text().splitlines(), 1) if history.search(line)]
    assert found == []
