"""``make demo``: SFT of the embedded tiny Qwen2 with the real 151k Qwen vocabulary, on CPU.

Shows the loss falling (progress bar + PNG), that the fused log-probs equal the materialized
ones, and how large the (B, T, V) logits would have been.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from logitless.data import arithmetic_sft_examples, tokenize_prompt_and_output
from logitless.logprobs import get_response_log_probs
from logitless.models import load_model_and_tokenizer
from logitless.sft import SFTConfig, train_sft


def _fused_matches_materialized(output_dir: Path) -> float:
    model, tokenizer = load_model_and_tokenizer(str(output_dir / "checkpoint"))
    batch = arithmetic_sft_examples(count=8, seed=1)
    tensors = tokenize_prompt_and_output([e["prompt"] for e in batch], [e["response"] for e in batch], tokenizer)
    with torch.no_grad():
        fused = get_response_log_probs(model, tensors["input_ids"], tensors["labels"], True)
        materialized = get_response_log_probs(model, tensors["input_ids"], tensors["labels"], True,
                                              impl="materialized")
    shape = tuple(tensors["labels"].shape) + (model.config.vocab_size,)
    print(f"fused vs materialized on the trained model: max |d log p| = "
          f"{(fused['log_probs'] - materialized['log_probs']).abs().max().item():.2e}, max |d entropy| = "
          f"{(fused['token_entropy'] - materialized['token_entropy']).abs().max().item():.2e}; "
          f"the fused path never built the {shape} fp32 logits ({torch.Size(shape).numel() * 4 / 2**20:.0f} MB)")
    return (fused["log_probs"] - materialized["log_probs"]).abs().max().item()


def run(output_dir: str = "runs/demo", steps: int = 40) -> int:
    directory = Path(output_dir)
    shutil.rmtree(directory / "checkpoint", ignore_errors=True)  # the demo always starts fresh
    print(f"logitless demo: {steps} SFT steps of tiny-qwen2 (vocabulary 151,936) on built-in arithmetic")
    history = train_sft(SFTConfig(output_dir=str(directory), steps=steps, save_every=steps))
    first, last = history["loss"][0], history["loss"][-1]
    print(f"loss {first:.3f} -> {last:.3f} nats/token in {history['seconds']:.1f}s; plot: {directory / 'loss.png'}")
    difference = _fused_matches_materialized(directory)
    if not last < first or difference > 1e-4:
        print("demo FAILED: the loss did not fall or the fused path disagrees")
        return 1
    return 0
