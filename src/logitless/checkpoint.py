"""Training checkpoints that appear complete or not at all, and finding the newest complete one.

A checkpoint directory is written where nothing reads it yet, then sealed: a record of every file's
size (``logitless-checkpoint.json``) is written last and every file and directory is fsynced. Then
ONE rename makes it visible. A crash (SIGKILL, power loss) at any moment leaves the previous
checkpoint or the new one, never a mix and never neither.

Two layouts use this:

* our own, `save_checkpoint` (``logitless sft``): ``DIR`` is a symbolic link to a hidden version
  ``.DIR.N`` beside it. A save writes ``.DIR.N+1``, seals it, swaps the link with one rename, then
  removes the older versions. It holds the model and tokenizer (``save_pretrained``), the optimizer's
  tensors (``optimizer.safetensors``) and everything else as JSON (``trainer_state.json``); nothing
  is pickled.
* Hugging Face Trainer's ``checkpoint-STEP`` directories: `GRPOTrainerWithLogits` writes each one in
  a staging directory and publishes it with `publish_directory`; `last_complete_checkpoint` picks
  the newest complete one to resume from and names the ones it skipped (one that a stock Trainer
  wrote, without the record, counts as complete when its last file, trainer_state.json, parses).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from logitless.models import save_model_and_tokenizer

RECORD_FILE = "logitless-checkpoint.json"
STATE_FILE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.safetensors"
_HF_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


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
    return None


def remove_tree(path: str | Path) -> None:
    """Delete a directory so that it disappears at once: renamed to a hidden name, then removed."""
    path = Path(path)
    doomed = path.with_name(f".{path.name}.deleting")
    if doomed.exists():
        shutil.rmtree(doomed)
    os.rename(path, doomed)
    shutil.rmtree(doomed)


def publish_directory(staging: str | Path, final: str | Path) -> Path:
    """Seal ``staging`` and rename it to ``final`` (same file system). An incomplete directory already
    at ``final`` (a save interrupted by an older version) is removed first; a complete one is kept
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


def last_complete_checkpoint(run_dir: str | Path) -> tuple[Path | None, list[str]]:
    """The newest complete ``checkpoint-STEP`` directory in ``run_dir`` (None if none), and one
    "skipping ..." sentence for each newer directory that is not complete."""
    run_dir = Path(run_dir)
    steps = sorted(((int(match.group(1)), entry) for entry in (run_dir.iterdir() if run_dir.is_dir() else ())
                    if (match := _HF_CHECKPOINT.match(entry.name)) and entry.is_dir()), reverse=True)
    skipped = []
    for _, path in steps:
        problem = _trainer_checkpoint_problem(path)
        if problem is None:
            return path, skipped
        skipped.append(f"skipping incomplete checkpoint {path}: {problem}")
    return None, skipped


def _trainer_checkpoint_problem(path: Path) -> str | None:
    """`checkpoint_problem`, except that a checkpoint a stock Trainer wrote (no record) counts as complete
    when the file it writes last, trainer_state.json, is there and parses."""
    if (path / RECORD_FILE).exists():
        return checkpoint_problem(path)
    try:
        json.loads((path / STATE_FILE).read_text())
    except (OSError, ValueError):
        return f"it has neither {RECORD_FILE} nor a readable {STATE_FILE} (a save that did not finish)"
    return None


# -- our own format: DIR -> .DIR.N ---------------------------------------------------------------

def _versions(directory: Path) -> dict[int, Path]:
    """The hidden versions ``.DIR.N`` that `save_checkpoint` wrote beside ``directory``."""
    pattern = re.compile(rf"^\.{re.escape(directory.name)}\.(\d+)$")
    if not directory.parent.is_dir():
        return {}
    return {int(match.group(1)): entry for entry in directory.parent.iterdir() if (match := pattern.match(entry.name))}


def save_checkpoint(directory: str | Path, model, tokenizer, optimizer: torch.optim.Optimizer, state: dict) -> Path:
    """Write model, tokenizer, optimizer and ``state`` (JSON-able) as the checkpoint at ``directory``.

    ``directory`` becomes a link to the new version; the previous checkpoint stays readable until the
    one rename that swaps the link, and is removed after it.
    """
    directory = Path(directory)
    if directory.exists() and not directory.is_symlink():
        raise FileExistsError(f"directory: {directory} is a directory that save_checkpoint did not write "
                              "(it keeps a link there); move it away")
    older = _versions(directory)
    version = directory.with_name(f".{directory.name}.{max(older, default=0) + 1}")
    save_model_and_tokenizer(model, tokenizer, version)
    optimizer_state = optimizer.state_dict()
    tensors = {f"{param_id}.{key}": value.detach().clone().contiguous()
               for param_id, param_state in optimizer_state["state"].items()
               for key, value in param_state.items() if isinstance(value, torch.Tensor)}
    save_file(tensors, str(version / OPTIMIZER_FILE))
    meta = {"trainer": state, "optimizer_param_groups": optimizer_state["param_groups"]}
    (version / STATE_FILE).write_text(json.dumps(meta, indent=2))
    seal(version)
    link = directory.with_name(f".{directory.name}.link")
    if link.is_symlink() or link.exists():
        link.unlink()
    os.symlink(version.name, link)  # relative: the run directory can be moved or copied
    os.replace(link, directory)  # the one step that publishes the new checkpoint
    _fsync(directory.parent)
    for path in older.values():
        remove_tree(path)
    return directory


def has_checkpoint(directory: str | Path) -> bool:
    """Whether ``directory`` holds a complete checkpoint."""
    return checkpoint_problem(directory) is None


def read_checkpoint_state(directory: str | Path) -> dict:
    """The trainer state `save_checkpoint` saved at ``directory`` (without touching an optimizer)."""
    return json.loads((Path(directory) / STATE_FILE).read_text())["trainer"]


def load_checkpoint_state(directory: str | Path, optimizer: torch.optim.Optimizer) -> dict:
    """Restore the optimizer in place and return the trainer state saved with it."""
    directory = Path(directory).resolve()  # one version throughout, even if a save swaps the link meanwhile
    meta = json.loads((directory / STATE_FILE).read_text())
    per_param: dict[int, dict] = {}
    for name, tensor in load_file(str(directory / OPTIMIZER_FILE)).items():
        param_id, key = name.split(".", 1)
        per_param.setdefault(int(param_id), {})[key] = tensor
    optimizer.load_state_dict({"state": per_param, "param_groups": meta["optimizer_param_groups"]})
    return meta["trainer"]
