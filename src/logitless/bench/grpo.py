"""`logitless bench grpo`: a few GRPO steps of stock TRL GRPOTrainer and of GRPOTrainerWithLogits, per setup.

Same model (an embedded one: the tiny Qwen2 by default, or random weights at Qwen2.5-0.5B's shapes,
with the real 151,936-token Qwen vocabulary; or a local model directory), same prompts, same config,
each trainer in a fresh process: wall time of ``trainer.train()``, the part of it spent in the loss
and its backward (the rest is generation and rewards, the same work for both), and the peak memory
(`logitless.memory.PeakMemory`: resident memory on a CPU, allocated CUDA memory on a GPU) beyond what the
process held once the trainer was built and had run one forward of 8 tokens without gradient: the first-use head
check of GRPOTrainerWithLogits runs one, so both do, and the weights a checkpoint loads lazily are resident before
either measurement. Setups: ``default`` (GRPOConfig's defaults: loss_type dapo, no KL), ``lora`` (LoRA r=8 on the
attention projections) and ``cispo`` (a non-default loss type with a KL term, so a reference pass too).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

from logitless.bench.options import rows_so_far
from logitless.bench.ratios import add_ratios, trl_comparison_lines
from logitless.bench.timing import timed
from logitless.bench.worker import run_worker_process, worker_main
from logitless.models import EMBEDDED_DEFAULT

TRAINERS = ("trl", "logitless")
SETUPS = {"default": {}, "lora": {}, "cispo": {"loss_type": "cispo", "beta": 0.04}}  # GRPOConfig options


@dataclass
class GRPOBenchConfig:
    completions: int = 16  # per step
    completion_length: int = 128
    num_generations: int = 4
    steps: int = 3
    model: str = EMBEDDED_DEFAULT  # an embedded model (`models.EMBEDDED_MODELS`) or a local directory
    device: str = "cpu"  # cpu or cuda
    dtype: str = "float32"  # float32, or bfloat16 (TRL's bf16 mixed precision)
    setups: tuple[str, ...] = tuple(SETUPS)


def _prompts(count: int) -> list[str]:
    return [f"Question {i}: what is {i} + {2 * i}? Think, then answer." for i in range(count)]


CONFIG = GRPOBenchConfig  # what `logitless bench grpo` builds from its options


def run_worker(worker: str, model_dir: str, config: GRPOBenchConfig) -> dict:
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from logitless.hf_probe import probe_ids
    from logitless.memory import PeakMemory, synchronize
    from logitless.models import load_tokenizer
    from logitless.trl import GRPOTrainerWithLogits

    trainer_name, setup = worker.split(":")
    tokenizer = load_tokenizer(model_dir)
    cls = GRPOTrainer if trainer_name == "trl" else GRPOTrainerWithLogits
    extra = {}
    if setup == "lora":
        from peft import LoraConfig

        extra["peft_config"] = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    with tempfile.TemporaryDirectory() as output_dir:
        args = GRPOConfig(output_dir=output_dir, use_cpu=config.device == "cpu", bf16=config.dtype == "bfloat16",
                          activation_checkpointing=False,
                          per_device_train_batch_size=config.completions, num_generations=config.num_generations,
                          max_completion_length=config.completion_length, max_steps=config.steps, logging_steps=1,
                          report_to="none", save_strategy="no", seed=0, disable_dropout=True, learning_rate=1e-4,
                          disable_tqdm=True, **SETUPS[setup])
        prompts = _prompts(config.completions // config.num_generations * config.steps)
        torch.manual_seed(0)  # the same LoRA initialization for both trainers
        trainer = cls(model=model_dir, reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
                      args=args, train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tokenizer,
                      **extra)
        loss_seconds, device = [0.0], trainer.accelerator.device
        trainer.compute_loss = timed(trainer.compute_loss, loss_seconds, device)
        trainer.accelerator.backward = timed(trainer.accelerator.backward, loss_seconds, device)
        with torch.no_grad():  # the same start for both: GRPOTrainerWithLogits's first-use head check ran a forward
            trainer.model(input_ids=probe_ids(trainer.model), use_cache=False)  # (weights read lazily now resident)
        torch.manual_seed(0)
        with PeakMemory(device) as peak:
            started = time.perf_counter()
            trainer.train()
            synchronize(device)
            seconds = time.perf_counter() - started
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        grad_norms = [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]
        lengths = [entry["completions/mean_length"] for entry in trainer.state.log_history
                   if "completions/mean_length" in entry]
    return {"time_s": seconds, "loss_backward_s": loss_seconds[0], "peak_mb": peak.megabytes, "losses": losses,
            "grad_norms": grad_norms, "mean_completion_length": lengths}


def run(config: GRPOBenchConfig, progress: bool = True, *, concurrently: bool = False) -> dict:
    """Both trainers for each setup, each in a fresh process; ``concurrently`` runs a setup's two processes at once,
    which keeps each one's peak memory but makes their times compete (for a caller that reads only the memory)."""
    from concurrent.futures import ThreadPoolExecutor

    from tqdm.auto import tqdm

    from logitless.models import (EMBEDDED_MODELS, embedded_model, model_vocab_size, qwen_tokenizer,
                                  save_model_and_tokenizer)

    unknown = sorted(set(config.setups) - set(SETUPS))
    if unknown:
        raise ValueError(f"setups: unknown {unknown}; choose from {list(SETUPS)}")
    results = rows_so_far({})
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = config.model
        if config.model in EMBEDDED_MODELS:  # both trainers load the same saved weights
            model_dir = str(save_model_and_tokenizer(embedded_model(config.model, seed=0), qwen_tokenizer(), scratch))
        vocab_size = model_vocab_size(model_dir)

        def worker(name: str) -> dict:
            return run_worker_process("logitless.bench.grpo", ["--worker", name, "--model-dir", model_dir,
                                                               "--config", json.dumps(asdict(config))])

        bar = tqdm(total=len(config.setups) * len(TRAINERS), desc="bench grpo", disable=not progress)
        with ThreadPoolExecutor(max_workers=len(TRAINERS) if concurrently else 1) as pool:
            for setup in config.setups:
                names = [f"{trainer}:{setup}" for trainer in TRAINERS]
                results[setup] = dict(zip(TRAINERS, pool.map(worker, names)))
                add_ratios(results[setup], "trl")
                add_ratios(results[setup], "trl", time_key="loss_backward_s", ratio_key="loss_backward_ratio")
                bar.update(len(TRAINERS))
        bar.close()
    return {"config": asdict(config), "vocab_size": vocab_size, "results": results}


def format_table(report: dict) -> str:
    c = report["config"]
    lines = [f"{c['steps']} GRPO steps, {c['completions']} completions x {c['completion_length']} tokens per step, "
             f"{c['model']} (vocabulary {report['vocab_size']}), {c['device']}, {c['dtype']}",
             *trl_comparison_lines(report["results"], "time_s", "wall s", "setup", 1)]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(worker_main(run_worker, GRPOBenchConfig,
                         tuple(f"{t}:{s}" for s in SETUPS for t in TRAINERS), "--model-dir"))
