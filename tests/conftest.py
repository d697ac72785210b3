import signal
import sys

import pytest
import torch

from logitless.models import qwen_tokenizer, tiny_qwen2


@pytest.fixture(scope="session")
def tokenizer():
    return qwen_tokenizer()


@pytest.fixture(scope="session")
def tiny_model():
    return tiny_qwen2(seed=0)


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
