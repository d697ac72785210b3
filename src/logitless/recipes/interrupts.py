"""Ctrl-C (SIGINT) and SIGTERM end a command with one line: where it stopped, its last complete
checkpoint, and how to resume; exit status 130 or 143, no traceback.

A recipe reports where it is with `track` (its run directory and step count) and `step_done`; the
command line catches the interrupt and writes `summary`. An interrupt raised while Python runs a
finalizer or a library's catch-all is lost ("Exception ignored in ..."), and the run would go on to its
end; the signal is remembered, so `step_done` raises it again at the end of that step.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path

from logitless.checkpoint import checkpoint_step, last_complete_checkpoint


class Terminated(BaseException):
    """SIGTERM arrived: raised in the main thread like KeyboardInterrupt, so no ``except Exception`` swallows it."""


EXIT_STATUS = {KeyboardInterrupt: 130, Terminated: 143}  # 128 + the signal's number, as shells report it


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


def begin_command() -> None:
    """A command starts: no run is training yet (whatever an earlier command in this process reported), no
    interrupt is pending, and SIGINT and SIGTERM raise KeyboardInterrupt and `Terminated` in the main thread
    (by default SIGTERM ends the process without a word)."""
    global _progress, _requested
    _progress, _requested = _Progress(), None
    signal.signal(signal.SIGINT, _raise_interrupt)
    signal.signal(signal.SIGTERM, _raise_interrupt)


def close_progress_bars() -> None:
    """Close the open tqdm bars now, so that they do not redraw after the summary line when the process exits."""
    from tqdm import tqdm

    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()


def summary(command: str) -> str:
    """"logitless grpo: interrupted at step 3 of 4; last complete checkpoint: step 2 (runs/g/checkpoint-2);
    rerun the same command to resume" (or what there is to say when no run was training yet)."""
    if _progress.label is None:
        return f"logitless {command}: interrupted before training started"
    checkpoint, _ = last_complete_checkpoint(_progress.run_dir)
    last = (f"last complete checkpoint: step {checkpoint_step(checkpoint)} ({checkpoint})" if checkpoint is not None
            else "no checkpoint yet, so a rerun starts at step 0")
    return (f"{_progress.label}: interrupted at step {min(_progress.done + 1, _progress.steps)} of {_progress.steps}; "
            f"{last}; rerun the same command to resume")
