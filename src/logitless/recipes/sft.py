"""Supervised fine-tuning on (prompt, response) pairs, logit-free, resumable.

Each optimizer step takes ``gradient_accumulation_steps`` microbatches; each microbatch is
tokenized with `tokenize_prompt_and_output`, scored with `get_response_log_probs` (fused: no
(B, T, V) logits) and trained with `sft_microbatch_train_step`. A checkpoint is written every
``save_every`` steps and at the end; a rerun with the same output_dir resumes from it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from logitless._checks import check_positive, check_positive_ints, dataclass_from_dict
from logitless.checkpoint import has_checkpoint, load_checkpoint_state, save_checkpoint
from logitless.data import arithmetic_sft_examples, iterate_batches, load_jsonl, tokenize_prompt_and_output
from logitless.logprobs import get_response_log_probs
from logitless.losses import sft_microbatch_train_step
from logitless.masked import masked_mean
from logitless.models import load_model_and_tokenizer
from logitless.plots import plot_curve


@dataclass
class SFTConfig:
    model: str = "tiny-qwen2"  # hub id, local directory, or the embedded default
    data: str | None = None  # jsonl with prompt/response; None: the built-in arithmetic set
    output_dir: str = "runs/sft"
    steps: int = 40
    batch_size: int = 8
    gradient_accumulation_steps: int = 1
    learning_rate: float = 3e-3
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    save_every: int = 20
    seed: int = 0
    resume: bool = True

    def __post_init__(self):
        check_positive_ints(self, ("steps", "batch_size", "gradient_accumulation_steps", "save_every"))
        for name in ("learning_rate", "max_grad_norm"):
            check_positive(name, getattr(self, name))

    @classmethod
    def from_dict(cls, values: dict) -> SFTConfig:
        return dataclass_from_dict(cls, values)


def train_sft(config: SFTConfig, *, progress: bool = True) -> dict:
    """Run SFT; returns the history {"loss": [...], "entropy": [...], "step": last step, "seconds"}."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own bar is the one to watch; theirs flash on every save/load
    output_dir = Path(config.output_dir)
    checkpoint_dir = output_dir / "checkpoint"
    resuming = config.resume and has_checkpoint(checkpoint_dir)
    torch.manual_seed(config.seed)
    model, tokenizer = load_model_and_tokenizer(str(checkpoint_dir) if resuming else config.model, seed=config.seed)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay)
    history = {"loss": [], "entropy": [], "step": 0, "seconds": 0.0}
    if resuming:
        history = load_checkpoint_state(checkpoint_dir, optimizer)
    examples = load_jsonl(config.data) if config.data else arithmetic_sft_examples(seed=config.seed)
    if len(examples) < config.batch_size:
        raise ValueError(f"batch_size: {config.batch_size} exceeds the {len(examples)} examples in the data")
    batches = iterate_batches(examples, config.batch_size, seed=config.seed)
    for _ in range(history["step"] * config.gradient_accumulation_steps):  # same data order after a resume
        next(batches)

    started = time.perf_counter() - history["seconds"]
    bar = tqdm(range(history["step"], config.steps), initial=history["step"], total=config.steps,
               desc="sft", disable=not progress, unit="step")
    for step in bar:
        step_loss = step_entropy = 0.0
        for _ in range(config.gradient_accumulation_steps):
            batch = next(batches)
            tensors = tokenize_prompt_and_output([e["prompt"] for e in batch], [e["response"] for e in batch], tokenizer)
            scored = get_response_log_probs(model, tensors["input_ids"], tensors["labels"], return_token_entropy=True)
            mask = tensors["response_mask"]
            tokens_per_sequence = float(mask.sum(dim=-1).mean())
            _, meta = sft_microbatch_train_step(scored["log_probs"], mask, config.gradient_accumulation_steps,
                                                normalize_constant=tokens_per_sequence)
            step_loss += meta["mean_token_nll"].item() / config.gradient_accumulation_steps
            step_entropy += masked_mean(scored["token_entropy"].detach(), mask).item() / config.gradient_accumulation_steps
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        history["loss"].append(step_loss)
        history["entropy"].append(step_entropy)
        history["step"] = step + 1
        history["seconds"] = time.perf_counter() - started
        bar.set_postfix(loss=f"{step_loss:.3f}", entropy=f"{step_entropy:.2f}")
        if history["step"] % config.save_every == 0 or history["step"] == config.steps:
            save_checkpoint(checkpoint_dir, model, tokenizer, optimizer, history)
    bar.close()

    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "history.json").write_text(json.dumps(history, indent=2))
    plot_curve(history["loss"], output_dir / "loss.png", title="SFT loss (mean token NLL on responses)",
               ylabel="loss (nats/token)")
    return history
