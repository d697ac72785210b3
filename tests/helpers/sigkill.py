"""SIGKILL-anywhere: kill a training command at random moments, rerun it, and compare with an uninterrupted run.

Reusable for any trainer whose command resumes from its output directory: give the command line
(without its output directory), the output-directory option, and how to read the final weights.

    report = check_sigkill_anywhere([sys.executable, "-m", "logitless", "sft", "--steps", "4"], "--output-dir",
                                    sft_weights, tmp_path, kill_points=3)

The uninterrupted run is timed first; the moment its output directory is claimed (``logitless-run.json``
appears: imports and checks are done) starts the window in which kills fall, uniformly, over the
first 70% of the time it then took (a rerun resumes, so the same delay reaches later steps and saves).
A run that finishes before its kill (a machine less loaded than during the timing) shrinks the window
to 70% of its own time.
Each chain of runs shares one output directory: a run is killed at a random moment of that window,
rerun, killed again, ..., until a run finishes; its weights must equal the uninterrupted run's. The
very first kill waits instead for the first complete checkpoint, however long it takes on a loaded
machine, so that at least one rerun resumes from a checkpoint (a random moment may fall before any). The
number of kills is ``kill_points``, or the environment variable LOGITLESS_KILL_POINTS when it is set
(run many locally: ``LOGITLESS_KILL_POINTS=50 pytest tests/cli/test_sigkill.py``).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch

from logitless.checkpoint import CHECKPOINT_STAGING, checkpoint_problem

MARKER = "logitless-run.json"


def kill_points(default: int) -> int:
    return int(os.environ.get("LOGITLESS_KILL_POINTS", default))


def _start(command: list[str], output_option: str, output_dir: Path) -> subprocess.Popen:
    return subprocess.Popen([*command, output_option, str(output_dir)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))


def _finish(process: subprocess.Popen, what: str) -> None:
    _, stderr = process.communicate()
    if process.returncode != 0:
        raise AssertionError(f"{what} failed with exit code {process.returncode}:\n{stderr[-3000:]}")


def _while_written(look: Callable[[], bool]) -> bool:
    """``look()``, again whenever the running command renamed a directory away under the walk (a checkpoint being
    published from its staging directory)."""
    while True:
        try:
            return look()
        except FileNotFoundError:
            continue


def _saving(output_dir: Path) -> bool:
    """Whether a checkpoint was being written: a staging directory with content (in a method's directory too)."""
    return _while_written(lambda: any(any(staging.iterdir()) for staging in output_dir.rglob(CHECKPOINT_STAGING)
                                      if staging.is_dir()))


def _has_checkpoint(output_dir: Path) -> bool:
    """Whether a complete checkpoint exists (in a method's directory too)."""
    return _while_written(lambda: any(checkpoint_problem(path) is None for path in output_dir.rglob("checkpoint-*")
                                      if path.is_dir() and CHECKPOINT_STAGING not in path.parts))


def check_sigkill_anywhere(command: list[str], output_option: str, final_weights: Callable[[Path], dict],
                           tmp_path: Path, *, kill_points: int, seed: int = 0,
                           atol: float = 0.0) -> dict:
    """Run the check; returns {"kills": n, "during_save": m, "resumed": r (kills after which a complete checkpoint
    was there to resume from), "chains": c}. Raises AssertionError on a mismatch (naming the chain's kill times)
    or when a rerun fails."""
    reference_dir = tmp_path / "uninterrupted"
    started = time.monotonic()
    process = _start(command, output_option, reference_dir)
    claimed = None
    while process.poll() is None:
        if claimed is None and (reference_dir / MARKER).exists():
            claimed = time.monotonic() - started
        time.sleep(0.05)
    _finish(process, "the uninterrupted run")
    claimed = claimed or 0.0
    window = (claimed, claimed + 0.7 * (time.monotonic() - started - claimed))
    expected = final_weights(reference_dir)

    rng = random.Random(seed)
    kills = during_save = resumed = chains = 0
    while kills < kill_points:
        chains += 1
        output_dir, moments = tmp_path / f"chain{chains}", []
        while True:
            process = _start(command, output_option, output_dir)
            moment = rng.uniform(*window) if 0 < kills < kill_points else float("inf")
            launched = time.monotonic()
            while process.poll() is None and time.monotonic() - launched < moment:
                if kills == 0 and _has_checkpoint(output_dir):  # the first kill: at the first checkpoint
                    break
                time.sleep(0.01)
            if process.poll() is None:
                process.send_signal(signal.SIGKILL)
                process.wait()
                kills += 1
                moments.append(round(time.monotonic() - launched, 2))
                during_save += _saving(output_dir)
                resumed += _has_checkpoint(output_dir)
                continue
            _finish(process, f"the rerun after kills at {moments} s")
            if moment != float("inf"):  # it finished before its kill: the machine got faster, so does the window
                window = (window[0], max(window[0], 0.7 * (time.monotonic() - launched)))
            break
        got = final_weights(output_dir)
        assert got.keys() == expected.keys()
        for name, tensor in expected.items():
            difference = (got[name].double() - tensor.double()).abs().max().item()
            assert difference <= atol, (f"chain killed at {moments} s: {name} differs from the uninterrupted run's "
                                        f"by {difference}")
    return {"kills": kills, "during_save": during_save, "resumed": resumed, "chains": chains, "window_s": window}


def safetensors_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))
