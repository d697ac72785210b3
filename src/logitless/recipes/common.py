"""What the training recipes share: run-control options, loading a model named by an option, and the
command's course (options -> checks before any model -> training -> one-line errors)."""

from __future__ import annotations

import argparse
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from logitless._checks import check_choice, check_positive_int, dataclass_from_dict
from logitless.checkpoint import checkpoint_step, last_complete_checkpoint
from logitless.models import EMBEDDED_DEFAULT, EMBEDDED_MODELS, load_model_and_tokenizer
from logitless.nonfinite import POLICIES, NonFiniteError
from logitless.recipes.options import config_from_args, option_error, option_fields

MODEL_HELP = (f"hub id, local model directory, or an embedded model ({', '.join(EMBEDDED_MODELS)}: random weights, "
              "the real Qwen vocabulary; docs/models.md)")

# Options that steer the run, not its result: never compared on resume.
RUN_CONTROL_HELP = {
    "resume": "start over instead of resuming from the checkpoint in --output-dir; this run's earlier outputs "
              "there are replaced (default: resume)",
    "overwrite": "write into a non-empty --output-dir that no logitless run claimed, beside its files; refused "
                 "if one of them has a name this run writes (default: refuse such a directory)",
    "allow_changed": "options that change the result which a resume may change, spelled as options "
                     "(learning-rate) or fields (learning_rate), each change recorded in OUTPUT_DIR/logitless-run.json "
                     "(default: none; a changed one is refused)",
    "save_total_limit": "keep only the newest this many checkpoint-STEP directories (default: every one)",
    "on_nonfinite": "what a NaN or infinite loss or gradient does: 'stop' the run before that step is applied "
                    "or saved, or 'skip' the step",
}
NONFINITE_ADVICE = "Lower --learning-rate, or pass --on-nonfinite skip to skip such steps."


@dataclass
class RecipeConfig:
    """What every recipe's config has: the model, the seed, and the run-control fields (`RUN_CONTROL_HELP`),
    which steer the run but not its result and are never compared on resume."""

    model: str = "tiny-qwen2"  # hub id, local directory, or the embedded default
    seed: int = 0
    resume: bool = True
    overwrite: bool = False
    allow_changed: tuple[str, ...] = ()
    on_nonfinite: str = "stop"
    save_total_limit: int | None = None

    CHOICES = {"on_nonfinite": POLICIES}  # options with a fixed set of values, shown in the usage line
    METAVARS = {"allow_changed": "OPTION"}  # what an option's value is called in --help (default: FIELD_NAME)
    MODEL_OPTIONS = ("model",)  # options naming a model that training loads: errors that name them are the user's

    PATH_OPTIONS = ("output_dir", "data")  # paths ("~" expanded); data may be None (a built-in set)

    def __post_init__(self):
        check_model_name("model", self.model)
        for name in self.PATH_OPTIONS:
            value = getattr(self, name, None)
            if value is None and name == "data":
                continue
            if not isinstance(value, str) or not value.strip():
                raise TypeError(f"{name}: expected a path, got {value!r}")
            setattr(self, name, os.path.expanduser(value))
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise TypeError(f"seed: expected an int, got {self.seed!r}")
        for name in ("resume", "overwrite"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}: expected true or false, got {getattr(self, name)!r}")
        check_choice("on_nonfinite", self.on_nonfinite, POLICIES)
        self.allow_changed = field_names("allow_changed", self.allow_changed)
        if self.save_total_limit is not None:
            check_positive_int("save_total_limit", self.save_total_limit)

    @classmethod
    def from_dict(cls, values: dict):
        return dataclass_from_dict(cls, values)


def field_names(field: str, names) -> tuple[str, ...]:
    """Option names as typed (``--learning-rate``, ``learning-rate``) or as fields (``learning_rate``), as fields."""
    if isinstance(names, str) or not all(isinstance(name, str) for name in names):
        raise TypeError(f"{field}: expected a list of option names, got {names!r}")
    return tuple(name.lstrip("-").replace("-", "_") for name in names)


def hub_reachable() -> bool:
    """Whether the model hub answers a TCP connection within 3 s (False when HF_HUB_OFFLINE is set)."""
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
        return False
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=3).close()
        return True
    except OSError:
        return False


