"""Ctrl-C (SIGINT) and SIGTERM end a command with one line: where it stopped, in the command's own words, and what
is kept; exit status 130 or 143, no traceback.

`handling()` installs the handlers for the length of one command and restores what was there
before. A recipe reports where it is with `track` (its run directory and step count) and
`step_done`: its line names the last complete checkpoint and how to resume. A command whose work is not a
resumable run (the demo's phases, a benchmark's rows, a teacher's warm-up) names its `stage` and what an
interrupt there leaves (a function, where saying it writes something: a benchmark's rows so far); the steps a
stage's loops report with `step_done` are named too. The command line catches the interrupt and writes `summary`.

An interrupt can land while Python runs a finalizer (a ``__del__``, a weakref callback): Python
cannot raise it there and would print "Exception ignored in ..." with a traceback, then go on. While
`handling()` is active such an interrupt is delivered again, silently, as soon as the finalizer
returns; one swallowed by a library's catch-all is raised again by `step_done` at the end of its step.
"""

from __future__ import annotations

import _thread
import contextlib
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


class Terminated(BaseException):
    """SIGTERM arrived: raised in the main thread like KeyboardInterrupt, so no ``except Exception`` swallows it."""


EXIT_STATUS = {KeyboardInterrupt: 130, Terminated: 143}  # 128 + the signal's number, as shells report it
_SIGNALS = {KeyboardInterrupt: signal.SIGINT, Terminated: signal.SIGTERM}


@dataclass
class _Progress:
    label: str | None = None  # "logitless grpo"; None: no run is training
    run_dir: Path | None = None  # where its checkpoint-STEP directories are written
    done: int = 0  # optimizer steps finished
    steps: int = 0  # optimizer steps in all (0: not counted)
    stage: str | None = None  # a command's own words for where it is: "in phase 1 of 4 (the warm-up SFT)"
    leaves: str | Callable[[], str] = ""  # what an interrupt in the stage leaves, said after it


_progress = _Progress()
_requested: type[BaseException] | None = None  # the interrupt a signal raised in this command, if any


def track(label: str, run_dir: str | Path, done: int, steps: int) -> None:
    """A run starts (or resumes) training: ``done`` of ``steps`` steps are finished, checkpoints go to ``run_dir``."""
    _progress.label, _progress.run_dir, _progress.done, _progress.steps = label, Path(run_dir), done, steps


def stage(words: str, leaves: str | Callable[[], str]) -> None:
    """The command enters a stage of its own: an interrupt now ends with "interrupted WORDS[ at step N of M]; LEAVES"
    (``leaves`` called then, when it is a function), whatever runs it trains inside the stage. Steps are counted
    afresh."""
    _progress.stage, _progress.leaves, _progress.done, _progress.steps = words, leaves, 0, 0


@contextlib.contextmanager
def staged(words: str, leaves: str | Callable[[], str]):
    """`stage` for the length of a ``with`` block that ends normally; the stage before it (or none) is back after it.
    Interrupted inside, the block's stage is the one `summary` names."""
    before = _progress.stage, _progress.leaves
    stage(words, leaves)
    yield
    _progress.stage, _progress.leaves = before


def step_done(done: int, steps: int | None = None) -> None:
    """A step finished: ``done`` steps are (of ``steps``, when given). Raises the interrupt a signal asked for, if it
    was lost on the way."""
    _progress.done = done
    if steps is not None:
        _progress.steps = steps
    if _requested is not None:
        raise _requested()


def _raise_interrupt(signum, frame):
    global _requested
    _requested = Terminated if signum == signal.SIGTERM else KeyboardInterrupt
    raise _requested()


REDELIVERY_DELAY_S = 0.01  # long enough for the finalizer (and this hook) to have returned


def _deliver_again(unraisable) -> None:
    """sys.unraisablehook while `handling()`: our interrupt, raised inside a finalizer, is sent to the main
    thread again a moment later (from a timer thread: sent from here, it would be raised inside this hook)
    instead of printed; anything else is reported as before."""
    if unraisable.exc_type in _SIGNALS:
        timer = threading.Timer(REDELIVERY_DELAY_S, _thread.interrupt_main, args=(_SIGNALS[unraisable.exc_type],))
        timer.daemon = True
        timer.start()
    else:
        _previous_unraisablehook(unraisable)


_previous_unraisablehook = sys.unraisablehook


@contextlib.contextmanager
def handling():
    """For the duration of one command: no run is training yet (whatever an earlier command in this process
    reported), no interrupt is pending, and SIGINT and SIGTERM raise KeyboardInterrupt and `Terminated` in the
    main thread (by default SIGTERM ends the process without a word). The handlers and the unraisable hook that
    were installed before are restored on the way out."""
    global _progress, _requested, _previous_unraisablehook
    _progress, _requested = _Progress(), None
    previous = {signum: signal.signal(signum, _raise_interrupt) for signum in _SIGNALS.values()}
    _previous_unraisablehook, sys.unraisablehook = sys.unraisablehook, _deliver_again
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        sys.unraisablehook = _previous_unraisablehook
        _requested = None


def summary(command: str) -> str:
    """"logitless grpo: interrupted at step 3 of 4; last complete checkpoint: step 2 (runs/g/checkpoint-2);
    rerun the same command to resume", or in a `stage`, "logitless demo: interrupted in phase 1 of 4 (the warm-up
    SFT) at step 43 of 66; ...", or what there is to say when neither started."""
    from logitless.checkpoint import checkpoint_step, last_complete_checkpoint

    if _progress.stage is not None:
        at = f" at step {min(_progress.done + 1, _progress.steps)} of {_progress.steps}" if _progress.steps else ""
        leaves = _progress.leaves() if callable(_progress.leaves) else _progress.leaves
        return f"logitless {command}: interrupted {_progress.stage}{at}; {leaves}"
    if _progress.label is None:
        return f"logitless {command}: interrupted before training started"
    checkpoint, _ = last_complete_checkpoint(_progress.run_dir)
    last = (f"last complete checkpoint: step {checkpoint_step(checkpoint)} ({checkpoint})" if checkpoint is not None
            else "no checkpoint yet, so a rerun starts at step 0")
    return (f"{_progress.label}: interrupted at step {min(_progress.done + 1, _progress.steps)} of {_progress.steps}; "
            f"{last}; rerun the same command to resume")
