"""ARCHITECTURE.md is true to the code: every module it names exists, and every module is named."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
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


def _documented_trace(title: str = "One call, file by file") -> list[str]:
    """The files of ARCHITECTURE.md's section ``title`` (each numbered line's files in backticks), in its order."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    section = text[text.index(f"## {title}"):]
    section = section[:section.index("\n## ", 4)] if "\n## " in section[4:] else section
    lines = re.findall(r"^\d+\. (.*)$", section, re.MULTILINE)
    return [name for line in lines for name in re.findall(r"`([\w/]+\.py)`", line.split(":")[0])]


def _files_run(call) -> set[str]:
    """The package's files whose code runs in ``call()`` (its threads' too)."""
    import sys
    import threading

    ran = set()

    def record(frame, event, arg):
        path = Path(frame.f_code.co_filename)
        if path.is_relative_to(PACKAGE):
            ran.add(str(path.relative_to(PACKAGE)))

    sys.setprofile(record)
    threading.setprofile(record)
    try:
        call()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return ran


def test_one_call_runs_the_files_the_architecture_traces_and_no_more_than_nine():
    """A call of `fused_linear_logprobs` with entropy, forward and backward on a CPU, traced: the package files whose
    code runs are the ones ARCHITECTURE.md lists, at most 9 (the op, the checks, the head, the settings, the
    registry, the implementation, the planner, the accumulator, the engine)."""

    import torch

    from logitless import fused_linear_logprobs

    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 7, 16, generator=generator, requires_grad=True)
    weight = torch.randn(1009, 16, generator=generator, requires_grad=True)
    targets = torch.randint(0, 1009, (2, 7), generator=generator)
    fused_linear_logprobs(hidden, weight, targets, return_token_entropy=True)  # first-use imports happen here

    def call():
        log_probs, entropy = fused_linear_logprobs(hidden, weight, targets, return_token_entropy=True)
        (log_probs.sum() + entropy.sum()).backward()

    ran = _files_run(call)
    assert hidden.grad is not None and weight.grad is not None
    assert sorted(ran) == sorted(_documented_trace()) and len(ran) <= 9


SHARDED_CALL = """
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from logitless import fused_linear_logprobs
from test_architecture import _files_run

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"], RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")
generator = torch.Generator().manual_seed(0)
hidden = torch.randn(2, 7, 16, generator=generator, requires_grad=True)
weight = distribute_tensor(torch.randn(1009, 16, generator=generator), init_device_mesh("cpu", (1,)), [Shard(0)])
weight.requires_grad_()
targets = torch.randint(0, 1009, (2, 7), generator=generator)
fused_linear_logprobs(hidden, weight, targets, return_token_entropy=True)  # first-use imports happen here


def call():
    log_probs, entropy = fused_linear_logprobs(hidden, weight, targets, return_token_entropy=True)
    (log_probs.sum() + entropy.sum()).backward()


print(sorted(_files_run(call)), weight.grad is not None)
dist.destroy_process_group()
"""


def test_the_sharded_call_runs_the_files_the_architecture_traces():
    """The call with a DTensor weight sharded on the vocabulary, in a one-process gloo group of its own (a fresh
    process, so that this test's process keeps no process group): the nine files and the three the section adds."""
    import os
    import subprocess
    import sys

    from ports import free_port

    done = subprocess.run([sys.executable, "-c", SHARDED_CALL], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).parent, env={**os.environ, "PORT": str(free_port())})
    assert done.returncode == 0, done.stderr[-2000:]
    ran, has_grad = done.stdout.strip().splitlines()[-1].rsplit(" ", 1)
    assert has_grad == "True"
    assert eval(ran) == sorted(_documented_trace() + _documented_trace("The sharded call, file by file"))


def test_a_jax_call_runs_the_files_the_architecture_traces():
    """`logitless.jax.fused_linear_logprobs` with entropy, jitted forward and gradient on one CPU device: the files
    whose Python runs while it is traced (after a first call at another shape has imported what it imports)."""
    import jax

    from logitless.jax import fused_linear_logprobs

    hidden = jax.random.normal(jax.random.key(0), (2, 7, 16))
    weight = jax.random.normal(jax.random.key(1), (1009, 16))
    targets = jax.random.randint(jax.random.key(2), (2, 7), 0, 1009)

    def loss(hidden, weight, targets):
        log_probs, entropy = fused_linear_logprobs(hidden, weight, targets, return_token_entropy=True)
        return log_probs.sum() + entropy.sum()

    jax.grad(loss, (0, 1))(hidden[:1], weight, targets[:1])  # first-use imports happen here
    grads = []
    ran = _files_run(lambda: grads.append(jax.block_until_ready(jax.jit(jax.grad(loss, (0, 1)))(hidden, weight,
                                                                                                   targets))))
    assert grads[0][1].shape == weight.shape
    assert sorted(ran) == sorted(_documented_trace("A JAX call, file by file"))
