"""Ctrl-C (SIGINT) and SIGTERM end a command with one line: where it stopped, its last complete
checkpoint, and how to resume; exit status 130 or 143, no traceback.

`handling()` installs the handlers for the length of one command and restores what was there
before. A recipe reports where it is with `track` (its run directory and step count) and
`step_done`; the command line catches the interrupt and writes `summary`.

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
    steps: int = 0  # optimizer steps in all


_progress = _Progress()
_requested: type[BaseException] | None = None  # the interrupt a signal raised in this command, if any


def track(label: str, run_dir: str | Path, done: int, steps: int) -> None:
    """A run starts (or resumes) training: ``done`` of ``steps`` steps are finished, checkpoints go to ``run_dir``."""
    _progress.label, _progress.run_dir, _progress.done, _progress.steps = label, Path(run_dir), done, steps


def step_done(done: int) -> None:
    """A step finished: ``done`` steps are. Raises the interrupt a signal asked for, if it was lost on the way."""
    _progress.done = done
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


def close_progress_bars() -> None:
    """Close the open tqdm bars now, so that they do not redraw after the summary line when the process exits."""
    from tqdm import tqdm

    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()


def summary(command: str) -> str:
    """"logitless grpo: interrupted at step 3 of 4; last complete checkpoint: step 2 (runs/g/checkpoint-2);
    rerun the same command to resume" (or what there is to say when no run was training yet)."""
    from logitless.checkpoint import checkpoint_step, last_complete_checkpoint

    if _progress.label is None:
        return f"logitless {command}: interrupted before training started"
    checkpoint, _ = last_complete_checkpoint(_progress.run_dir)
    last = (f"last complete checkpoint: step {checkpoint_step(checkpoint)} ({checkpoint})" if checkpoint is not None
            else "no checkpoint yet, so a rerun starts at step 0")
    return (f"{_progress.label}: interrupted at step {min(_progress.done + 1, _progress.steps)} of {_progress.steps}; "
            f"{last}; rerun the same command to resume")
