"""A GRPO run stopped after a checkpoint and resumed ends with the uninterrupted run's weights, bitwise, on CPU.

The policy's weights move (a reward that varies within each group, a large learning rate), and each case
is one a broken resume gets wrong: an epoch boundary (TRL's sampler restarted its order) and generations
buffered across steps (TRL regenerated them with newer weights)."""

import pytest
import torch

trl = pytest.importorskip("trl")
from datasets import Dataset  # noqa: E402

from logitless.models import tiny_qwen2  # noqa: E402
from logitless.trl import GRPOTrainerWithLogits  # noqa: E402
from logitless.trl.resume import STATE_FILE  # noqa: E402

PROMPTS = ["a b", "c d", "e f", "g h", "i j", "k l", "m n", "o p"]


def _token_reward(completion_ids, **kwargs):
    return [sum(token % 7 for token in ids) / (7.0 * len(ids)) for ids in completion_ids]


def _small_policy():
    return tiny_qwen2(seed=0, hidden_size=16, intermediate_size=32, num_hidden_layers=1)


def _train(output_dir, tokenizer, prompts, max_steps, resume=None, **options):
    args = trl.GRPOConfig(output_dir=str(output_dir), use_cpu=True, bf16=False, activation_checkpointing=False,
                          per_device_train_batch_size=4, num_generations=2, max_completion_length=6,
                          max_steps=max_steps, learning_rate=1e-2, lr_scheduler_type="constant", logging_steps=1,
                          report_to="none", save_strategy="steps", save_steps=1, seed=0, disable_dropout=True,
                          disable_tqdm=True, **options)
    trainer = GRPOTrainerWithLogits(model=_small_policy(), reward_funcs=_token_reward, args=args,
                                    train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tokenizer)
    trainer.train(resume_from_checkpoint=resume)
    return torch.cat([p.detach().flatten() for p in trainer.model.parameters()])


@pytest.mark.slow
@pytest.mark.parametrize("case", ["epoch_boundary", "buffered_generations"])
def test_a_resumed_grpo_run_equals_the_uninterrupted_one(tmp_path, tokenizer, case):
    # epoch_boundary: 4 prompts, 2 per step: steps 3-4 are the second epoch; stopped after step 2.
    # buffered_generations: one generation feeds 2 steps; stopped after step 3, whose generation feeds step 4.
    prompts, options, stop = {"epoch_boundary": (PROMPTS[:4], {}, 2),
                              "buffered_generations": (PROMPTS, {"steps_per_generation": 2}, 3)}[case]
    uninterrupted = _train(tmp_path / "whole", tokenizer, prompts, 4, **options)
    initial = torch.cat([p.detach().flatten() for p in _small_policy().parameters()])
    assert (uninterrupted - initial).abs().max() > 1e-2  # the weights moved
    _train(tmp_path / "split", tokenizer, prompts, stop, **options)
    assert (tmp_path / "split" / f"checkpoint-{stop}" / STATE_FILE.format(process=0)).is_file()
    resumed = _train(tmp_path / "split", tokenizer, prompts, 4, resume=True, **options)
    assert torch.equal(resumed, uninterrupted)


def test_a_run_resumed_at_its_last_step_trains_no_further(tmp_path, tokenizer):
    # the stock loop checks max_steps only after a step: a run killed after its last save took a step more
    finished = _train(tmp_path, tokenizer, PROMPTS[:4], 3)
    initial = torch.cat([p.detach().flatten() for p in _small_policy().parameters()])
    assert (finished - initial).abs().max() > 1e-2  # the weights moved, so an extra step would show
    resumed = _train(tmp_path, tokenizer, PROMPTS[:4], 3, resume=True)
    assert torch.equal(resumed, finished)
    assert not (tmp_path / "checkpoint-4").exists()
