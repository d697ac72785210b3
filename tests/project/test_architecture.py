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


def _documented_trace() -> list[str]:
    """The files of ARCHITECTURE.md's "One call, file by file", in its order."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    section = text[text.index("## One call, file by file"):]
    section = section[:section.index("\n## ", 4)] if "\n## " in section[4:] else section
    return re.findall(r"^\d+\. `([\w/]+\.py)`", section, re.MULTILINE)


def test_one_call_runs_the_files_the_architecture_traces_and_no_more_than_seven():
    """A call of `fused_linear_logprobs` with entropy, forward and backward on a CPU, traced: the package files whose
    code runs are the ones ARCHITECTURE.md lists, at most 7 (it took 13 when one op was spread over them)."""
    import sys
    import threading

    import torch

    from logitless import fused_linear_logprobs

    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 7, 16, generator=generator, requires_grad=True)
    weight = torch.randn(1009, 16, generator=generator, requires_grad=True)
    targets = torch.randint(0, 1009, (2, 7), generator=generator)
    fused_linear_logprobs(hidden, weight, targets, return_token_entropy=True)  # first-use imports happen here
    ran = set()

    def record(frame, event, arg):
        path = Path(frame.f_code.co_filename)
        if path.is_relative_to(PACKAGE):
            ran.add(str(path.relative_to(PACKAGE)))

    sys.setprofile(record)
    threading.setprofile(record)
    try:
        log_probs, entropy = fused_linear_logprobs(hidden, weight, targets, return_token_entropy=True)
        (log_probs.sum() + entropy.sum()).backward()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    assert hidden.grad is not None and weight.grad is not None
    assert sorted(ran) == sorted(_documented_trace()) and len(ran) <= 7
