"""Every ```python block in README.md and docs/*.md runs as written; docs/jax.md's where only the extra it tells users
to install is (`make test` runs the tests marked jax_alone in its JAX-only environment)."""

import itertools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = [(page, i, code) for page in PAGES
          for i, code in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), re.DOTALL))]


JAX_LOOP = next(block for block in BLOCKS if block[0].name == "jax.md" and "nnx.Optimizer" in block[2])
SHARDED = next(block for block in BLOCKS if block[0].name == "distributed.md")  # a torchrun script
# docs/jax.md's blocks run where only the extra it tells users to install is: `make test`'s JAX-only environment
IN_PROCESS = [pytest.param(page, index, code, id=f"{page.name}#{index}",
                           marks=[pytest.mark.jax_alone] if page.name == "jax.md" else [])
              for page, index, code in BLOCKS if (page, index, code) not in (JAX_LOOP, SHARDED)]


@pytest.mark.parametrize("page, index, code", IN_PROCESS)
def test_doc_example_runs(page, index, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(code, f"{page.name}[{index}]", "exec"), {"__name__": "__doc_example__"})


@pytest.mark.jax_alone
@pytest.mark.parametrize("xla_flags", ["--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1",
                                       "--xla_force_host_platform_device_count=2",
                                       "--xla_force_host_platform_device_count=4"],
                         ids=["one-thread", "two-devices", "four-devices"])
@pytest.mark.slow
def test_the_docs_jax_training_loop_holds_on_any_thread_and_device_count(xla_flags, tmp_path):
    """docs/jax.md's Flax NNX loop compares two implementations after 16 optimizer steps; with a fixed 1e-5 its check
    failed on a machine whose threads summed in another order. It runs as written in a fresh process (XLA reads its
    flags once), on one thread and on two and four host devices."""
    page, index, code = JAX_LOOP
    script = tmp_path / "loop.py"
    script.write_text(code)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env=os.environ | {"XLA_FLAGS": xla_flags, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, f"{page.name}[{index}] with XLA_FLAGS={xla_flags}:\n{done.stderr[-3000:]}"
    assert "mean reward per rollout" in done.stdout


@pytest.mark.distributed
@pytest.mark.parametrize("processes", [2, 4])
def test_the_docs_sharded_head_script_runs_under_torchrun(processes, tmp_path):
    """docs/distributed.md's script, launched as it says: each rank's loss and gradients equal the whole weight's."""
    page, index, code = SHARDED
    script = tmp_path / "script.py"
    script.write_text(code)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                           str(processes), str(script)], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, f"{page.name}[{index}] on {processes} processes:\n{done.stderr[-3000:]}"


def test_every_usage_page_has_an_example():
    usage_pages = {p.name for p in PAGES} - {"BENCHMARKS.md"}  # measurements, with their shell commands
    assert {p.name for p, _, _ in BLOCKS} >= usage_pages


def _grade_defaults_table(header_start: str = "| field | default") -> dict[str, str]:
    """The defaults table of docs/grade.md whose header starts with ``header_start``: field -> its default cell."""
    lines = (ROOT / "docs" / "grade.md").read_text().splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = {}
    for line in lines[header + 2:]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        rows[cells[0].strip("`")] = cells[1]
    return rows


def test_grade_doc_defaults_are_the_librarys_and_the_commands():
    """The table in docs/grade.md shows GradeConfig's defaults, which are what `logitless grade` runs with
    (GradeRunConfig, whose fields are GradeConfig's and the run's) and what its --help prints."""
    import ast
    import dataclasses

    from logitless.grade import GradeConfig
    from logitless.recipes.grade_options import GradeRunConfig

    command = dataclasses.asdict(GradeRunConfig())
    library = dataclasses.asdict(GradeConfig())
    table = _grade_defaults_table()
    assert set(table) == set(library), "docs/grade.md: the table's fields are GradeConfig's"
    for name, cell in table.items():
        value = ast.literal_eval(cell.strip("`"))
        assert value == library[name] == command[name] and type(value) is type(library[name]), \
            (f"docs/grade.md: {name} shows {cell}; GradeConfig's default is {library[name]!r}, "
             f"the command's {command[name]!r}")


