"""On-policy distillation with the exact divergence: TRL's DistillationTrainer on logitless's fused JSD.

TRL 1.16's DistillationTrainer computes its generalized JSD (``beta`` 0: forward KL(teacher || student),
1: reverse KL(student || teacher), otherwise the JSD with the mixture ``(1 - beta) p_student + beta
p_teacher``; ``temperature``) from the student's and the teacher's final hidden states and heads, through
one function, ``_chunked_divergence_loss``. `divergence_loss` has its signature and answers it with
`logitless.ops.fused_linear_jsd` of the two heads: exact over the full vocabulary, no ``(B, T, V)`` tensor of
either model, no gradient for the teacher, whose hidden size may differ from the student's. A head sharded on the
vocabulary (FSDP2) is read shard by shard, never gathered.

TRL's trainer hands the divergence the body's last hidden state and the whole output embedding of each model, so
a student or teacher whose head reads anything else (`logitless.hf.head_structure`: a BERT-style transform, a
muP divisor, a padded vocabulary, a nested language model) is refused when the trainer is built, as is one whose
head logitless cannot read (`logitless.hf_probe.check_head`).
"""

from __future__ import annotations

from unittest import mock

import torch
import trl.trainer.distillation_trainer as trl_distillation
from trl import DistillationTrainer as TRLDistillationTrainer

from logitless.hf import head_structure, lm_head_of
from logitless.hf_probe import UnreadableHead, check_head
from logitless.ops.head import LinearHead
from logitless.ops.two_heads import fused_linear_jsd
from logitless.trl.checkpoints import AtomicCheckpoints
from logitless.trl.ddp import set_find_unused_parameters
from logitless.trl.lm_head import gather_head_in_backward, zero3_gathered
from logitless.trl.resume import ExactResume
from logitless.trl.seam import announce_start


def _as(tensor: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A head's weight in the hidden states' ``dtype`` (a teacher's fp32 master copy under mixed precision); a DTensor
    sharded on the vocabulary stays sharded: the fused JSD reads each rank's rows (`logitless.ops.sharded`)."""
    return None if tensor is None else tensor.to(dtype)


def divergence_loss(student_hidden_states: torch.Tensor, teacher_hidden_states: torch.Tensor,
                    student_lm_head_weight: torch.Tensor, teacher_lm_head_weight: torch.Tensor,
                    completion_mask: torch.Tensor, beta: float, num_items_in_batch: torch.Tensor | int | None = None,
                    student_lm_head_bias: torch.Tensor | None = None, teacher_lm_head_bias: torch.Tensor | None = None,
                    student_logit_scale: float = 1.0, teacher_logit_scale: float = 1.0,
                    student_final_logit_softcapping: float | None = None,
                    teacher_final_logit_softcapping: float | None = None,
                    temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TRL's ``_chunked_divergence_loss``: hidden states (B, K, H_s) and (B, K, H_t) at the completion tokens, their
    heads, and ``completion_mask`` (B, K) -> (loss, the sum of the student's per-token entropy, the count of valid
    positions). The loss is the divergence summed over the valid positions and divided by ``num_items_in_batch``
    (their count when None)."""
    student_weight = _as(student_lm_head_weight, student_hidden_states.dtype)
    teacher_weight = _as(teacher_lm_head_weight, teacher_hidden_states.dtype)
    student_bias, teacher_bias = student_lm_head_bias, teacher_lm_head_bias
    valid = completion_mask.reshape(-1) != 0
    student_rows = student_hidden_states.reshape(-1, student_hidden_states.shape[-1])[valid]  # (N, H_s)
    teacher_rows = teacher_hidden_states.reshape(-1, teacher_hidden_states.shape[-1])[valid]  # (N, H_t)
    with zero3_gathered(student_weight, student_bias, teacher_weight, teacher_bias):
        student_head = LinearHead(student_weight, bias=student_bias, temperature=temperature,
                                  softcap=student_final_logit_softcapping, logit_scale=student_logit_scale)
        teacher_head = LinearHead(teacher_weight, bias=teacher_bias, temperature=temperature,
                                  softcap=teacher_final_logit_softcapping, logit_scale=teacher_logit_scale)
        divergence, entropy = fused_linear_jsd(student_rows, hidden_t=teacher_rows, head_s=student_head,
                                               head_t=teacher_head, beta=beta, return_token_entropy=True)
    if divergence.grad_fn is not None:
        gather_head_in_backward(divergence.grad_fn, student_head)
    count = valid.sum()
    if num_items_in_batch is None:
        return divergence.sum() / count.clamp(min=1), entropy.sum(), count
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(divergence.device)
    return divergence.sum() / num_items_in_batch, entropy.sum(), count


# the structures TRL's distillation reads from a model's body and head as the model's own forward does
_TRL_READS = ("plain", "tied", "bias", "scaled", "soft-capped")
_NO_WAY_AROUND = "TRL's own DistillationTrainer reads the same hidden states and head"


def check_distillable(model, name: str) -> None:
    """Refuse (`UnreadableHead`, one line naming ``name``) a model whose divergence TRL's hidden states and head would
    not give as its own forward's logits do."""
    check_head(model, _NO_WAY_AROUND, name)
    unread = [feature for feature in head_structure(model) if feature not in _TRL_READS]
    if lm_head_of(model).softcap != getattr(model.config.get_text_config(), "final_logit_softcapping", None):
        unread.append("soft-capped under another name than final_logit_softcapping")
    if unread:
        raise UnreadableHead(f"{name}: TRL's DistillationTrainer reads the body's last hidden state and whole output "
                             f"embedding of {type(model).__name__}, whose head is {', '.join(unread)}; logitless "
                             "cannot distill it")


class LogitlessDivergence:
    """Mixin for `trl.DistillationTrainer`: its divergence is `divergence_loss` (the trainer's own loss code, which
    reads both models' hidden states and heads, runs unchanged around it)."""

    lm_head_path = "logitless"  # the divergence never comes from TRL's chunked kernel

    def __init__(self, *args, **kwargs):
        set_find_unused_parameters(TRLDistillationTrainer, self, args, kwargs)
        super().__init__(*args, **kwargs)
        for name, model in (("model", self.model), ("teacher_model", self.teacher_model)):
            if model is not None:
                check_distillable(self.accelerator.unwrap_model(model), name)

    def _compute_loss(self, *args, **kwargs):
        with mock.patch.object(trl_distillation, "_chunked_divergence_loss", divergence_loss):
            return super()._compute_loss(*args, **kwargs)

    def train(self, *args, **kwargs):
        """TRL's ``train``, which first prints (main process) how the divergence is computed."""
        student = self.accelerator.unwrap_model(self.model)
        announce_start(self, student, "the divergence to the teacher computed by logitless's fused JSD of both heads")
        return super().train(*args, **kwargs)


class DistillationTrainer(AtomicCheckpoints, ExactResume, LogitlessDivergence, TRLDistillationTrainer):
    """Drop-in for `trl.DistillationTrainer`; see the module docstring."""
