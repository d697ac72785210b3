"""Training checkpoints as safetensors + JSON (nothing pickled), written atomically.

A checkpoint directory holds the model and tokenizer (``save_pretrained``), the optimizer's
tensors (``optimizer.safetensors``) and everything else as JSON (``trainer_state.json``). It is
written to a temporary sibling and renamed into place, so a crash mid-save leaves the previous
checkpoint intact.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from logitless.models import save_model_and_tokenizer

STATE_FILE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.safetensors"


def save_checkpoint(directory: str | Path, model, tokenizer, optimizer: torch.optim.Optimizer, state: dict) -> Path:
    directory = Path(directory)
    staging = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    save_model_and_tokenizer(model, tokenizer, staging)
    optimizer_state = optimizer.state_dict()
    tensors = {f"{param_id}.{key}": value.detach().clone().contiguous()
               for param_id, param_state in optimizer_state["state"].items()
               for key, value in param_state.items() if isinstance(value, torch.Tensor)}
    save_file(tensors, str(staging / OPTIMIZER_FILE))
    meta = {"trainer": state, "optimizer_param_groups": optimizer_state["param_groups"]}
    (staging / STATE_FILE).write_text(json.dumps(meta, indent=2))
    if directory.exists():
        previous = directory.with_name(directory.name + ".old")
        shutil.rmtree(previous, ignore_errors=True)
        directory.rename(previous)
        staging.rename(directory)
        shutil.rmtree(previous)
    else:
        staging.rename(directory)
    return directory


def has_checkpoint(directory: str | Path) -> bool:
    return (Path(directory) / STATE_FILE).is_file()


def load_checkpoint_state(directory: str | Path, optimizer: torch.optim.Optimizer) -> dict:
    """Restore the optimizer in place and return the trainer state saved with it."""
    directory = Path(directory)
    meta = json.loads((directory / STATE_FILE).read_text())
    per_param: dict[int, dict] = {}
    for name, tensor in load_file(str(directory / OPTIMIZER_FILE)).items():
        param_id, key = name.split(".", 1)
        per_param.setdefault(int(param_id), {})[key] = tensor
    optimizer.load_state_dict({"state": per_param, "param_groups": meta["optimizer_param_groups"]})
    return meta["trainer"]
