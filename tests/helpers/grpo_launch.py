"""A GRPO training script run by tests/trl/test_trl_launch.py the ways docs/trl.md tells users to launch one: alone,
under torchrun, or under accelerate launch (DDP, FSDP2, DeepSpeed ZeRO-3), on CPU.

``python grpo_launch.py MODEL_DIR OUTPUT [--fsdp2] [--generate]``

GRPOTrainerWithLogits trains one SGD step on a global batch of four completions that does not depend on the number
of processes: a rollout_func writes each from its prompt and its place among that prompt's generations. One reward
reads ``completion_logits``. Every process takes part in gathering sharded parameters; the main process saves the
weights after the step, the log, and how the parameters were laid out during the step. ``--fsdp2`` loads the model
sharded with FSDP2 over every process (transformers' ``DistributedConfig``); ``--generate`` then trains one more step
of a fresh trainer whose completions come from transformers' generate on the sharded model.
"""

import argparse
import os
import random
from collections import Counter

import torch
from datasets import Dataset
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, TrainerCallback
from trl import GRPOConfig

from logitless.models import qwen_tokenizer
from logitless.trl import GRPOTrainerWithLogits

GLOBAL_BATCH = 4  # completions per step, over all processes
NUM_GENERATIONS = 2
PROMPTS = ["What is 2+2?", "Name a color.", "Say hi.", "Count to three:"]
LEARNING_RATE = 1.0  # one SGD step: the weights move by exactly the gradient


def fixed_rollout(prompts, trainer):
    """The prompts arrive once per generation (each one NUM_GENERATIONS times in a row); completion k of a prompt is
    drawn from a generator seeded by the prompt and k, so it is the same whichever process receives it."""
    tokenizer = trainer.processing_class
    generation_index = Counter()
    prompt_ids, completion_ids = [], []
    for prompt in prompts:
        draw = random.Random(f"{prompt}#{generation_index[prompt]}")
        generation_index[prompt] += 1
        prompt_ids.append(tokenizer(prompt)["input_ids"])
        completion_ids.append([draw.randrange(100, 5000) for _ in range(draw.randint(2, 6))])
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids,
            "logprobs": [[0.0] * len(ids) for ids in completion_ids]}


def length_reward(completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]


def confidence_reward(completion_ids, completion_logits, **kwargs):
    """The log-probability of the policy's most likely token after the completion's last token."""
    return [torch.log_softmax(logits[len(ids) - 1], -1).max().item()
            for ids, logits in zip(completion_ids, completion_logits)]


def parameter_layout(model) -> str:
    """"dtensor" (FSDP2), "partitioned" (DeepSpeed ZeRO-3), "whole", or "mixed" when the parameters differ."""
    kinds = {"dtensor" if isinstance(p, DTensor) else "partitioned" if hasattr(p, "ds_id") else "whole"
             for p in model.parameters()}
    return kinds.pop() if len(kinds) == 1 else "mixed"


class RecordLayout(TrainerCallback):
    """How the parameters of the model being trained are laid out when the optimizer steps."""

    def __init__(self):
        self.layouts = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.layouts.append(parameter_layout(model))


def full_weights(trainer) -> dict[str, torch.Tensor]:
    """Every parameter whole, gathered from its shards on every process (a collective call)."""
    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    named = dict(model.named_parameters())
    if trainer.is_deepspeed_enabled:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(named.values())):
            return {name: p.detach().clone() for name, p in named.items()}
    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for name, p in named.items()}


def load_policy(model_dir: str, fsdp2: bool):
    """The model directory as TRL loads it, or the model sharded with FSDP2 over every process at load time."""
    if not fsdp2:
        return model_dir
    from transformers.distributed import DistributedConfig

    sharding = DistributedConfig(fsdp_size=int(os.environ["WORLD_SIZE"]))
    return AutoModelForCausalLM.from_pretrained(model_dir, distributed_config=sharding, dtype=torch.float32)


def grpo_config(world_size: int, output_dir: str) -> GRPOConfig:
    return GRPOConfig(output_dir=output_dir, use_cpu=True, bf16=False, activation_checkpointing=False,
                      per_device_train_batch_size=GLOBAL_BATCH // world_size, num_generations=NUM_GENERATIONS,
                      max_completion_length=6, max_steps=1, logging_steps=1, report_to="none", save_strategy="no",
                      seed=0, disable_dropout=True, optim="sgd", learning_rate=LEARNING_RATE, max_grad_norm=1e9,
                      loss_type="grpo")


def main(model_dir: str, output_path: str, fsdp2: bool, generate: bool) -> None:
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    trainer_dir = os.path.join(os.path.dirname(output_path), "trainer")
    common = dict(reward_funcs=[length_reward, confidence_reward], processing_class=qwen_tokenizer(),
                  train_dataset=Dataset.from_dict({"prompt": PROMPTS}), callbacks=[layout := RecordLayout()])
    trainer = GRPOTrainerWithLogits(model=load_policy(model_dir, fsdp2), args=grpo_config(world_size, trainer_dir),
                                    rollout_func=fixed_rollout, **common)
    trainer.train()
    accelerator = trainer.accelerator
    saved = {"world_size": accelerator.num_processes, "distributed_type": str(accelerator.distributed_type),
             "wrapper": type(trainer.model_wrapped).__name__, "layouts": layout.layouts,
             "log": trainer.state.log_history[0], "weights": full_weights(trainer)}
    if generate:
        generating = GRPOTrainerWithLogits(model=load_policy(model_dir, fsdp2),
                                           args=grpo_config(world_size, trainer_dir), **common)
        generating.train()
        saved["generated_log"] = generating.state.log_history[0]
    if accelerator.is_main_process:
        torch.save(saved, output_path)
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("output")
    parser.add_argument("--fsdp2", action="store_true")
    parser.add_argument("--generate", action="store_true")
    options = parser.parse_args()
    main(options.model_dir, options.output, options.fsdp2, options.generate)
