"""``make demo``: the embedded tiny Qwen2 (real 151,936-token Qwen vocabulary) trained on CPU, logit-free.

1. SFT on built-in multiple-choice questions answered as "... ANSWER: X" (progress bar, loss plot).
2. GRPO from that checkpoint with `GRPOTrainerWithLogits` and the judge reward
   ``P(correct | model) * (1 - P(correct | judge))``, the first factor read from the policy's own
   logits (no extra forward), the judge a frozen copy of the SFT model (reward plot).
3. A check that the fused log-probs equal the materialized ones on the trained model.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import torch

from logitless._checks import check_positive_ints
from logitless.data import tokenize_prompt_and_output
from logitless.recipes.grpo import MultichoiceGRPOConfig, train_grpo_multichoice
from logitless.logprobs import get_response_log_probs
from logitless.models import load_model_and_tokenizer
from logitless.multichoice.data import synthetic_multichoice
from logitless.recipes.warm_start import multichoice_sft_pairs, warm_start_policy


def _fused_matches_materialized(model_dir: Path) -> float:
    model, tokenizer = load_model_and_tokenizer(str(model_dir))
    pairs = multichoice_sft_pairs(synthetic_multichoice(count=8, seed=7))
    tensors = tokenize_prompt_and_output([p["prompt"] for p in pairs], [p["response"] for p in pairs], tokenizer)
    with torch.no_grad():
        fused = get_response_log_probs(model, tensors["input_ids"], tensors["labels"], True)
        materialized = get_response_log_probs(model, tensors["input_ids"], tensors["labels"], True,
                                              impl="materialized")
    shape = tuple(tensors["labels"].shape) + (model.config.vocab_size,)
    difference = (fused["log_probs"] - materialized["log_probs"]).abs().max().item()
    print(f"fused vs materialized on the trained policy: max |d log p| = {difference:.2e}, max |d entropy| = "
          f"{(fused['token_entropy'] - materialized['token_entropy']).abs().max().item():.2e}; the fused path "
          f"never built the {shape} fp32 logits ({torch.Size(shape).numel() * 4 / 2**20:.0f} MB)")
    return difference


MARKER = ".logitless-demo"  # written into the output directory: only such a directory is ever emptied
DEMO_OUTPUTS = {"sft", "grpo"}  # what the demo writes there (a directory holding only these is an earlier demo's)


def check_output_dir(output_dir: str) -> Path:
    """Raise unless ``output_dir`` is new, empty, or an earlier demo's output; touches nothing."""
    directory = Path(output_dir)
    if directory.exists():
        if not directory.is_dir():
            raise ValueError(f"output_dir: {output_dir} is a file, not a directory")
        entries = {entry.name for entry in directory.iterdir()}
        if not (MARKER in entries or entries <= DEMO_OUTPUTS):
            raise ValueError(f"output_dir: {output_dir} holds files the demo did not write; "
                             "choose a new or empty directory")
    return directory


def fresh_output_dir(output_dir: str) -> Path:
    """The demo always starts fresh, but only empties a directory that it created itself."""
    directory = check_output_dir(output_dir)
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    (directory / MARKER).write_text("written by `logitless demo`; the next demo run replaces this directory\n")
    return directory


def check_run_args(output_dir: str, steps: int, grpo_steps: int) -> None:
    """Raise ValueError naming the argument unless `run` can start with these; touches nothing."""
    check_positive_ints(SimpleNamespace(steps=steps, grpo_steps=grpo_steps), ("steps", "grpo_steps"))
    check_output_dir(output_dir)


def run(output_dir: str = "runs/demo", steps: int = 40, grpo_steps: int = 4) -> int:
    check_run_args(output_dir, steps, grpo_steps)
    directory = fresh_output_dir(output_dir)
    print(f"logitless demo 1/3: {steps} SFT steps of tiny-qwen2 (vocabulary 151,936) on multiple-choice answers")
    history = warm_start_policy(directory / "sft", steps=steps)
    first, last = history["loss"][0], history["loss"][-1]
    print(f"SFT loss {first:.3f} -> {last:.3f} nats/token in {history['seconds']:.1f}s; "
          f"plot: {directory / 'sft' / 'loss.png'}")

    print(f"logitless demo 2/3: {grpo_steps} GRPO steps with GRPOTrainerWithLogits and the multiple-choice judge "
          "reward (P(correct|model) read from the policy's own logits)")
    rewards = train_grpo_multichoice(MultichoiceGRPOConfig(model=str(directory / "sft" / "checkpoint"),
                                                           output_dir=str(directory / "grpo"), steps=grpo_steps,
                                                           save_every=grpo_steps))
    for step, (reward, p_model, p_judge) in enumerate(zip(rewards["reward"], rewards["p_correct_model"],
                                                          rewards["p_correct_judge"]), start=1):
        print(f"  step {step}: reward {reward:.4f} = mean of P(correct|model) {p_model:.3f} x "
              f"(1 - P(correct|judge) {p_judge:.3f}); entropy {rewards['entropy'][step - 1]:.3f}")
    print(f"plot: {directory / 'grpo' / 'reward.png'}")

    print("logitless demo 3/3: fused vs materialized")
    difference = _fused_matches_materialized(directory / "sft" / "checkpoint")
    if not last < first or difference > 1e-4 or len(rewards["reward"]) != grpo_steps:
        print("demo FAILED: the SFT loss did not fall, GRPO did not run every step, or the fused path disagrees")
        return 1
    return 0
