"""The seam every TRL 1.16 trainer that scores tokens goes through, answered by logitless's fused ops.

While it is built, each of TRL's trainers installs its fused LM head on the policy (and on the reference
model, where it has one) with ``add_fused_lm_head``; every per-token log-prob, entropy, mean logit,
top-1 flag and ``log(sum p^2)`` its losses and metrics read then comes from
``model(..., labels=labels, fused_lm_head=True)``. `LogitlessHead` builds the trainer with that call
answered by `add_logitless_lm_head` instead, in the module of the TRL trainer it extends, so that the
trainer's own loss code runs unchanged on logitless's outputs and neither TRL's head nor the model's
``lm_head`` module runs in training. Each model TRL installs the head on is first checked against its own forward
(`logitless.hf_probe.check_head`): a model whose logits logitless cannot compute from its hidden states is refused
when the trainer is built.
"""

from __future__ import annotations

import logging
import sys
from unittest import mock

from accelerate.utils import is_peft_model

from logitless.hf_probe import check_head
from logitless.trl.ddp import set_find_unused_parameters
from logitless.trl.lm_head import add_logitless_lm_head, has_logitless_lm_head
from logitless.trl.notices import launch_warnings, scoring_line

logger = logging.getLogger(__name__)


def trl_trainer_class(cls: type) -> type:
    """The TRL trainer class that ``cls`` extends (the first of its bases defined in TRL)."""
    return next(base for base in cls.__mro__ if base.__module__.startswith("trl."))


class LogitlessHead:
    """Mixin for a TRL trainer class: its fused LM head is logitless's (see the module docstring). A class that also
    reads the scored hidden states (`LogitAwareRewards`) defines ``keep_scored_hidden``, called on each of them."""

    def __init__(self, *args, **kwargs):
        trl_class = trl_trainer_class(type(self))
        set_find_unused_parameters(trl_class, self, args, kwargs)
        trl_module = sys.modules[trl_class.__module__]
        on_hidden = getattr(self, "keep_scored_hidden", None)
        way_around = f"TRL's own trl.{trl_class.__name__} scores it with its own forward"

        def ours(model, *args, **kwargs):  # before TRL prepares a reference model (FSDP2, ZeRO-3), which shards it
            check_head(model, way_around)
            add_logitless_lm_head(model, *args, **kwargs, on_hidden=on_hidden)

        with mock.patch.object(trl_module, "add_fused_lm_head", ours):
            super().__init__(*args, **kwargs)
        if not has_logitless_lm_head(self._scoring_model):
            raise RuntimeError(f"{type(self).__name__}: TRL did not install a fused LM head on the policy, so "
                               "logitless's could not replace it; this TRL version is not supported")

    @property
    def _scoring_model(self):
        model = self.accelerator.unwrap_model(self.model)
        return model.get_base_model() if is_peft_model(model) else model

    @property
    def lm_head_path(self) -> str:
        """Which code scores the policy's tokens in a training step: ``"logitless"`` (the fused ops, from hidden
        states) whenever the trainer was built; TRL's own head is never used."""
        return "logitless" if has_logitless_lm_head(self._scoring_model) else "trl"

    def train(self, *args, **kwargs):
        """TRL's ``train``, which first prints (main process) the head that scores the tokens and the policy's layout,
        and warns where the launch asked for another layout."""
        announce_start(self, self._scoring_model, "tokens scored by logitless's fused LM head")
        return super().train(*args, **kwargs)


def announce_start(trainer, model, what: str) -> None:
    """On the main process, through the library's logger: one line saying ``what`` logitless computes and how (INFO),
    and the launch's warnings."""
    if trainer.accelerator.is_main_process:
        logger.info(scoring_line(model, trainer.accelerator, getattr(trainer.args, "cast_lm_head_to_fp32", False),
                                 what))
        for warning in launch_warnings(model, trainer.accelerator, trainer.args):
            logger.warning(warning)
