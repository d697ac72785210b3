"""`logitless bench reward`: the multiple-choice judge reward with and without completion_logits.

The same GRPO steps (GRPOTrainerWithLogits, a warm-started tiny Qwen2 policy that answers as
"ANSWER: <ordinal> X", the judge a frozen copy of it), in a fresh process each:

* logits    the reward declares ``completion_logits`` and reads P(correct | model) from the rows the
            trainer hands it (hidden states kept from generation);
* fallback  the reward does not declare it, so P(correct | model) is recomputed by the fallback: one
            more teacher-forced policy forward per completion, with (T, V) logits.

Reported per implementation: seconds spent inside the reward function, policy forward passes made
during it (counted by a hook on the policy's body; the judge is another model), and the peak memory
growth while it ran.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

from logitless.bench.ratios import add_ratios, format_ratio
from logitless.bench.worker import run_variants, worker_main

VARIANTS = ("fallback", "logits")


@dataclass
class RewardBenchConfig:
    """GRPO steps of ``completions`` completions of ``completion_length`` tokens, ``num_generations`` per prompt,
    from a policy warm-started for ``warm_start_steps`` SFT steps."""

    completions: int = 16
    completion_length: int = 32
    num_generations: int = 4
    steps: int = 2
    warm_start_steps: int = 40


CONFIG = RewardBenchConfig  # what `logitless bench reward` builds from its options


def run_worker(variant: str, policy_dir: str, config: RewardBenchConfig) -> dict:
    import torch
    from trl import GRPOConfig

    from logitless.memory import PeakMemory
    from logitless.models import load_model_and_tokenizer
    from logitless.multichoice.data import synthetic_multichoice, to_trl_dataset
    from logitless.multichoice.judge import MultichoiceJudge
    from logitless.multichoice.reward import multichoice_judge_reward
    from logitless.trl import GRPOTrainerWithLogits

    policy, tokenizer = load_model_and_tokenizer(policy_dir)
    judge_model, _ = load_model_and_tokenizer(policy_dir)
    reward = multichoice_judge_reward(MultichoiceJudge(judge_model, tokenizer), tokenizer, policy=policy)
    body = getattr(policy, policy.base_model_prefix)
    forwards = [0]
    body.register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    calls = []

    def measured(**kwargs):
        start = forwards[0]
        with PeakMemory(torch.device("cpu")) as peak:
            started = time.perf_counter()
            rewards = reward(**kwargs)
            seconds = time.perf_counter() - started
        calls.append({"seconds": seconds, "policy_forwards": forwards[0] - start, "peak_mb": peak.megabytes,
                      "mean_reward": sum(rewards) / len(rewards)})
        return rewards

    def reward_with_logits(prompts, completions, completion_ids, completion_logits, **kwargs):
        return measured(prompts=prompts, completions=completions, completion_ids=completion_ids,
                        completion_logits=completion_logits, **kwargs)

    def reward_recomputing(prompts, completions, completion_ids, **kwargs):
        return measured(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs)

    records = synthetic_multichoice(count=config.completions // config.num_generations * config.steps, seed=1)
    with tempfile.TemporaryDirectory() as output_dir:
        args = GRPOConfig(output_dir=output_dir, use_cpu=True, bf16=False, activation_checkpointing=False,
                          per_device_train_batch_size=config.completions, num_generations=config.num_generations,
                          max_completion_length=config.completion_length, max_steps=config.steps, report_to="none",
                          save_strategy="no", seed=0, disable_dropout=True, learning_rate=1e-5, disable_tqdm=True)
        trainer = GRPOTrainerWithLogits(
            model=policy, reward_funcs=reward_with_logits if variant == "logits" else reward_recomputing, args=args,
            train_dataset=to_trl_dataset(records), processing_class=tokenizer)
        torch.manual_seed(0)
        trainer.train()
    return {"reward_time_s": sum(c["seconds"] for c in calls),
            "policy_forwards": sum(c["policy_forwards"] for c in calls),
            "peak_mb": max(c["peak_mb"] for c in calls), "mean_reward": [c["mean_reward"] for c in calls],
            "reward_calls": len(calls)}


def run(config: RewardBenchConfig, progress: bool = True) -> dict:
    from logitless.multichoice.warm_start import warm_start_policy

    with tempfile.TemporaryDirectory() as scratch:
        _, policy_dir = warm_start_policy(scratch, steps=config.warm_start_steps, progress=False)
        results = run_variants("logitless.bench.reward", VARIANTS, ["--policy-dir", str(policy_dir), "--config",
                                                                    json.dumps(asdict(config))],
                               "bench reward", progress)
    add_ratios(results, "fallback", time_key="reward_time_s")
    return {"config": asdict(config), "results": results}


def format_table(report: dict) -> str:
    c = report["config"]
    lines = [f"multiple-choice judge reward, {c['steps']} GRPO steps of {c['completions']} completions x "
             f"{c['completion_length']} tokens, tiny Qwen2 (vocabulary 151936), CPU",
             f"{'variant':<10}{'reward s':>10}{'x fallback':>12}{'policy fwd':>12}{'peak MB':>10}{'x fallback':>12}"
             "  mean reward per step"]
    for name, r in report["results"].items():
        lines.append(f"{name:<10}{r['reward_time_s']:>10.2f}{format_ratio(r['time_ratio'], 12)}"
                     f"{r['policy_forwards']:>12d}"
                     f"{r['peak_mb']:>10.0f}{format_ratio(r['peak_ratio'], 12)}  "
                     f"{', '.join(f'{x:.4f}' for x in r['mean_reward'])}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(worker_main(run_worker, RewardBenchConfig, VARIANTS, "--policy-dir"))
