"""The library stays apart from the programs built on it: nothing in it imports recipes/, bench/, the demo or the
CLI. The recipes and the benchmarks never import each other, nor the demo, which uses both, nor the CLI. Since the
library imports no program, no program reaches another through it: the direct imports are the whole story. No
modules of the package import each other in a circle."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "logitless"
PROGRAMS = {"recipes", "bench", "demo", "demo_options", "cli", "__main__"}  # __main__: `python -m logitless`, the CLI


def _import_names(path: Path, root: Path = PACKAGE) -> list[list[str]]:
    """Every name the module at ``path`` imports anywhere in it (at the top, inside a function, under ``if
    TYPE_CHECKING:``), relative imports resolved, as parts: ``from logitless.ops import fused`` gives
    ["logitless", "ops", "fused"], ``from .head import LinearHead`` in ops/ ["logitless", "ops", "head",
    "LinearHead"]."""
    package = path.relative_to(root.parent).parent.parts  # ("logitless", "bench") for logitless/bench/x.py
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name.split(".") for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = [*package[:len(package) - node.level + 1]] if node.level else []
            module = base + (node.module.split(".") if node.module else [])
            names += [module + [alias.name] for alias in node.names]  # `from logitless import bench` names bench
    return names


def _imported(path: Path, root: Path = PACKAGE) -> set[str]:
    """The parts of logitless (in ``root``) that the module at ``path`` imports anywhere in it (at the top or
    inside a function), by their name below logitless: {"recipes", "multichoice", ...}."""
    return {name[1] for name in _import_names(path, root) if name[0] == "logitless" and len(name) > 1}


def _module_names(root: Path = PACKAGE) -> dict[str, Path]:
    """Every module of the package in ``root`` by its dotted name: {"logitless": .../__init__.py, "logitless.ops.head":
    .../ops/head.py, ...}."""
    names = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _modules_imported(path: Path, modules: dict[str, Path], root: Path = PACKAGE) -> set[str]:
    """The ``modules`` of the package in ``root`` that the module at ``path`` imports anywhere in it, by dotted
    name: for each name imported, the longest of its prefixes that is a module (``from logitless.ops import head``
    imports logitless.ops.head, ``from logitless.ops.head import LinearHead`` too)."""
    found = set()
    for name in _import_names(path, root):
        prefixes = (".".join(name[:end]) for end in range(len(name), 0, -1))
        found |= {next((prefix for prefix in prefixes if prefix in modules), None)} - {None}
    return found


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


def test_the_jax_ops_and_the_pytorch_ops_import_nothing_of_each_other():
    """`jax/` and `ops/` lie side by side: what both use (the settings, the argument checks) is below them both."""
    jax_ops, torch_ops = list((PACKAGE / "jax").rglob("*.py")), list((PACKAGE / "ops").rglob("*.py"))
    assert len(jax_ops) > 10 and len(torch_ops) > 10
    assert _offenders(jax_ops, {"ops"}) + _offenders(torch_ops, {"jax"}) == []


def test_the_oracles_import_nothing_of_the_ops_they_check():
    """An oracle that shared code with its op (the head's logits, the soft cap, the GRPO options) would share its
    bugs: the PyTorch oracles import of logitless only the argument checks, the plain-JAX ones nothing."""
    assert _imported(PACKAGE / "ops" / "reference.py") <= {"_checks"}
    assert _imported(PACKAGE / "jax" / "reference.py") == set()


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The circles of ``graph`` (module -> the modules it imports): each group of modules that reach each other
    through their imports, sorted."""
    reach = {}
    for module in graph:
        seen, todo = set(), list(graph[module])
        while todo:
            imported = todo.pop()
            if imported not in seen:
                seen.add(imported)
                todo += graph[imported]
        reach[module] = seen
    return sorted({tuple(sorted(other for other in reach[module] if module in reach[other]))
                   for module in graph if module in reach[module]})


def test_the_library_and_its_programs_import_each_other_one_way():
    """No circle of imports among the package's modules, counting every import (at the top, inside a function,
    for type checking only): what two modules share lies in a module below both."""
    modules = _module_names()
    graph = {name: _modules_imported(path, modules) - {name} for name, path in modules.items()}
    assert "logitless.ops.head" in graph["logitless.ops.fused"] and "logitless.bench.options" in graph[
        "logitless.bench.jax"]  # the imports are read
    assert _circles(graph) == []


def test_a_circle_is_found_through_any_number_of_modules():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"f"}, "f": {"e"}, "g": {"a"}}
    assert _circles(graph) == [("a", "b", "c"), ("e", "f")]


def test_imports_are_found_in_every_spelling(tmp_path):
    """What the checks above read: absolute and relative imports, of a module or from a package, anywhere, for type
    checking too."""
    spellings = {"a.py": "import logitless.recipes.sft", "b.py": "from logitless import bench",
                 "c.py": "def f():\n    from logitless.demo import run", "d.py": "from ..cli import main",
                 "e.py": "from . import worker", "f.py": "import torch\nfrom logitless.ops import fused",
                 "g.py": "if TYPE_CHECKING:\n    from ..ops.head import LinearHead"}
    root = tmp_path / "logitless"
    for module in ("__init__", "cli", "demo", "recipes/__init__", "recipes/sft", "bench/__init__", "bench/worker",
                   "ops/__init__", "ops/fused", "ops/head"):
        (root / f"{module}.py").parent.mkdir(parents=True, exist_ok=True)
        (root / f"{module}.py").write_text("")
    imported, modules_imported = {}, {}
    for name, code in spellings.items():
        (root / "bench" / name).write_text(code + "\n")
        imported[name] = _imported(root / "bench" / name, root)
    modules = _module_names(root)
    for name in spellings:
        modules_imported[name] = _modules_imported(root / "bench" / name, modules, root)
    assert imported == {"a.py": {"recipes"}, "b.py": {"bench"}, "c.py": {"demo"}, "d.py": {"cli"}, "e.py": {"bench"},
                        "f.py": {"ops"}, "g.py": {"ops"}}
    assert modules_imported == {"a.py": {"logitless.recipes.sft"}, "b.py": {"logitless.bench"},
                                "c.py": {"logitless.demo"}, "d.py": {"logitless.cli"},
                                "e.py": {"logitless.bench.worker"},
                                "f.py": {"logitless.ops.fused"}, "g.py": {"logitless.ops.head"}}


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
            "judge.py": {"MultichoiceJudge"}, "reward.py": {"multichoice_judge_reward"},
            "accuracy.py": {"sampled_accuracy"}}
    assert {name: _defined(PACKAGE / "multichoice" / name) for name in jobs} == jobs
    assert _defined(PACKAGE / "recipes" / "grade_method.py") >= {"build_trainer", "resume_trainer", "train_step",
                                                                  "train_steps", "save_method", "plot_method",
                                                                  "run_method"}
