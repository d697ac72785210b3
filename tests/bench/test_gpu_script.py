"""bench/gpu.sh, the one script a GPU machine runs, checked here where there is none: it is valid bash, every
logitless command in it parses with the command line's own parser, every file it writes goes to its scratch
directory (which becomes gpu.tar), and the tests it runs exist. A typo found only on the GPU would cost a lease."""

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from logitless.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu.sh"


def _steps() -> dict[str, list[str]]:
    """Step name -> its command's words, with $SHAPE, $PYTHON and $WORK written out."""
    text = SCRIPT.read_text().replace("\\\n", " ")
    shape = re.search(r'^SHAPE="([^"]*)"', text, re.MULTILINE).group(1)
    steps = {}
    for line in text.splitlines():
        if line.startswith("step "):
            line = line.replace("$SHAPE", shape).replace('"$PYTHON"', "python").replace('"$WORK', '"/scratch')
            name, _limit, *command = shlex.split(line)[1:]
            steps[name] = command[2:] if command[0] == "env" else command  # env NAME=VALUE COMMAND...
    return steps


def test_is_valid_bash():
    checked = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr


def test_runs_every_benchmark_the_gpu_tables_need():
    assert {"cuda_tests", "lmhead_cuda", "lmhead_cuda_v248320", "lmhead_kl_cuda", "lmhead_curve_cuda",
            "lmhead_one_pass_cuda", "grpo_cuda", "grade_cuda", "jax_cuda"} <= set(_steps())


@pytest.mark.parametrize("name", [name for name, command in _steps().items() if command[:2] == ["python", "-m"]
                                  and command[2] == "logitless"])
def test_each_logitless_command_parses_and_writes_to_the_scratch_directory(name):
    argv = _steps()[name][3:]
    args = build_parser().parse_args(argv)  # a misspelled option ends the test with argparse's error
    outputs = [getattr(args, option) for option in ("json", "plot") if getattr(args, option, None)]
    assert outputs and all(Path(path).parent == Path("/scratch") and Path(path).stem == name for path in outputs)
    if getattr(args, "device", None) is not None:
        assert args.device == "cuda"


def test_the_tests_it_runs_exist():
    command = _steps()["cuda_tests"]
    files = [word for word in command if word.startswith("tests/")]
    assert files and all((ROOT / file).is_file() for file in files)
