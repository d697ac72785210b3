"""Exact resume of the trainers that generate (GRPO, on-policy distillation): a run stopped anywhere and resumed
from a checkpoint ends with the uninterrupted run's weights.

A TRL checkpoint holds the weights, the optimizer, the schedule, the trainer state and each process's
random-number state (restored where the uninterrupted run would be); resuming from that alone diverges,
for the reasons this module removes:

* **Prompt order.** TRL's sampler draws each epoch's order from one generator seeded once, so a
  resumed run, with a new sampler, would draw epoch 0's order again in whatever epoch it resumed. Here the
  sampler replays its draws up to the epoch it starts: the order of every epoch is stock TRL's.
* **Buffered generations.** With ``steps_per_generation`` or ``num_iterations`` above 1, one
  generation feeds several steps; TRL keeps that buffer in memory only and regenerates it on
  resume, with newer weights. Each checkpoint here also holds every process's buffer and TRL's micro-step count
  (``logitless-grpo-state-PROCESS.pt``, tensors and plain values only, read with ``weights_only``).

* **A run resumed at its last step.** The stock training loop checks ``max_steps`` only after a step, so
  resuming from a checkpoint at ``max_steps`` (a run stopped between its last save and its exit) trained
  one step more. Here such a resume trains nothing: the model holds the checkpoint's weights.

Not restored: state a reward function keeps between calls, and a vLLM server's own state.

A model with tied input and output embeddings saves the shared matrix once; the stock Trainer then warns
of a "missing" ``lm_head.weight`` at every resume. Keys whose parameter is shared with another, loaded
one are not reported here.
"""

import functools
import os
from collections import Counter

import torch
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

STATE_FILE = "logitless-grpo-state-{process}.pt"


def _replay_to_epoch(sampler, epoch: int) -> None:
    """Put TRL's sampler where an uninterrupted run's would be at the start of ``epoch``: one order drawn per
    epoch before it."""
    sampler.generator.manual_seed(sampler.seed)
    for _ in range(epoch):
        torch.randperm(sampler.num_samples, generator=sampler.generator)


class ExactResume:
    """Mixin for `trl.GRPOTrainer` and `trl.DistillationTrainer`: a prompt order that resumes, and the generation
    buffer kept in every checkpoint."""

    def _get_train_sampler(self, dataset=None):
        sampler = super()._get_train_sampler(dataset)
        if getattr(sampler, "shuffle", False) and sampler.seed is not None:  # accelerate calls set_epoch per epoch
            sampler.set_epoch = functools.partial(_replay_to_epoch, sampler)
        return sampler

    def _run_epoch(self, *args, **kwargs):
        if self.state.max_steps > 0 and self.state.global_step >= self.state.max_steps:  # resumed at the last step
            self.control.should_training_stop = True
            return
        super()._run_epoch(*args, **kwargs)

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        folder = os.path.join(self._get_output_dir(trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        state = {"micro_step": self._step, "buffered_inputs": self._buffered_inputs}
        torch.save(state, os.path.join(folder, STATE_FILE.format(process=self.accelerator.process_index)))

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, STATE_FILE.format(process=self.accelerator.process_index))
        if not os.path.exists(path):  # a checkpoint written by stock TRL: resumed as TRL resumes it
            return
        state = torch.load(path, map_location=self.accelerator.device, weights_only=True)
        self._step, self._buffered_inputs = state["micro_step"], state["buffered_inputs"]

    def _issue_warnings_after_load(self, load_result):
        """The Trainer's warnings about the loaded checkpoint, without tied parameters (saved once, under
        the other name) counted as missing."""
        parameters = dict(self.model.named_parameters(remove_duplicate=False))
        names_per_parameter = Counter(id(parameter) for parameter in parameters.values())
        shared = {name for name, parameter in parameters.items() if names_per_parameter[id(parameter)] > 1}
        missing = [key for key in load_result.missing_keys if key not in shared]
        return super()._issue_warnings_after_load(load_result._replace(missing_keys=missing))
