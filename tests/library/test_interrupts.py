"""Ctrl-C and SIGTERM end the run even where Python cannot raise them at once (a finalizer, a library's
catch-all), never print a traceback on the way, and leave the process's own handlers as they were."""

import json
import os
import signal
import sys
import time

import pytest

from logitless.cli import main
from logitless import interrupts


@pytest.fixture
def command():
    with interrupts.handling():
        yield


def _swallowed(sent: signal.Signals) -> type[BaseException]:
    """Send ``sent`` to this process and catch what it raises, as a library's catch-all would."""
    try:
        os.kill(os.getpid(), sent)
        time.sleep(1.0)  # the handler runs in the main thread at the next bytecode
    except BaseException as caught:  # noqa: BLE001 - swallowing it is the point
        return type(caught)
    raise AssertionError(f"{sent.name} raised nothing")


@pytest.mark.parametrize("sent, raised", [(signal.SIGINT, KeyboardInterrupt), (signal.SIGTERM, interrupts.Terminated)])
def test_a_swallowed_interrupt_is_raised_again_when_the_step_ends(command, sent, raised):
    interrupts.step_done(1)  # nothing pending: the run goes on
    assert _swallowed(sent) is raised
    with pytest.raises(raised):
        interrupts.step_done(2)


class _SignalledInFinalizer:
    """An object whose finalizer receives ``sent`` (as a weakref callback or ``__del__`` in a library might, when
    Ctrl-C lands while the garbage collector runs)."""

    def __init__(self, sent: signal.Signals):
        self.sent = sent

    def __del__(self):
        os.kill(os.getpid(), self.sent)
        time.sleep(0.2)  # the handler raises here, inside the finalizer, where Python can only print it


@pytest.mark.parametrize("sent, raised", [(signal.SIGINT, KeyboardInterrupt), (signal.SIGTERM, interrupts.Terminated)])
def test_an_interrupt_inside_a_finalizer_is_raised_after_it_without_a_traceback(command, capfd, sent, raised):
    """Under load Ctrl-C landed in a weakref callback: "Exception ignored in ... Traceback ... KeyboardInterrupt"
    was printed and the run went on to the end of its step."""
    started = time.monotonic()
    with pytest.raises(raised):
        _SignalledInFinalizer(sent)  # finalized at once: nothing refers to it
        while time.monotonic() - started < 5:
            time.sleep(0.01)
    assert time.monotonic() - started < 4  # delivered once the finalizer returned, not at the end of a step
    err = capfd.readouterr().err
    assert "Exception ignored" not in err and "Traceback" not in err, err
    with pytest.raises(raised):  # still pending for the end of the step, should a catch-all swallow it again
        interrupts.step_done(1)


def test_handling_restores_the_handlers_and_hook_it_replaced():
    def mine(signum, frame):
        pass

    before = {signum: signal.signal(signum, mine) for signum in (signal.SIGINT, signal.SIGTERM)}
    hook = sys.unraisablehook
    try:
        with interrupts.handling():
            assert signal.getsignal(signal.SIGTERM) is not mine and sys.unraisablehook is not hook
        assert signal.getsignal(signal.SIGINT) is mine and signal.getsignal(signal.SIGTERM) is mine
        assert sys.unraisablehook is hook
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


def test_the_command_line_leaves_the_process_handlers_as_it_found_them(tmp_path):
    """An in-process `main` left its SIGTERM handler installed: a test runner's own SIGTERM later became
    `Terminated` inside an unrelated test."""
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM), sys.unraisablehook
    with pytest.raises(SystemExit):  # a bad option ends the command inside its handler
        main(["sft", "--steps", "-1"])
    assert main(["sft", "--steps", "1", "--batch-size", "2", "--output-dir", str(tmp_path / "run")]) == 0
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM), sys.unraisablehook) == before


def test_a_new_command_starts_with_no_interrupt_pending_and_no_run_or_stage():
    with interrupts.handling():
        interrupts.stage("in a stage", "nothing kept")
        interrupts.track("logitless sft", "runs/sft", 1, 4)  # a run inside the stage: its steps are counted
        _swallowed(signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):  # pending in this command
            interrupts.step_done(2)
        assert interrupts.summary("sft").startswith("logitless sft: interrupted in a stage at step 3 of 4;")
    with interrupts.handling():
        interrupts.step_done(1)  # raises nothing: the interrupt was the last command's
        assert interrupts.summary("sft") == "logitless sft: interrupted before training started"


def _interrupt_on_call(monkeypatch, target: str, call: int):
    """Replace ``target`` (a function's dotted path) by one that raises KeyboardInterrupt on its ``call``-th call, as
    Ctrl-C would land there, and runs it otherwise."""
    module, _, name = target.rpartition(".")
    original = getattr(__import__(module, fromlist=[name]), name)
    calls = []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(target, interrupted)


def test_ctrl_c_in_the_demos_warm_up_names_the_phase_and_the_step(tmp_path, monkeypatch, capsys):
    """Ctrl-C 42 steps into the demo's warm-up SFT printed "interrupted before training started"."""
    _interrupt_on_call(monkeypatch, "logitless.multichoice.warm_start.sft_step", 4)
    assert main(["demo", "--steps", "10", "--output-dir", str(tmp_path / "demo")]) == 130
    assert capsys.readouterr().err.splitlines()[-1] == (
        "logitless demo: interrupted in phase 1 of 4 (the warm-up SFT) at step 4 of 11; a rerun of `logitless demo` "
        "starts over (it keeps no checkpoint to resume from)")


def test_ctrl_c_in_a_benchmark_writes_the_rows_that_finished(tmp_path, monkeypatch, capsys):
    """Ctrl-C in `bench jax` said "interrupted before training started" and wrote no JSON."""
    pytest.importorskip("jax")
    _interrupt_on_call(monkeypatch, "logitless.bench.jax.compile_step", 5)  # the run shape's second implementation
    report = tmp_path / "partial.json"
    assert main(["bench", "jax", "--loss", "ce", "-B", "1", "-T", "8", "-H", "8", "-V", "257", "--vocab-block", "64",
                 "--compile-shape", "1,8,8,257,float32", "--json", str(report)]) == 130
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"logitless bench jax: interrupted while measuring; 3 rows finished (compile ce plain, compile ce seq_chunked, "
        f"compile ce logitless): written to {report}")
    written = json.loads(report.read_text())
    assert written["interrupted"] is True and written["options"]["loss"] == ["ce"]
    assert set(written["results"]["compile"]["ce"]) == {"plain", "seq_chunked", "logitless"}
    assert written["results"]["run"] == {}
