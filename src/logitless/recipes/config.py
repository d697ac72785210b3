"""What every recipe's options share: the model, the seed and the run-control options (`RecipeConfig`), with
their help texts. Nothing here loads PyTorch: options are checked before any model is."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from logitless._checks import check_choice, check_positive_int, dataclass_from_dict
from logitless.models import EMBEDDED_DEFAULT, EMBEDDED_MODELS
from logitless.nonfinite import POLICIES

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


def check_model_name(field: str, name) -> None:
    """A model name that is plainly a local path must be an existing directory (a hub id is only checked when
    loaded); an existing file is never a model."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"{field}: expected a hub id, a local model directory or {EMBEDDED_DEFAULT!r}, got {name!r}")
    if Path(name).expanduser().is_file():
        raise ValueError(f"{field}: {name!r} is a file, not a model directory")
    if name.startswith((".", "/", "~")) and not Path(name).expanduser().is_dir():
        raise ValueError(f"{field}: no such model directory {name!r}")
