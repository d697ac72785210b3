"""logitless for a JAX user: ``pip install 'logitless[jax]'`` brings no PyTorch, ``import logitless.jax`` imports
none, and a command or a name that needs PyTorch says how to get it in one line. `make test` runs this file (with the
JAX tests and docs/jax.md's code) in an environment that has only that install and the Flax and optax of the page's
training loop (``pip install 'logitless[flax]'``), and here, where PyTorch is installed but kept from loading."""

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from logitless._lazy import EXTRAS

pytestmark = pytest.mark.jax_alone  # `make test` runs this file's tests in its JAX-only environment

ROOT = Path(__file__).resolve().parents[2]
NOT_FOR_JAX = ("torch", "transformers", "matplotlib", "tiktoken", "safetensors", "trl")
# run first in a child interpreter: PyTorch, transformers and matplotlib cannot be imported, as where they are not
# installed
WITHOUT_TORCH = "import sys\nfor name in ('torch', 'transformers', 'matplotlib'):\n    sys.modules[name] = None\n"


def _python(code: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=cwd)


def test_import_logitless_jax_imports_no_torch_and_runs_every_op():
    result = _python(WITHOUT_TORCH + """
import jax.numpy as jnp
import logitless.jax as lj
hidden, weight, ids = jnp.ones((2, 3, 4)), jnp.ones((5, 4)), jnp.zeros((2, 3), int)
lj.fused_linear_logprobs(hidden, weight, ids, return_token_entropy=True)
lj.fused_linear_cross_entropy(hidden, weight, ids)
lj.fused_grpo_loss(hidden, weight, ids, jnp.ones((2, 3)), jnp.ones(2), beta=0.1, ref_log_probs=jnp.zeros((2, 3)))
lj.fused_linear_kl(hidden, weight, hidden, weight)
lj.fused_linear_jsd(hidden, weight, hidden, weight)
print(sorted(name for name, module in sys.modules.items() if module is not None and name.partition('.')[0] in %r))
""" % (NOT_FOR_JAX,))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_the_jax_extras_and_the_core_install_bring_no_torch():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    for requirement in project["dependencies"] + extras["jax"] + extras["flax"]:
        if requirement == "logitless[jax]":  # the flax extra is the jax extra and more
            continue
        name = requirement.split(">")[0].split("=")[0].split("<")[0].split("[")[0].strip()
        assert name not in ("torch", "transformers", "matplotlib", "logitless"), requirement


def test_the_jax_only_environment_installs_the_extra_docs_jax_tells_users_to():
    """`make test` runs docs/jax.md's code (tests/project/test_docs.py) in its JAX-only environment: that environment
    installs the extra the page's training loop section says to install, and the extra brings what the page imports."""
    makefile = (ROOT / "Makefile").read_text()
    extra = re.search(r"^JAX_EXTRA := (\S+)$", makefile, re.MULTILINE).group(1)
    assert '".[$(JAX_EXTRA)]"' in makefile
    page = (ROOT / "docs" / "jax.md").read_text()
    loop = page[page.index("## A training loop"):page.index("```python", page.index("## A training loop"))]
    assert f"pip install 'logitless[{extra}]'" in " ".join(loop.split())
    requirements = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"][extra]
    assert {"logitless[jax]", "flax", "optax"} <= {re.split(r"[<>=]", requirement)[0] for requirement in requirements}


def test_every_extra_the_command_line_names_exists_and_installs_the_package():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for module, extra in EXTRAS.items():
        requirements = " ".join(extras[extra]).replace("-", "_")
        assert module in requirements, (module, extra)


@pytest.mark.parametrize("argv", [["demo"], ["sft", "--steps", "1"], ["bench", "lmhead"]])
def test_a_command_that_needs_pytorch_says_how_to_install_it_in_one_line(argv, tmp_path):
    result = _python(WITHOUT_TORCH + f"from logitless.cli import main\nsys.exit(main({argv!r}))", cwd=tmp_path)
    assert result.returncode == 1
    assert list(tmp_path.iterdir()) == []  # said before the command wrote anything
    command = " ".join(["logitless", *argv[:2 if argv[0] == "bench" else 1]])
    assert result.stderr.splitlines() == [
        f"{command}: needs torch, which is not installed: pip install 'logitless[torch]'"], result.stderr


@pytest.mark.parametrize("package, name", [("logitless", "get_response_log_probs"),
                                           ("logitless.ops", "fused_linear_logprobs")])
def test_a_name_that_needs_pytorch_says_how_to_install_it_in_one_line(package, name):
    result = _python(WITHOUT_TORCH + f"from {package} import {name}")
    assert result.returncode == 1
    assert result.stderr.splitlines()[-1] == (f"ModuleNotFoundError: {package}.{name} needs torch, which is not "
                                              "installed: pip install 'logitless[torch]'"), result.stderr
    assert "No module named" not in result.stderr and "During handling" not in result.stderr, result.stderr


def test_help_answers_without_pytorch():
    result = _python(WITHOUT_TORCH + "from logitless.cli import main\nsys.exit(main(['bench', 'jax', '--help']))")
    assert result.returncode == 0, result.stderr
    assert "--compile-shape" in result.stdout


def test_bench_jax_runs_without_pytorch_and_a_plot_says_how_to_get_matplotlib(tmp_path):
    argv = ["bench", "jax", "--loss", "ce", "-B", "1", "-T", "8", "-H", "8", "-V", "257", "--compile-shape", "none",
            "--repeats", "1", "--tokamax", "off", "--json", str(tmp_path / "r.json")]
    result = _python(WITHOUT_TORCH + f"from logitless.cli import main\nsys.exit(main({argv!r}))")
    assert result.returncode == 0, result.stderr
    assert "logitless" in json.loads((tmp_path / "r.json").read_text())["results"]["run"]["ce"]
    result = _python(WITHOUT_TORCH + f"from logitless.cli import main\nsys.exit(main({argv + ['--plot', 'p.png']!r}))",
                     cwd=tmp_path)
    assert result.returncode == 1 and not (tmp_path / "p.png").exists()
    assert result.stderr.splitlines() == [
        "logitless bench jax: --plot: needs matplotlib, which is not installed: pip install 'logitless[plots]'"]


def test_the_files_marked_jax_alone_are_the_ones_make_test_runs_without_pytorch():
    """`make test` runs the jax_alone tests in the JAX-only environment (the Makefile's JAX_TESTS) and leaves them out
    of the run beside PyTorch: a file marked but not listed, or listed but not marked, would lose its tests."""
    makefile = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    listed = next(line for line in makefile.splitlines() if line.startswith("JAX_TESTS :="))
    marked = {str(path.relative_to(ROOT)) for path in (ROOT / "tests").rglob("test_*.py")
              if "pytest.mark.jax_alone" in path.read_text()}
    assert set(listed.partition(":=")[2].split()) == marked and len(marked) >= 5
