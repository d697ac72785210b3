"""`logitless grade`: GRADE (or the GRPO baseline) on prompts with a differentiable reward.

Each method writes into OUTPUT_DIR/METHOD/: ``metrics.jsonl`` (one row per optimizer step, the names of
`logitless.grade.METRIC_NAMES`), ``reward.png`` and ``kl.png``, and ``checkpoint/`` (written every
``save_every`` steps and at the end; complete or absent whatever the moment of a crash). OUTPUT_DIR is
claimed as a run directory (`logitless.rundir`) before any model loads. A rerun with the same output dir
resumes each method from its checkpoint and ends with the weights an uninterrupted run would have; a
resume with options that change the result is refused unless ``allow_changed`` names them, or
``--no-resume`` starts over. A NaN or infinite loss or gradient stops the run before that step is
applied or saved (``on_nonfinite``). ``--method all`` runs the five methods one after another and adds
OUTPUT_DIR/reward_by_method.png.

The default needs nothing downloaded: the embedded tiny Qwen2 (random weights, the real 151,936-token
vocabulary) learns to write capitalized words (" The", " Paris"): the reward is the fraction of its
generated tokens that are one.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from logitless._checks import check_choice, check_positive_ints, check_strings
from logitless.grade.config import GradeConfig
from logitless.recipes.common import RUN_CONTROL_HELP, check_model_name, load_model
from logitless.recipes.options import load_config, option_error
from logitless.rundir import RunDirectory, file_identity, write_text_atomically

# method -> (trainer class name in logitless.grade, GradeConfig.method)
METHODS = {"gumbel": ("GumbelTrainerMemoryEfficient", "gumbel"), "ste": ("GumbelTrainerMemoryEfficient", "ste"),
           "gumbel_legacy": ("GumbelTrainer", "gumbel"), "ste_legacy": ("GumbelTrainer", "ste"),
           "grpo": ("GRPOBaseline", "gumbel")}
REWARDS = ("capitalized", "words", "token", "classifier", "judge")
DEFAULT_PROMPTS = ["Once upon a time", "The weather today is", "My favourite food is", "Yesterday I went to",
                   "The best way to learn is", "In the morning", "A good friend", "The city at night",
                   "When I was young", "The meeting is about", "Dear diary,", "The recipe needs",
                   "Our team will", "The old house", "Scientists found that", "Tomorrow we will"]
# The recipe's defaults: a run that shows the reward rising within a few minutes on a CPU.
RUN_DEFAULTS = dict(gumbel_topk=1024, max_new_tokens=12, batch_size=4, learning_rate=1e-2, kl_coef=0.02,
                    tau_start=1.0, tau_end=0.5, tau_anneal_steps=30)


@dataclass
class GradeRunConfig:
    method: str = "gumbel"  # gumbel | ste | gumbel_legacy | ste_legacy | grpo | all
    model: str = "tiny-qwen2"  # hub id, local directory, or the embedded default
    reward: str = "capitalized"  # capitalized | words | token | classifier | judge
    reward_model: str | None = None  # token/judge: a causal LM (default: a frozen copy of the initial policy); classifier: required
    reward_words: list[str] = field(default_factory=lambda: [" good", " great"])  # reward "words"
    reward_token: str = " yes"  # reward "token": its log-probability after the completion ...
    reward_suffix: str = "\nIs this a good answer?"  # ... and this text
    data: str | None = None  # jsonl of {"prompt": ...} (judge: question/choices/answer); None: built-in prompts
    output_dir: str = "runs/grade"
    steps: int = 20
    save_every: int = 10
    resume: bool = True
    overwrite: bool = False  # write into a non-empty directory no logitless run claimed
    allow_changed: tuple[str, ...] = ()  # options a resume may change (recorded in the run directory)
    grade: GradeConfig = field(default_factory=lambda: GradeConfig(**RUN_DEFAULTS))

    def __post_init__(self):
        check_choice("method", self.method, (*METHODS, "all"))
        check_choice("reward", self.reward, REWARDS)
        check_positive_ints(self, ("steps", "save_every"))
        check_strings("reward_words", self.reward_words)
        check_model_name("model", self.model)
        if self.reward_model is not None:
            check_model_name("reward_model", self.reward_model)
        if isinstance(self.allow_changed, str) or not all(isinstance(n, str) for n in self.allow_changed):
            raise TypeError(f"allow_changed: expected a list of option names, got {self.allow_changed!r}")
        self.allow_changed = tuple(self.allow_changed)
        if self.reward == "classifier" and not self.reward_model:
            raise ValueError("reward_model: a sequence classifier (hub id or directory) is required for reward "
                             "'classifier'")

    @classmethod
    def from_dict(cls, values: dict) -> GradeRunConfig:
        """Flat keys: GradeRunConfig's own fields and GradeConfig's (``method`` is the run's)."""
        own = {f.name for f in dataclasses.fields(cls)} - {"grade"}
        grade_fields = {f.name for f in dataclasses.fields(GradeConfig)} - {"method"}
        unknown = sorted(set(values) - own - grade_fields)
        if unknown:
            raise ValueError(f"config: unknown key(s) {unknown}; known: {sorted(own | grade_fields)}")
        grade = GradeConfig(**{**RUN_DEFAULTS, **{k: v for k, v in values.items() if k in grade_fields}})
        return cls(**{k: v for k, v in values.items() if k in own}, grade=grade)

    def recorded_options(self) -> dict:
        """Every option by its flat name, as the run directory records and compares them."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "grade"}
        values.update((f.name, getattr(self.grade, f.name)) for f in dataclasses.fields(GradeConfig) if f.name != "method")
        values["data"] = file_identity(self.data)
        return json.loads(json.dumps(values))


# Options that change a method's trained weights: a resume refuses a change unless allowed. Not among them:
# method (each has its own directory), steps (the learning rate is constant and tau follows its own
# schedule, so more steps continue the run), and what only steers the run.
STEERING_OPTIONS = ("method", "output_dir", "steps", "save_every", "resume", "overwrite", "allow_changed",
                    "on_nonfinite", "activation_checkpointing")
FIXED_OPTIONS = ("model",)  # a resume continues the checkpoint's weights: a new model cannot take effect


def claim_run_directory(run: GradeRunConfig, methods: list[str]):
    """Claim OUTPUT_DIR and record this run's options (refusing changed ones on a resume): before any model loads."""
    from logitless.checkpoint import checkpoint_problem

    directory = RunDirectory.claim(run.output_dir, "grade", outputs=(*METHODS, "reward_by_method.png"),
                                   overwrite=run.overwrite)
    resuming = run.resume and any(checkpoint_problem(directory.path / m / "checkpoint") is None for m in methods)
    options = run.recorded_options()
    directory.start(options, resume=resuming, result_options=[n for n in options if n not in STEERING_OPTIONS],
                    fixed_options=FIXED_OPTIONS, allow_changed=run.allow_changed)
    return directory


def step_prompts(records: list[dict], count: int, seed: int, step: int) -> list[dict]:
    """The prompts of one optimizer step: a function of (seed, step) only, so a resumed run sees the same."""
    rng = random.Random(f"{seed}:{step}")
    return rng.sample(records, count) if count <= len(records) else rng.choices(records, k=count)


def load_prompts(run: GradeRunConfig) -> list[dict]:
    from logitless.data import read_jsonl
    from logitless.multichoice.data import load_multichoice, synthetic_multichoice

    if run.reward == "judge":
        return load_multichoice(run.data) if run.data else synthetic_multichoice(count=64, seed=run.grade.seed)
    if not run.data:
        return [{"prompt": text} for text in DEFAULT_PROMPTS]
    records = []
    for where, record in read_jsonl(run.data, "data"):
        if not isinstance(record.get("prompt"), str):
            raise ValueError(f"data: {where} has no 'prompt' string")
        records.append(record)
    if not records:
        raise ValueError(f"data: {run.data} holds no prompts")
    return records


def build_reward(run: GradeRunConfig, tokenizer, initial_policy):
    """The reward the run trains on; model-based ones default to a frozen copy of the initial policy."""
    from logitless import grade

    if run.reward == "capitalized":
        return grade.TokenSetReward.capitalized_words(tokenizer)
    if run.reward == "words":
        return grade.TokenSetReward.from_words(tokenizer, run.reward_words)
    if run.reward == "classifier":
        from transformers import AutoModelForSequenceClassification

        return grade.SequenceClassifierReward(AutoModelForSequenceClassification.from_pretrained(run.reward_model))
    model = load_model("reward_model", run.reward_model, 0)[0] if run.reward_model else copy.deepcopy(initial_policy)
    if run.reward == "token":
        return grade.TokenLogProbReward(model, tokenizer, token=run.reward_token, suffix=run.reward_suffix)
    from logitless.multichoice.reward import MultichoiceJudge

    return grade.MultichoiceJudgeReward(MultichoiceJudge(model, tokenizer))


def run_method(run: GradeRunConfig, method: str, records: list[dict], *, progress: bool = True) -> list[dict]:
    """Train one method for ``run.steps`` optimizer steps (resuming from its checkpoint if it has a complete
    one); returns the metric rows. ``run.output_dir`` must be claimed (`claim_run_directory`)."""
    from tqdm.auto import tqdm
    from transformers.utils import logging as hf_logging

    from logitless import grade
    from logitless.checkpoint import checkpoint_problem, load_checkpoint_state, save_checkpoint
    from logitless.grade.lora import load_adapter
    from logitless.plots import plot_curve

    hf_logging.disable_progress_bar()
    directory = Path(run.output_dir) / method
    checkpoint_dir = directory / "checkpoint"
    problem = checkpoint_problem(checkpoint_dir)
    resuming = run.resume and problem is None
    if run.resume and problem is not None and (checkpoint_dir.exists() or checkpoint_dir.is_symlink()):
        print(f"logitless grade: skipping incomplete checkpoint {checkpoint_dir}: {problem}; {method} starts at step 0")
    seed = run.grade.seed
    reference, tokenizer = load_model("model", run.model, seed)
    lora = run.grade.lora_rank > 0  # a LoRA checkpoint holds the adapters only: loaded after wrapping
    policy = (load_model("model", str(checkpoint_dir), seed)[0] if resuming and not lora
              else copy.deepcopy(reference))
    trainer_name, grade_method = METHODS[method]
    trainer = getattr(grade, trainer_name)(policy, build_reward(run, tokenizer, reference),
                                           dataclasses.replace(run.grade, method=grade_method), tokenizer=tokenizer,
                                           reference=reference)
    history: list[dict] = []
    if resuming:
        state = load_checkpoint_state(checkpoint_dir, trainer.optimizer)
        for group in trainer.optimizer.param_groups:  # the value now in force (equal, or a change that was allowed)
            group["lr"] = run.grade.learning_rate
        trainer.step, history = state["step"], state["history"]
        if lora:
            load_adapter(trainer.model, checkpoint_dir)
    directory.mkdir(parents=True, exist_ok=True)
    metrics_path = directory / "metrics.jsonl"  # rows past the checkpoint (from a crashed run) are dropped
    write_text_atomically(metrics_path, "".join(json.dumps(row) + "\n" for row in history))
    per_step = run.grade.batch_size * run.grade.gradient_accumulation_steps
    bar = tqdm(range(trainer.step, run.steps), initial=trainer.step, total=run.steps, desc=f"grade {method}",
               unit="step", disable=not progress)
    with metrics_path.open("a") as metrics_file:
        for step in bar:
            row = trainer.train_step(step_prompts(records, per_step, seed, step))
            history.append(row)
            metrics_file.write(json.dumps(row) + "\n")
            metrics_file.flush()
            bar.set_postfix(reward=f"{row['reward']:.3f}", kl=f"{row['kl']:.3f}")
            if trainer.step % run.save_every == 0 or trainer.step == run.steps:
                save_checkpoint(checkpoint_dir, trainer.model, tokenizer, trainer.optimizer,
                                {"step": trainer.step, "history": history})
    bar.close()
    title = f"{method}: reward ({getattr(trainer.reward, 'description', run.reward)})"
    plot_curve([row["reward"] for row in history], directory / "reward.png", title=title, ylabel="mean reward")
    plot_curve([row["kl"] for row in history], directory / "kl.png", title=f"{method}: KL(policy || reference)",
               ylabel="KL per rollout (nats)")
    return history


def prepare_grade(run: GradeRunConfig) -> tuple[list[str], list[dict]]:
    """(methods, prompt records): every check that needs no model, and the run directory claimed. Raises
    ValueError naming the option at fault."""
    methods = list(METHODS) if run.method == "all" else [run.method]
    records = load_prompts(run)
    claim_run_directory(run, methods)
    return methods, records


def train_grade(run: GradeRunConfig, methods: list[str], records: list[dict], *,
                progress: bool = True) -> dict[str, list[dict]]:
    from logitless.plots import plot_curves

    histories = {method: run_method(run, method, records, progress=progress) for method in methods}
    if len(methods) > 1:
        plot_curves({m: [row["reward"] for row in h] for m, h in histories.items()},
                    Path(run.output_dir) / "reward_by_method.png",
                    title="reward per step (gumbel, gumbel_legacy: of the soft samples)", ylabel="mean reward")
    return histories


def run_grade(run: GradeRunConfig, *, progress: bool = True) -> dict[str, list[dict]]:
    """Run ``run.method`` (or every method for "all"); returns each method's metric rows."""
    return train_grade(run, *prepare_grade(run), progress=progress)


# ---- command line ------------------------------------------------------------------------------------------

_RUN_OPTIONS = {  # option -> (type, help); defaults come from the dataclasses
    "model": (str, "hub id, local model directory, or 'tiny-qwen2'"),
    "reward": (str, "capitalized | words | token | classifier | judge"),
    "reward_model": (str, "token/judge: causal LM (default: frozen copy of the initial policy); classifier: required"),
    "reward_token": (str, "reward 'token': the token whose log-probability is the reward"),
    "reward_suffix": (str, "reward 'token': text appended after the completion"),
    "data": (str, "jsonl with a 'prompt' per line (judge: question/choices/answer); default: built-in prompts"),
    "output_dir": (str, "each method writes OUTPUT_DIR/METHOD"),
    "steps": (int, "optimizer steps"),
    "save_every": (int, "checkpoint every this many steps (and at the end)"),
}
_GRADE_OPTIONS = {
    "gumbel_topk": (int, "tokens kept per step by the memory-efficient trainer"),
    "tau_start": (float, "Gumbel-softmax temperature at step 0"),
    "tau_end": (float, "temperature reached after tau_anneal_steps (geometric annealing)"),
    "tau_anneal_steps": (int, "steps to anneal tau over"),
    "max_new_tokens": (int, "tokens per rollout"),
    "batch_size": (int, "rollouts per microbatch"),
    "gradient_accumulation_steps": (int, "microbatches per optimizer step"),
    "kl_coef": (float, "weight of KL(policy || reference) in the loss"),
    "learning_rate": (float, "AdamW learning rate"),
    "max_grad_norm": (float, "gradient clipping norm"),
    "grpo_group_size": (int, "GRPO: completions per prompt"),
    "lora_rank": (int, "> 0: train LoRA adapters of this rank (needs peft) instead of every weight; 0: off"),
    "lora_alpha": (float, "LoRA scaling alpha"),
    "seed": (int, "seed of the model, the prompts and the Gumbel noise"),
    "on_nonfinite": (str, RUN_CONTROL_HELP["on_nonfinite"]),
}


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``logitless grade`` on the CLI's subparsers."""
    run_defaults, grade_defaults = GradeRunConfig(), GradeConfig(**RUN_DEFAULTS)
    parser = subparsers.add_parser("grade", help="GRADE: backprop a differentiable reward through Gumbel-softmax "
                                                 "rollouts (and the GRPO baseline), resumable")
    parser.add_argument("--method", help=f"{' | '.join(METHODS)} | all (default {run_defaults.method})")
    parser.add_argument("--config", help="YAML file of GradeRunConfig and GradeConfig fields; command-line options win (default: none)")
    for options, defaults in ((_RUN_OPTIONS, run_defaults), (_GRADE_OPTIONS, grade_defaults)):
        for name, (kind, text) in options.items():
            parser.add_argument(f"--{name.replace('_', '-')}", dest=name, type=kind,
                                help=f"{text} (default {getattr(defaults, name)!r})")
    parser.add_argument("--reward-words", dest="reward_words", nargs="+",
                        help=f"reward 'words': single-token words (default {run_defaults.reward_words!r})")
    parser.add_argument("--no-activation-checkpointing", dest="activation_checkpointing", action="store_const",
                        const=False, help="keep each decode step's activations instead of recomputing them "
                                          "(default: checkpointing on)")
    parser.add_argument("--no-resume", dest="resume", action="store_const", const=False,
                        help="start over: every method's earlier outputs in OUTPUT_DIR are replaced (default: resume "
                             "each method from its checkpoint)")
    parser.add_argument("--overwrite", action="store_const", const=True, help=RUN_CONTROL_HELP["overwrite"])
    parser.add_argument("--allow-changed", dest="allow_changed", nargs="+", metavar="OPTION",
                        help=RUN_CONTROL_HELP["allow_changed"])
    parser.set_defaults(handler=main)
    return parser


def main(args: argparse.Namespace) -> int:
    from logitless.nonfinite import NonFiniteError

    names = ("method", *_RUN_OPTIONS, *_GRADE_OPTIONS, "reward_words", "activation_checkpointing", "resume",
             "overwrite", "allow_changed")
    overrides = {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}
    try:
        run = GradeRunConfig.from_dict({**load_config(args.config), **overrides})
        methods, records = prepare_grade(run)
    except (TypeError, ValueError) as err:
        raise option_error(err, ["config", *names]) from None
    try:
        histories = train_grade(run, methods, records)
    except NonFiniteError as err:
        raise SystemExit(f"logitless grade: {err}") from None
    except ValueError as err:  # a model that cannot be loaded (`load_model`); any other is a bug, with its traceback
        if str(err).startswith(("model: ", "reward_model: ")):
            raise option_error(err, names) from None
        raise
    for method, history in histories.items():
        rewards = [row["reward"] for row in history]
        quarter = max(1, len(rewards) // 4)
        skipped = sum(bool(row["skipped"]) for row in history)
        print(f"{method}: reward {sum(rewards[:quarter]) / quarter:.4f} (first quarter) -> "
              f"{sum(rewards[-quarter:]) / quarter:.4f} (last quarter) over {len(rewards)} steps"
              f"{f'; {skipped} steps skipped (not finite)' if skipped else ''}; "
              f"{Path(run.output_dir) / method}/metrics.jsonl, reward.png")
    return 0
