"""What the training recipes share when they run: loading a model named by an option, resuming, and the
command's course (options -> checks before any model -> training -> one-line errors). Their options are
in `logitless.recipes.config`."""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from logitless.checkpoint import checkpoint_step, last_complete_checkpoint
from logitless.models import EMBEDDED_MODELS, load_model_and_tokenizer
from logitless.nonfinite import NonFiniteError
from logitless.recipes.options import option_error, option_fields
from logitless.rundir import RunDirectory, file_identity

NONFINITE_ADVICE = "Lower --learning-rate, or pass --on-nonfinite skip to skip such steps."


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


@dataclass
class RunPlan:
    """What a recipe's ``prepare_*`` checked and claimed, before any model is loaded: its config, the run
    directory, the checkpoint to resume from (None: from the start) and the options a resume was allowed to
    change (name -> [before, now])."""

    config: object
    run: RunDirectory
    checkpoint: Path | None
    changes: dict[str, list]
    finished: str | None = None  # for a run at its last step already, what to say instead of loading anything


def check_model_sources(config) -> None:
    """Every model the config names (its ``MODEL_OPTIONS`` that are set) can be loaded from where it says."""
    for field in type(config).MODEL_OPTIONS:
        if getattr(config, field) is not None:
            check_model_source(field, getattr(config, field))


def claim_run(command: str, config, outputs: tuple[str, ...], result_options, fixed_options,
              before_start: Callable[[Path | None], None] | None = None) -> RunPlan:
    """Claim ``config.output_dir`` for ``command``, find the checkpoint to resume from and record the config's
    options (the data file by its identity), refusing a resume whose result options changed unless
    ``allow_changed`` names them; ``before_start`` gets the checkpoint first (a check that depends on it). The
    directory is released if anything fails."""
    run = RunDirectory.claim(config.output_dir, command, outputs=outputs, overwrite=config.overwrite)
    with run.released_on_error():
        checkpoint = resume_checkpoint(command, run.path, config)
        options = {**dataclasses.asdict(config), "data": file_identity(config.data)}
        defaults = {field.name: field.default for field in dataclasses.fields(config)
                    if field.default is not dataclasses.MISSING}  # of options a run begun before them ran without
        if checkpoint is not None and checkpoint_step(checkpoint) == config.steps:  # compared, not recorded
            changes = run.resume_changes(options, result_options=result_options, fixed_options=fixed_options,
                                         allow_changed=config.allow_changed, defaults=defaults)
            return RunPlan(config, run, checkpoint, changes, finished=nothing_left(command, run.path, config.steps))
        if before_start is not None:
            before_start(checkpoint)
        changes = run.start(options, resume=checkpoint is not None, result_options=result_options,
                            fixed_options=fixed_options, allow_changed=config.allow_changed,
                            step=None if checkpoint is None else checkpoint_step(checkpoint), defaults=defaults)
    return RunPlan(config, run, checkpoint, changes)


def nothing_left(command: str, run_dir: Path, steps: int) -> str:
    """What the rerun of a run that reached its last step says instead of loading, training or writing anything."""
    return f"logitless {command}: the run in {run_dir} is already at step {steps} of {steps}; nothing left to train"


def announce_start(command: str, checkpoint: Path | None) -> None:
    """Say where training starts when it resumes: "resuming from step 2 (runs/g/checkpoint-2)"."""
    if checkpoint is not None:
        print(f"logitless {command}: resuming from step {checkpoint_step(checkpoint)} ({checkpoint})")


def load_model(field: str, name: str, seed: int):
    """`load_model_and_tokenizer`, with a failure reported as a ValueError naming ``field``, and a model whose logits
    logitless cannot compute from its hidden states refused (`logitless.hf_probe.check_head`)."""
    from logitless.hf_probe import check_head  # PyTorch: not before the command's checks

    try:
        model, tokenizer = load_model_and_tokenizer(str(Path(name).expanduser()) if name.startswith("~") else name,
                                                    seed=seed)
    except (OSError, ValueError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"{field}: cannot load {name!r} as a local model directory or a hub model "
                         f"({first_line})") from None
    check_head(model, "logitless's commands train only models they score from hidden states (TRL's own trainers "
                      "run the model's own forward)", field)
    return model, tokenizer


def run_recipe(command: str, config, args: argparse.Namespace, prepare, train):
    """(plan, history) of ``train(prepare(config))`` for ``logitless COMMAND``, where ``prepare`` makes every
    check that needs no model. Bad data, output directories and models, and a non-finite step, end the
    command with one line that names the option (or says what stopped): at training, the errors of models
    that cannot be loaded or do not fit, which name one of the config's ``MODEL_OPTIONS``. A run that is
    finished already (``plan.finished``) says so and trains nothing: the history is None."""
    names = option_fields(type(config), args)
    try:
        plan = prepare(config)
    except (TypeError, ValueError) as err:
        raise option_error(err, names) from None
    if plan.finished:
        print(plan.finished)
        return plan, None
    try:
        return plan, train(plan)
    except NonFiniteError as err:
        raise SystemExit(f"logitless {command}: {err}") from None
    except ValueError as err:  # any other is a bug, with its traceback
        if str(err).partition(": ")[0] in type(config).MODEL_OPTIONS:
            raise option_error(err, names) from None
        raise


# what a line of each command's data holds: (the keys it has, what it is)
DATA_KINDS = {"grpo": (("question", "choices", "answer"), "multiple-choice questions"),
              "sft": (("prompt", "response"), "(prompt, response) pairs"),
              "grade": (("prompt",), "prompts")}


def refuse_other_commands_data(field: str, path: str | Path, command: str, kind: str) -> None:
    """A jsonl file (option ``field``) whose first line is plainly another command's data, not of ``kind``, is
    refused by name: `logitless grade` given an SFT file would train on its prompts and ignore the responses."""
    from logitless.records import read_jsonl

    if not Path(path).is_file():
        return  # a directory or a hub dataset: its loader checks it
    _, first = next(iter(read_jsonl(path, field)), (None, {}))
    found = next((name for name, (keys, _) in DATA_KINDS.items() if set(keys) <= set(first)), None)
    if found is not None and found != kind:
        keys, what = DATA_KINDS[kind]
        raise ValueError(f"{field}: {path} holds {DATA_KINDS[found][1]} ({', '.join(DATA_KINDS[found][0])}), the data "
                         f"of `logitless {found}`; `logitless {command}` reads {what} ({', '.join(keys)} per line)")


def loading_snippet(output_dir: Path) -> str:
    """The lines of a run card (README.md in a run directory) that load a checkpoint of the run."""
    return f"""```python
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("{output_dir}/checkpoint-STEP")
tokenizer = AutoTokenizer.from_pretrained("{output_dir}/checkpoint-STEP")
```
"""


def curve_line(what: str, values: list[float], history: dict, plot: Path, digits: int = 4) -> str:
    """A run's last line: "WHAT first -> last over N steps[; K steps skipped (not finite)]; plot: PLOT"."""
    return (f"{what} {values[0]:.{digits}f} -> {values[-1]:.{digits}f} over {plural(len(values), 'step')}"
            f"{skipped_note(history)}; plot: {plot}")


def plural(count: int, noun: str) -> str:
    """"1 step", "2 steps"."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def skipped_note(history: dict) -> str:
    """"; N steps skipped (not finite)" for a history that skipped steps, else ""."""
    return f"; {plural(len(history['skipped']), 'step')} skipped (not finite)" if history["skipped"] else ""
