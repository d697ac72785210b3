import os
import signal
import sys

import pytest
from hypothesis import HealthCheck, settings

# tests/helpers/: the modules the tests share and the scripts they launch (which import each other by name)
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "helpers"))

# the fuzz tests' examples: "ci" (the default, `make test`) keeps every case; "fast" (`make test-fast`) a tenth
settings.register_profile("ci", max_examples=500, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("fast", settings.get_profile("ci"), max_examples=50)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Under pytest-xdist each worker gets its share of the cores for PyTorch's intra-op threads, and so do the processes
# its tests start (they inherit it): two workers of two threads each on two cores wait at each other's barriers, a
# third slower in all (docs/BENCHMARKS.md). Set before any test imports torch; the tests of the threaded paths set
# their thread counts themselves.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, CORES // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))

# The files that take longest (`--durations`, docs/BENCHMARKS.md), run first: under pytest-xdist (`make test`: ``-n 2
# --dist loadfile --no-loadscope-reorder``, each file's tests in one worker so that its module fixtures are made once,
# the files handed out in this order) a long file begun last would keep one worker busy after the other has finished.
LONGEST_FIRST = ("test_trl_launch.py", "test_sigkill.py", "test_bench.py", "test_distill_recipe.py",
                 "test_cli_runs.py", "test_demo.py", "test_grade_recipe.py", "test_docs.py", "test_tunix.py",
                 "test_tunix_sharded.py",
                 "test_trl_grpo.py", "test_trl_trainers.py", "test_sharded.py", "test_jax_grpo.py",
                 "test_bench_compile.py", "test_user_cases.py", "test_fused_fuzz.py", "test_triton.py",
                 "test_jax_sharded.py", "test_jax_one_head.py", "test_bench_grade.py",
                 "test_grpo_objective.py", "test_bench_distributed.py", "test_trl_fsdp.py",
                 "test_trl_distributed.py", "test_trl_resume.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: place for place, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's own order kept


# A skipped test is a test that did not run: a green run is every test run. The one kind that may be skipped is a test
# of what the library does where it cannot run the Triton kernels, on a machine where it can (a GPU); any other skip
# (a dependency that `make install` installs but this environment lacks, a case a test gave up on) fails the run,
# naming each skipped test and why.
MAY_SKIP = frozenset({"test_triton_where_it_cannot_run_is_named"})
_SKIPPED: list[str] = []


def _note_skip(report) -> None:
    if report.skipped and report.nodeid.split("::")[-1].split("[")[0] not in MAY_SKIP:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _SKIPPED.append(f"{report.nodeid or report.fspath}: {reason}")


pytest_runtest_logreport = pytest_collectreport = _note_skip  # under pytest-xdist both reach the controller too


def pytest_terminal_summary(terminalreporter):
    if _SKIPPED and not hasattr(terminalreporter.config, "workerinput"):
        terminalreporter.section("skipped, and not allowed to be (tests/conftest.py MAY_SKIP)", red=True)
        for line in sorted(set(_SKIPPED)):
            terminalreporter.line(line)


def pytest_sessionfinish(session, exitstatus):
    if _SKIPPED and exitstatus == pytest.ExitCode.OK and not hasattr(session.config, "workerinput"):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# The fixtures import PyTorch where they are used: the JAX tests run in an environment without it too (`make test`).


@pytest.fixture(scope="session")
def tokenizer():
    from logitless.models import qwen_tokenizer

    return qwen_tokenizer()


@pytest.fixture(scope="session")
def tiny_model():
    from logitless.models import tiny_qwen2

    return tiny_qwen2(seed=0)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer):
    """The embedded tiny Qwen2 (seed 0) and the Qwen tokenizer saved once per test session (per worker under -n): the
    model directory the trainer tests and the launches load."""
    from logitless.models import save_model_and_tokenizer, tiny_qwen2

    return save_model_and_tokenizer(tiny_qwen2(seed=0), tokenizer, tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(autouse=True)
def _seed():
    """Every test starts from PyTorch's seed 0 (when the test uses PyTorch at all)."""
    torch = sys.modules.get("torch")
    if torch is not None:
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
    from logitless.models import qwen_tokenizer
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
