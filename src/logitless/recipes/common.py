"""What the training recipes share: run-control options, loading a model named by an option, and the
command's course (options -> checks before any model -> training -> one-line errors)."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path

from logitless._checks import check_choice, dataclass_from_dict
from logitless.models import EMBEDDED_DEFAULT, load_model_and_tokenizer
from logitless.nonfinite import POLICIES, NonFiniteError
from logitless.recipes.options import config_from_args, option_error

# Options that steer the run, not its result: never compared on resume.
RUN_CONTROL_HELP = {
    "resume": "start over instead of resuming from the checkpoint in --output-dir; this run's earlier outputs "
              "there are replaced (default: resume)",
    "overwrite": "write into a non-empty --output-dir that no logitless run claimed, replacing the files with this "
                 "run's output names and leaving the others (default: refuse such a directory)",
    "allow_changed": "options that change the result which a resume may change, each change recorded in "
                     "OUTPUT_DIR/logitless-run.json (default: none; a changed one is refused)",
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

    def __post_init__(self):
        check_model_name("model", self.model)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise TypeError(f"seed: expected an int, got {self.seed!r}")
        for name in ("resume", "overwrite"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}: expected true or false, got {getattr(self, name)!r}")
        check_choice("on_nonfinite", self.on_nonfinite, POLICIES)
        if isinstance(self.allow_changed, str) or not all(isinstance(n, str) for n in self.allow_changed):
            raise TypeError(f"allow_changed: expected a list of option names, got {self.allow_changed!r}")
        self.allow_changed = tuple(self.allow_changed)

    @classmethod
    def from_dict(cls, values: dict):
        return dataclass_from_dict(cls, values)


def check_model_name(field: str, name) -> None:
    """A model name that is plainly a local path must exist (a hub id is only checked when loaded)."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"{field}: expected a hub id, a local model directory or {EMBEDDED_DEFAULT!r}, got {name!r}")
    if name.startswith((".", "/", "~")) and not Path(name).expanduser().is_dir():
        raise ValueError(f"{field}: no such model directory {name!r}")


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
    step, end the command with one line that names the option (or says what stopped)."""
    config = config_from_args(config_class, args)
    names = [field.name for field in dataclasses.fields(config_class)]
    try:
        plan = prepare(config)
    except (TypeError, ValueError) as err:
        raise option_error(err, names) from None
    try:
        return plan, train(plan)
    except NonFiniteError as err:
        raise SystemExit(f"logitless {command}: {err}") from None
    except ValueError as err:  # from `load_model`; any other is a bug, with its traceback
        if str(err).startswith(("model: ", "judge: ")):
            raise option_error(err, names) from None
        raise


def skipped_note(history: dict) -> str:
    """"; N steps skipped (not finite)" for a history that skipped steps, else ""."""
    return f"; {len(history['skipped'])} steps skipped (not finite)" if history["skipped"] else ""
