"""An SFT or DPO training script run by tests/test_trl_launch.py alone and under torchrun (DDP), on CPU.

``python trainer_launch.py sft|dpo MODEL_DIR OUTPUT``

logitless's SFTTrainer or DPOTrainer trains one SGD step at learning rate 1 on a global batch of four examples,
whatever the number of processes (each takes its share), so the weights move by exactly the gradient; the main
process saves the weights after the step and the logged metrics.
"""

import argparse
import os

import torch
from datasets import Dataset
from trl import DPOConfig, SFTConfig

from logitless.models import qwen_tokenizer
from logitless.trl import DPOTrainer, SFTTrainer

GLOBAL_BATCH = 4
PROMPTS = ["What is 2+2?", "Name a color.", "Say hi.", "Count to three:"]
COMPLETIONS = [" 4", " Red, or maybe blue.", " Hi there!", " One, two, three."]
OTHERS = [" 5", " A dog.", " Goodbye.", " Three, two, one."]


def main(trainer_name: str, model_dir: str, output_path: str) -> None:
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    # the dataset is one global batch: every order is the same
    settings = dict(output_dir=os.path.join(os.path.dirname(output_path), "trainer"), use_cpu=True, bf16=False,
                    max_steps=1, per_device_train_batch_size=GLOBAL_BATCH // world_size, logging_steps=1,
                    report_to="none", save_strategy="no", seed=0, optim="sgd", learning_rate=1.0, max_grad_norm=1e9)
    if trainer_name == "sft":
        trainer = SFTTrainer(model=model_dir, args=SFTConfig(**settings), processing_class=qwen_tokenizer(),
                             train_dataset=Dataset.from_dict({"prompt": PROMPTS, "completion": COMPLETIONS}))
    else:
        data = Dataset.from_dict({"prompt": PROMPTS, "chosen": COMPLETIONS, "rejected": OTHERS})
        trainer = DPOTrainer(model=model_dir, args=DPOConfig(**settings), processing_class=qwen_tokenizer(),
                             train_dataset=data)
    trainer.train()
    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    saved = {"world_size": trainer.accelerator.num_processes, "wrapper": type(trainer.model_wrapped).__name__,
             "log": trainer.state.log_history[0],
             "weights": {name: p.detach().clone() for name, p in model.named_parameters()}}
    if trainer.accelerator.is_main_process:
        torch.save(saved, output_path)
    trainer.accelerator.wait_for_everyone()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("trainer", choices=("sft", "dpo"))
    parser.add_argument("model_dir")
    parser.add_argument("output")
    options = parser.parse_args()
    main(options.trainer, options.model_dir, options.output)
