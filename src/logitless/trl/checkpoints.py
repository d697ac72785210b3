"""Checkpoints of a TRL trainer that appear complete or not at all, and resume from the newest complete one.

Each ``checkpoint-STEP`` is written by TRL into ``OUTPUT_DIR/.logitless-staging/``, sealed and published
with one rename (`logitless.checkpoint`) once every process has written its part; a process killed
during a save leaves no ``checkpoint-STEP`` behind.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from logitless.checkpoint import CHECKPOINT_STAGING, last_complete_checkpoint, publish_directory

logger = logging.getLogger(__name__)


class AtomicCheckpoints:
    """Mixin for a `transformers.Trainer` subclass: atomic ``checkpoint-STEP`` directories and
    ``train(resume_from_checkpoint=True)`` from the newest complete one (newer incomplete ones are logged)."""

    def _get_output_dir(self, trial) -> str:
        return getattr(self, "_checkpoint_staging", None) or super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial):
        """The trainer's save into OUTPUT_DIR/.logitless-staging/checkpoint-STEP, published with one rename once
        every process has written its part; then the usual rotation (``save_total_limit``)."""
        run_dir = Path(super()._get_output_dir(trial))
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        staging = run_dir / CHECKPOINT_STAGING
        if self.args.should_save and (staging / name).exists():
            shutil.rmtree(staging / name)  # a save of this step that a crash interrupted
        self.accelerator.wait_for_everyone()
        self._checkpoint_staging = str(staging)
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._checkpoint_staging = None
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            publish_directory(staging / name, run_dir / name)
            if not any(staging.iterdir()):
                staging.rmdir()  # nothing left in flight: the run directory shows only what it holds
            rotate_checkpoints(str(run_dir), self.args.save_total_limit, self.state.best_model_checkpoint)
        self.accelerator.wait_for_everyone()

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """``resume_from_checkpoint=True`` takes the newest complete checkpoint; incomplete newer ones are skipped."""
        if resume_from_checkpoint is True:
            checkpoint, skipped = last_complete_checkpoint(self.args.output_dir)
            for note in skipped:
                logger.warning(note)
            if checkpoint is None:
                raise ValueError(f"resume_from_checkpoint: no complete checkpoint in {self.args.output_dir}")
            resume_from_checkpoint = str(checkpoint)
        return super().train(resume_from_checkpoint, *args, **kwargs)