def check_model_source(field: str, name: str) -> None:
    """Fail in seconds, naming ``field``, for a model name that is not an embedded model, not a local
    directory, and cannot be loaded from the hub: not a hub id, or the hub unreachable and the model not
    in the local cache. (Loading would otherwise spend a minute on retries before saying the same.)"""
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if name in EMBEDDED_MODELS or Path(name).expanduser().is_dir():
        return
    try:
        validate_repo_id(name)
    except HFValidationError:
        raise ValueError(f"{field}: {name!r} is neither a local model directory nor a hub id ('org/name'); "
                         f"the embedded models are {', '.join(EMBEDDED_MODELS)}") from None
    if not hub_reachable() and not isinstance(try_to_load_from_cache(name, "config.json"), str):
        raise ValueError(f"{field}: {name!r} is not a local model directory, and the model hub is unreachable "
                         f"(offline) with no cached copy of it; the embedded models are "
                         f"{', '.join(EMBEDDED_MODELS)}")


def check_model_name(field: str, name) -> None:
    """A model name that is plainly a local path must exist (a hub id is only checked when loaded)."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"{field}: expected a hub id, a local model directory or {EMBEDDED_DEFAULT!r}, got {name!r}")
    if name.startswith((".", "/", "~")) and not Path(name).expanduser().is_dir():
        raise ValueError(f"{field}: no such model directory {name!r}")


def resume_checkpoint(command: str, run_dir: Path, config) -> Path | None:
    """The newest complete ``checkpoint-STEP`` in ``run_dir`` that ``config`` (``resume``, ``steps``) resumes
    from, or None; incomplete newer ones are named. A run already past ``--steps`` is refused: a shorter
    run cannot be had by resuming."""
    if not config.resume:
        return None
    checkpoint, skipped = last_complete_checkpoint(run_dir)
    for note in skipped:
        print(f"logitless {command}: {note}")
    if checkpoint is not None and checkpoint_step(checkpoint) > config.steps:
        raise ValueError(f"steps: the run in {run_dir} is already at step {checkpoint_step(checkpoint)}, past "
                         f"{config.steps}; pass a larger --steps to train on, or --no-resume to start over")
    return checkpoint


def announce_start(command: str, checkpoint: Path | None, steps: int) -> None:
    """Say where training starts: "resuming from step 2 (runs/g/checkpoint-2)", or that nothing is left."""
    if checkpoint is None:
        return
    done = checkpoint_step(checkpoint)
    print(f"logitless {command}: " + (f"resuming from step {done} ({checkpoint})" if done < steps else
                                     f"the run is already at step {done} of {steps}; nothing left to train"))


def load_model(field: str, name: str, seed: int):
    """`load_model_and_tokenizer`, with a failure reported as a ValueError naming ``field``."""
    try:
        return load_model_and_tokenizer(str(Path(name).expanduser()) if name.startswith("~") else name, seed=seed)
    except (OSError, ValueError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"{field}: cannot load {name!r} as a local model directory or a hub model "
                         f"({first_line})") from None


def run_recipe(command: str, args: argparse.Namespace, config_class, prepare, train):
    """(plan, history) of ``train(prepare(config))`` for ``logitless COMMAND``, where ``prepare`` makes every
    check that needs no model. Bad options, data, output directories and models, and a non-finite
    step, end the command with one line that names the option (or says what stopped): at training, the
    errors of models that cannot be loaded or do not fit, which name one of the config's ``MODEL_OPTIONS``."""
    config = config_from_args(config_class, args)
    names = option_fields(config_class, args)
    try:
        plan = prepare(config)
    except (TypeError, ValueError) as err:
        raise option_error(err, names) from None
    try:
        return plan, train(plan)
    except NonFiniteError as err:
        raise SystemExit(f"logitless {command}: {err}") from None
    except ValueError as err:  # any other is a bug, with its traceback
        if str(err).partition(": ")[0] in config_class.MODEL_OPTIONS:
            raise option_error(err, names) from None
        raise


def plural(count: int, noun: str) -> str:
    """"1 step", "2 steps"."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def skipped_note(history: dict) -> str:
    """"; N steps skipped (not finite)" for a history that skipped steps, else ""."""
    return f"; {plural(len(history['skipped']), 'step')} skipped (not finite)" if history["skipped"] else ""
