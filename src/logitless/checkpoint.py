"""Training checkpoints that appear complete or not at all, and finding the newest complete one.

A checkpoint directory is written where nothing reads it yet, then sealed: a record of every file's
size (``logitless-checkpoint.json``) is written last and every file and directory is fsynced. Then
ONE rename makes it visible. A crash (SIGKILL, power loss) at any moment leaves the previous
checkpoint or the new one, never a mix and never neither.

Every command names its checkpoints ``checkpoint-STEP`` inside its run directory, written under
``.logitless-staging/`` and published with one rename:

* our own, `save_checkpoint` (``logitless sft``, ``logitless grade``): the model and tokenizer
  (``save_pretrained``), the optimizer's tensors (``optimizer.safetensors``) and everything else as
  JSON (``trainer_state.json``); nothing is pickled.
* Hugging Face Trainer's: `GRPOTrainerWithLogits` writes each one in the staging directory and
  publishes it with `publish_directory`.

`last_complete_checkpoint` picks the newest complete one to resume from and names the ones it skipped
(one that a stock Trainer wrote, without the record, counts as complete when its last file,
trainer_state.json, parses).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from logitless._checks import check_positive_int
from logitless.models import save_model_and_tokenizer
from logitless.rundir import remove_tree

if TYPE_CHECKING:  # finding checkpoints loads no PyTorch: a command checks its run directory before any model loads
    import torch

RECORD_FILE = "logitless-checkpoint.json"
STATE_FILE = "trainer_state.json"
TRAINER_ARGS_FILE = "training_args.bin"  # what a stock Trainer writes in every checkpoint
OPTIMIZER_FILE = "optimizer.safetensors"
CHECKPOINT_PREFIX = "checkpoint"  # checkpoint-STEP, as Hugging Face's Trainer names them
CHECKPOINT_STAGING = ".logitless-staging"  # in the run directory: checkpoints being written
STEP_CHECKPOINT = re.compile(rf"^{CHECKPOINT_PREFIX}-(\d+)$")  # the names of the directories a run saves


def _fsync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)  # a directory too: that makes its entries durable
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def seal(directory: str | Path) -> None:
    """Record the size of every file under ``directory`` (written last), then fsync all of it."""
    directory = Path(directory)
    files = {str(path.relative_to(directory)): path.stat().st_size
             for path in sorted(directory.rglob("*")) if path.is_file() and path.name != RECORD_FILE}
    (directory / RECORD_FILE).write_text(json.dumps({"files": files}, indent=1))
    for path in directory.rglob("*"):
        _fsync(path)
    _fsync(directory)


def checkpoint_problem(directory: str | Path) -> str | None:
    """Why ``directory`` is not a complete checkpoint (a sentence), or None when it is one."""
    directory = Path(directory)
    if not directory.is_dir():
        return "it does not exist"
    record = directory / RECORD_FILE
    if not record.is_file():
        return f"it has no {RECORD_FILE} (the record a finished save writes last)"
    try:
        files = dict(json.loads(record.read_text())["files"])
    except (ValueError, KeyError, TypeError):
        return f"its {RECORD_FILE} is unreadable"
    for name, size in files.items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, not the {size} it was written with"
    if STATE_FILE in files:  # small, and read first on resume: a damage of the same size shows here
        try:
            json.loads((directory / STATE_FILE).read_text())
        except (OSError, ValueError):
            return f"its {STATE_FILE} is unreadable"
    return None


def publish_directory(staging: str | Path, final: str | Path) -> Path:
    """Seal ``staging`` and rename it to ``final`` (same file system). An incomplete directory already
    at ``final`` (one written in place by a save that was interrupted) is removed first; a complete one is kept
    and this raises FileExistsError."""
    staging, final = Path(staging), Path(final)
    seal(staging)
    if final.exists():
        if checkpoint_problem(final) is None:
            raise FileExistsError(f"{final} already holds a complete checkpoint")
        remove_tree(final)
    os.rename(staging, final)
    _fsync(final.parent)
    return final


def _step_directories(run_dir: Path) -> list[Path]:
    """The ``checkpoint-STEP`` directories in ``run_dir``, oldest step first."""
    found = [(int(match.group(1)), entry) for entry in (run_dir.iterdir() if run_dir.is_dir() else ())
             if (match := STEP_CHECKPOINT.match(entry.name)) and entry.is_dir()]
    return [path for _, path in sorted(found)]


def checkpoint_step(path: str | Path) -> int:
    """STEP of a ``checkpoint-STEP`` directory."""
    return int(STEP_CHECKPOINT.match(Path(path).name).group(1))


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """The complete ``checkpoint-STEP`` directories in ``run_dir``, oldest step first."""
    return [path for path in _step_directories(Path(run_dir)) if _trainer_checkpoint_problem(path) is None]


def last_complete_checkpoint(run_dir: str | Path) -> tuple[Path | None, list[str]]:
    """The newest complete ``checkpoint-STEP`` directory in ``run_dir`` (None if none), and one
    "skipping ..." sentence for each newer directory that is not complete."""
    skipped = []
    for path in reversed(_step_directories(Path(run_dir))):
        problem = _trainer_checkpoint_problem(path)
        if problem is None:
            return path, skipped
        skipped.append(f"skipping incomplete checkpoint {path}: {problem}")
    return None, skipped


def _trainer_checkpoint_problem(path: Path) -> str | None:
    """`checkpoint_problem`, except that a checkpoint a stock Trainer wrote (no record, and the
    training_args.bin it always writes) counts as complete when the file it writes last,
    trainer_state.json, is there and parses."""
    if (path / RECORD_FILE).exists() or not (path / TRAINER_ARGS_FILE).exists():
        return checkpoint_problem(path)
    try:
        json.loads((path / STATE_FILE).read_text())
    except (OSError, ValueError):
        return f"it has neither {RECORD_FILE} nor a readable {STATE_FILE} (a save that did not finish)"
    return None


# -- our own format: checkpoint-STEP with JSON state and safetensors --------------------------------

def checkpoint_name(step: int) -> str:
    return f"{CHECKPOINT_PREFIX}-{step}"


def save_checkpoint(run_dir: str | Path, step: int, model, tokenizer, optimizer: torch.optim.Optimizer, state: dict,
                    *, keep: int | None = None) -> Path:
    """Write model, tokenizer, optimizer and ``state`` (JSON-able) as ``RUN_DIR/checkpoint-STEP``; returns it.

    The directory is written under ``RUN_DIR/.logitless-staging`` and published with one rename
    (`publish_directory`), so it is complete or absent. ``keep``: then only the newest ``keep`` complete
    checkpoints stay (None: every one).
    """
    import torch
    from safetensors.torch import save_file

    if keep is not None:
        check_positive_int("keep", keep)
    run_dir = Path(run_dir)
    staging = run_dir / CHECKPOINT_STAGING / checkpoint_name(step)
    if staging.exists():
        shutil.rmtree(staging)  # a save of this step that a crash interrupted
    save_model_and_tokenizer(model, tokenizer, staging)
    optimizer_state = optimizer.state_dict()
    tensors = {f"{param_id}.{key}": value.detach().clone().contiguous()
               for param_id, param_state in optimizer_state["state"].items()
               for key, value in param_state.items() if isinstance(value, torch.Tensor)}
    save_file(tensors, str(staging / OPTIMIZER_FILE))
    meta = {"trainer": state, "optimizer_param_groups": optimizer_state["param_groups"]}
    (staging / STATE_FILE).write_text(json.dumps(meta, indent=2))
    final = publish_directory(staging, run_dir / checkpoint_name(step))
    if not any(staging.parent.iterdir()):
        staging.parent.rmdir()  # nothing left in flight: the run directory shows only what it holds
    if keep is not None:
        for older in complete_checkpoints(run_dir)[:-keep]:
            remove_tree(older)
    return final


def load_checkpoint_state(directory: str | Path, optimizer: torch.optim.Optimizer) -> dict:
    """Restore the optimizer in place and return the trainer state saved with it."""
    from safetensors.torch import load_file

    directory = Path(directory)
    meta = json.loads((directory / STATE_FILE).read_text())
    per_param: dict[int, dict] = {}
    for name, tensor in load_file(str(directory / OPTIMIZER_FILE)).items():
        param_id, key = name.split(".", 1)
        per_param.setdefault(int(param_id), {})[key] = tensor
    optimizer.load_state_dict({"state": per_param, "param_groups": meta["optimizer_param_groups"]})
    return meta["trainer"]
