"""`logitless bench grpo`: a few GRPO steps of stock TRL GRPOTrainer and of GRPOTrainerWithLogits.

Same tiny Qwen2 (real 151,936-token Qwen vocabulary), same prompts, same config, each trainer in a
fresh process: wall time of ``trainer.train()`` and its peak resident memory beyond what the process
held once the trainer was built (`bench.memory.PeakMemory`).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

from logitless.bench.ratios import add_ratios, format_ratio
from logitless.bench.worker import run_worker_process, worker_main

TRAINERS = ("trl", "logitless")


@dataclass
class GRPOBenchConfig:
    completions: int = 16  # per step
    completion_length: int = 128
    num_generations: int = 4
    steps: int = 3
    hidden_size: int = 64


def _prompts(count: int) -> list[str]:
    return [f"Question {i}: what is {i} + {2 * i}? Think, then answer." for i in range(count)]


CONFIG = GRPOBenchConfig  # what `logitless bench grpo` builds from its options


def run_worker(trainer_name: str, model_dir: str, config: GRPOBenchConfig) -> dict:
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from logitless.bench.memory import PeakMemory
    from logitless.models import load_model_and_tokenizer
    from logitless.trl import GRPOTrainerWithLogits

    _, tokenizer = load_model_and_tokenizer(model_dir)
    cls = GRPOTrainer if trainer_name == "trl" else GRPOTrainerWithLogits
    with tempfile.TemporaryDirectory() as output_dir:
        args = GRPOConfig(output_dir=output_dir, use_cpu=True, bf16=False, activation_checkpointing=False,
                          per_device_train_batch_size=config.completions, num_generations=config.num_generations,
                          max_completion_length=config.completion_length, max_steps=config.steps, logging_steps=1,
                          report_to="none", save_strategy="no", seed=0, disable_dropout=True, learning_rate=1e-4,
                          disable_tqdm=True)
        prompts = _prompts(config.completions // config.num_generations * config.steps)
        trainer = cls(model=model_dir, reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
                      args=args, train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tokenizer)
        torch.manual_seed(0)
        with PeakMemory(torch.device("cpu")) as peak:
            started = time.perf_counter()
            trainer.train()
            seconds = time.perf_counter() - started
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        lengths = [entry["completions/mean_length"] for entry in trainer.state.log_history
                   if "completions/mean_length" in entry]
    return {"time_s": seconds, "peak_mb": peak.megabytes, "losses": losses, "mean_completion_length": lengths}


def run(config: GRPOBenchConfig, progress: bool = True, *, concurrently: bool = False) -> dict:
    """Both trainers, each in a fresh process; ``concurrently`` runs the two processes at once, which keeps
    each one's peak memory but makes their times compete (for a caller that reads only the memory)."""
    from concurrent.futures import ThreadPoolExecutor

    from tqdm.auto import tqdm

    from logitless.models import qwen_tokenizer, save_model_and_tokenizer, tiny_qwen2

    with tempfile.TemporaryDirectory() as scratch:
        save_model_and_tokenizer(tiny_qwen2(seed=0, hidden_size=config.hidden_size), qwen_tokenizer(), scratch)

        def worker(name: str) -> dict:
            return run_worker_process("logitless.bench.grpo", ["--worker", name, "--model-dir", scratch,
                                                               "--config", json.dumps(asdict(config))])

        with ThreadPoolExecutor(max_workers=len(TRAINERS) if concurrently else 1) as pool:
            results = dict(zip(TRAINERS, tqdm(pool.map(worker, TRAINERS), total=len(TRAINERS), desc="bench grpo",
                                              disable=not progress)))
    add_ratios(results, "trl")
    return {"config": asdict(config), "vocab_size": 151936, "results": results}


def format_table(report: dict) -> str:
    c = report["config"]
    lines = [f"{c['steps']} GRPO steps, {c['completions']} completions x {c['completion_length']} tokens per step, "
             f"tiny Qwen2 (hidden {c['hidden_size']}, vocabulary {report['vocab_size']}), CPU",
             f"{'trainer':<12}{'wall s':>9}{'x TRL':>7}{'peak MB':>10}{'x TRL':>7}  losses"]
    for name, r in report["results"].items():
        lines.append(f"{name:<12}{r['time_s']:>9.1f}{format_ratio(r['time_ratio'], 7)}{r['peak_mb']:>10.0f}{format_ratio(r['peak_ratio'], 7)}"
                     f"  {', '.join(f'{x:.4f}' for x in r['losses'])}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(worker_main(run_worker, GRPOBenchConfig, TRAINERS, "--model-dir"))
