"""The library stays apart from the programs built on it: nothing in it imports recipes/, bench/, the demo or the
CLI. The recipes and the benchmarks never import each other, nor the demo, which uses both, nor the CLI. Since the
library imports no program, no program reaches another through it: the direct imports are the whole story."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "logitless"
PROGRAMS = {"recipes", "bench", "demo", "demo_options", "cli", "__main__"}  # __main__: `python -m logitless`, the CLI


def _imported(path: Path, root: Path = PACKAGE) -> set[str]:
    """The parts of logitless (in ``root``) that the module at ``path`` imports anywhere in it (at the top or
    inside a function), by their name below logitless: {"recipes", "multichoice", ...}."""
    package = path.relative_to(root.parent).parent.parts  # ("logitless", "bench") for logitless/bench/x.py
    modules = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules += [alias.name.split(".") for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = [*package[:len(package) - node.level + 1]] if node.level else []
            module = base + (node.module.split(".") if node.module else [])
            modules += [module + [alias.name] for alias in node.names]  # `from logitless import bench` names bench
    return {module[1] for module in modules if module[0] == "logitless" and len(module) > 1}


def _offenders(files, forbidden: set[str]) -> list[str]:
    return [f"{path.relative_to(PACKAGE)} imports logitless.{name}" for path in sorted(files)
            for name in sorted(_imported(path) & forbidden)]


def test_the_recipes_and_the_benchmarks_import_neither_each_other_nor_the_programs_above_them():
    recipes, bench = list((PACKAGE / "recipes").rglob("*.py")), list((PACKAGE / "bench").rglob("*.py"))
    assert len(recipes) > 3 and len(bench) > 3
    assert _offenders(recipes, PROGRAMS - {"recipes"}) == []
    assert _offenders(bench, PROGRAMS - {"bench"}) == []


def test_the_library_imports_no_program():
    shared = {"plots", "interrupts"}  # what the programs share: the figures, and the words an interrupt ends with
    library = [path for path in PACKAGE.rglob("*.py") if path.relative_to(PACKAGE).parts[0].removesuffix(".py")
               not in PROGRAMS | shared]
    assert len(library) > 30 and _offenders(library, PROGRAMS | shared) == []


def _third_party(path: Path) -> set[str]:
    """The top-level names of the modules outside logitless that ``path`` imports anywhere in it."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names.add(node.module.split(".")[0])
    return names - {"logitless"}


def test_the_fused_ops_need_neither_transformers_nor_trl():
    kernels = [*(PACKAGE / "ops").rglob("*.py"), *(PACKAGE / "jax").rglob("*.py")]
    assert len(kernels) > 20
    assert [f"{path.relative_to(PACKAGE)} imports {name}" for path in sorted(kernels)
            for name in sorted(_third_party(path) & {"transformers", "trl", "peft"})] == []


def test_the_oracles_import_nothing_of_the_ops_they_check():
    """An oracle that shared code with its op (the head's logits, the soft cap, the GRPO options) would share its
    bugs: the PyTorch oracles import of logitless only the argument checks, the plain-JAX ones nothing."""
    assert _imported(PACKAGE / "ops" / "reference.py") <= {"_checks"}
    assert _imported(PACKAGE / "jax" / "reference.py") == set()


def _bench_modules_imported(path: Path) -> set[str]:
    """The modules of logitless.bench that the module at ``path`` imports anywhere in it, by name: {"options", ...}."""
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            module = "logitless.bench" + (f".{node.module}" if node.module else "") if node.level else node.module
            modules |= {module} | {f"{module}.{alias.name}" for alias in node.names}
    return {name.split(".")[2] for name in modules if name.startswith("logitless.bench.")
            and (PACKAGE / "bench" / f"{name.split('.')[2]}.py").exists()}


def test_the_benchmarks_import_each_other_one_way():
    """No circle of imports among bench/'s modules: what two of them share lies in a module below both."""
    graph = {path.stem: _bench_modules_imported(path) - {path.stem} for path in (PACKAGE / "bench").glob("*.py")}
    assert graph["lmhead_steps"] and graph["jax"]  # the imports are read

    def circle_from(module, path):
        if module in path:
            return path[path.index(module):] + [module]
        return next(filter(None, (circle_from(imported, path + [module]) for imported in sorted(graph[module]))), None)

    assert [circle for circle in (circle_from(module, []) for module in sorted(graph)) if circle] == []


def test_imports_are_found_in_every_spelling(tmp_path):
    """What the checks above read: absolute and relative imports, of a module or from a package, anywhere."""
    spellings = {"a.py": "import logitless.recipes.sft", "b.py": "from logitless import bench",
                 "c.py": "def f():\n    from logitless.demo import run", "d.py": "from ..cli import main",
                 "e.py": "from . import worker", "f.py": "import torch\nfrom logitless.ops import fused"}
    folder = tmp_path / "logitless" / "bench"
    folder.mkdir(parents=True)
    found = {}
    for name, code in spellings.items():
        (folder / name).write_text(code + "\n")
        found[name] = _imported(folder / name, tmp_path / "logitless")
    assert found == {"a.py": {"recipes"}, "b.py": {"bench"}, "c.py": {"demo"}, "d.py": {"cli"}, "e.py": {"bench"},
                     "f.py": {"ops"}}


def _defined(path: Path) -> set[str]:
    """The public functions and classes defined at the top of the module at ``path``."""
    return {node.name for node in ast.parse(path.read_text()).body
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_")}


def test_the_tests_take_library_logic_from_the_library_not_from_the_benchmarks():
    """A test may test a benchmark, but what it uses of one may not be a private helper: logic a test needs
    (a reference gradient, say) belongs to the library."""
    offenders = []
    for path in sorted((PACKAGE.parents[1] / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("logitless.bench"):
                offenders += [f"{path.name}: {node.module}.{alias.name}" for alias in node.names
                              if alias.name.startswith("_")]
    assert offenders == []


def test_the_multichoice_modules_and_a_grade_methods_run_do_one_job_each():
    jobs = {"letters.py": {"check_choices", "check_marker", "check_answer", "token_id_list", "choice_token_ids",
                           "letter_logsumexp"},
            "answer.py": {"find_answer_position", "extract_answer_probability_from_logits"},
            "recompute.py": {"answer_probability_by_recomputing"}, "strip.py": {"strip_final_answer"},
            "judge.py": {"MultichoiceJudge"}, "reward.py": {"multichoice_judge_reward"}}
    assert {name: _defined(PACKAGE / "multichoice" / name) for name in jobs} == jobs
    assert _defined(PACKAGE / "recipes" / "grade_method.py") >= {"build_trainer", "resume_trainer", "train_step",
                                                                  "train_steps", "save_method", "plot_method",
                                                                  "run_method"}
