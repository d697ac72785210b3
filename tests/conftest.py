import os
import signal
import sys

import pytest
import torch
from hypothesis import HealthCheck, settings

from logitless.models import qwen_tokenizer, save_model_and_tokenizer, tiny_qwen2

# the fuzz tests' examples: "ci" (the default, `make test`) keeps every case; "fast" (`make test-fast`) a tenth
settings.register_profile("ci", max_examples=500, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("fast", settings.get_profile("ci"), max_examples=50)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

SESSION_FIXTURES = ("warm_policy",)  # a module using one runs in the worker of the others that do (pytest -n)


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (``-n``, ``--dist loadgroup``): a test file's tests in one worker, so that its module
    fixtures are made once; the files that use a session fixture of `SESSION_FIXTURES` in one worker too."""
    modules = {}
    for item in items:
        modules.setdefault(item.module.__name__, set()).update(item.fixturenames)
    for item in items:
        shared = [name for name in SESSION_FIXTURES if name in modules[item.module.__name__]]
        item.add_marker(pytest.mark.xdist_group(shared[0] if shared else item.module.__name__))


@pytest.fixture(scope="session")
def tokenizer():
    return qwen_tokenizer()


@pytest.fixture(scope="session")
def tiny_model():
    return tiny_qwen2(seed=0)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer):
    """The embedded tiny Qwen2 (seed 0) and the Qwen tokenizer saved once per test session (per worker under -n): the
    model directory the trainer tests and the launches load."""
    return save_model_and_tokenizer(tiny_qwen2(seed=0), tokenizer, tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _signal_handlers_restored():
    """Every entry point that installs signal handlers (or the unraisable hook) restores them when it returns: one
    left behind turns a test runner's own SIGTERM into an exception inside a later, unrelated test."""
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM), sys.unraisablehook
    yield
    after = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM), sys.unraisablehook
    assert after == before, f"signal handlers or sys.unraisablehook left changed: {before} -> {after}"


@pytest.fixture(scope="session")
def warm_policy(tmp_path_factory):
    """(policy directory, questions.jsonl): the embedded untied tiny Qwen2 after 30 `logitless sft` steps on 16
    multiple-choice prompts answered " ANSWER: <ordinal> <letter>", and 4 other questions. GRPO on it gets
    rewards that differ within a group, so its weights move at every step."""
    import json

    from logitless.checkpoint import last_complete_checkpoint
    from logitless.cli import main
    from logitless.multichoice.data import synthetic_multichoice
    from logitless.multichoice.warm_start import multichoice_sft_pairs

    root = tmp_path_factory.mktemp("warm")
    pairs = multichoice_sft_pairs(synthetic_multichoice(count=16, seed=0), end=qwen_tokenizer().eos_token)
    (root / "warm.jsonl").write_text("".join(json.dumps(pair) + "\n" for pair in pairs))
    questions = [{key: record[key] for key in ("question", "choices", "answer")}
                 for record in synthetic_multichoice(count=4, seed=5)]
    (root / "questions.jsonl").write_text("".join(json.dumps(question) + "\n" for question in questions))
    assert main(["sft", "--model", "tiny-qwen2-untied", "--data", str(root / "warm.jsonl"), "--steps", "30",
                 "--save-every", "30", "--output-dir", str(root / "sft")]) == 0
    return last_complete_checkpoint(root / "sft")[0], root / "questions.jsonl"