def test_grade_doc_shows_the_commands_own_defaults_and_its_help_the_same():
    """docs/grade.md's second table holds every option of `logitless grade` that is neither GradeConfig's nor run
    control, with the command's default; --help shows the defaults of both tables."""
    import ast
    import dataclasses

    from logitless.cli import build_parser
    from logitless.grade import GradeConfig
    from logitless.recipes.config import RecipeConfig
    from logitless.recipes.grade_options import HELP, GradeRunConfig

    def names(config_class):
        return {field.name for field in dataclasses.fields(config_class)}

    own = {name: ast.literal_eval(cell.strip("`"))
           for name, cell in _grade_defaults_table("| option | default").items()}
    assert set(own) == names(GradeRunConfig) - names(GradeConfig) - names(RecipeConfig) | {"model"}
    assert own == {name: getattr(GradeRunConfig(), name) for name in own}
    library = {name: ast.literal_eval(cell.strip("`")) for name, cell in _grade_defaults_table().items()}
    grade = build_parser()._subparsers._group_actions[0].choices["grade"]
    helps = {action.dest: action.help for action in grade._actions}
    shown = [name for name in {**library, **own} if name in HELP and "(default" not in HELP[name]]  # not by hand
    assert len(shown) >= 20
    for name in shown:
        value = {**library, **own}[name]
        def typed(v):  # how a user types it: quoted where leading or trailing whitespace is part of it
            return repr(v) if isinstance(v, str) and v != v.strip() else str(v)

        text = " ".join(map(typed, value)) if isinstance(value, tuple) else typed(value)
        assert helps[name].endswith(f"(default: {text})"), f"--help of {name}: {helps[name]!r}; docs: {value!r}"


HISTORY = re.compile(r"\bseeds? 00\d\b|\bseed's (shape|design|example)|\bissue \d+\b|DESIGN\.md|\bno longer\b"
                     r"|(?<!\bis )(?<!\bare )(?<!\bbe )(?<!\bas )(?<!\bwas )(?<!\bbeen )\bused to\b", re.IGNORECASE)


def test_docs_code_and_tests_speak_of_what_is_not_of_its_history():
    """No project history (an issue's or a seed document's number, what the code "used to" do) and no pointer to a
    file outside the repository: in the docs, the code and the tests (this file holds the patterns)."""
    files = [*PAGES, ROOT / "ARCHITECTURE.md", ROOT / "bench" / "gpu.sh",
             *sorted((ROOT / "src" / "logitless").rglob("*.py")),
             *sorted((ROOT / "configs").glob("*.yaml")),
             *(path for path in sorted((ROOT / "tests").rglob("*.py")) if path.name != "test_docs.py")]
    history = HISTORY
    found = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}" for path in files
             for number, line in enumerate(path.read_text().splitlines(), 1) if history.search(line)]
    assert found == []


def test_the_history_guard_reads_history_and_not_usage():
    for text in ("it used to be refused", "the code before issue 9", "seed 004's rule", "no longer NaN"):
        assert HISTORY.search(text), text
    for text in ("the mask is used to pick rows", "as used to build the records", "seed 0 gives"):
        assert not HISTORY.search(text), text


def test_the_readme_calls_untested_what_docs_trl_marks_untested():
    """The README said reward functions read `completion_logits` "whichever way the completions were generated
    (transformers, vLLM, ...)" while docs/trl.md's table marks vLLM generation untested end to end: a README sentence
    naming a setup of that table whose scoring is untested says so."""
    lines = (ROOT / "docs" / "trl.md").read_text().splitlines()
    header = lines.index("| setup | scoring | `completion_logits` | checked by |")
    table = itertools.takewhile(lambda line: line.startswith("|"), lines[header + 2:])
    rows = [line.strip("|").split(" | ") for line in table]
    untested = " ".join(setup for setup, scoring, *_ in rows if scoring.strip().startswith("untested"))
    sentences = re.split(r"(?<=\.)\s", " ".join((ROOT / "README.md").read_text().split()))
    for setup in ("vLLM", "vision-language", "continuous batching"):
        assert setup in untested, f"docs/trl.md no longer marks {setup} untested: update this test's list"
        claims = [sentence for sentence in sentences if setup in sentence and "untested" not in sentence]
        assert claims == [], setup


def test_every_test_the_docs_name_is_in_the_suite():
    """A doc that names a test names one the suite has: a test file (``test_cli``), a test function, or a test
    function's first words ending in ``_`` (``test_one_step_...``): a renamed or merged test leaves no pointer to
    nothing."""
    files = {path.stem for path in (ROOT / "tests").rglob("test_*.py")}
    functions = {name for path in (ROOT / "tests").rglob("*.py")
                 for name in re.findall(r"^\s*def (test_\w+)", path.read_text(), re.MULTILINE)}
    missing = [f"{path.relative_to(ROOT)}:{number}: {name}"
               for path in [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").glob("*.md"))]
               for number, line in enumerate(path.read_text().splitlines(), 1)
               for name in re.findall(r"\b(test_\w+)", line)
               if name not in files | functions
               and not (name.endswith("_") and any(function.startswith(name) for function in functions))]
    assert missing == []
