"""Run by tests/trl/test_trl_distributed.py under torchrun (2 CPU processes, gloo): stock TRL GRPOTrainer and
GRPOTrainerWithLogits train the same model from the same seed; each rank saves what the test compares."""

import os
import sys

import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from logitless.models import qwen_tokenizer
from logitless.trl import GRPOTrainerWithLogits


def length_reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


def main(model_dir: str, output_path: str) -> None:
    dataset = Dataset.from_dict({"prompt": ["What is 2+2?", "Name a color.", "Say hi.", "Count to three:"] * 2})
    saved = {}
    for cls in (GRPOTrainer, GRPOTrainerWithLogits):
        args = GRPOConfig(output_dir=os.path.join(os.path.dirname(output_path), cls.__name__), use_cpu=True,
                          bf16=False, activation_checkpointing=False,
                          per_device_train_batch_size=2, num_generations=2, max_completion_length=6, max_steps=2,
                          logging_steps=1, report_to="none", save_strategy="no", seed=0, disable_dropout=True,
                          learning_rate=1e-2, loss_type="bnpo")
        trainer = cls(model=model_dir, reward_funcs=length_reward, args=args, train_dataset=dataset,
                      processing_class=qwen_tokenizer())
        trainer.train()
        model = trainer.accelerator.unwrap_model(trainer.model)
        logged = [entry for entry in trainer.state.log_history if "loss" in entry]
        saved[cls.__name__] = {
            "world_size": trainer.accelerator.num_processes,
            "parameters": torch.cat([p.detach().flatten()[:1000] for p in model.parameters()]),
            "grad_norm": torch.tensor([entry["grad_norm"] for entry in logged]),
            "loss": torch.tensor([entry["loss"] for entry in logged]),
        }
    torch.save(saved, output_path.format(rank=trainer.accelerator.process_index))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    os._exit(0)  # gloo can abort at interpreter exit after a clean run
