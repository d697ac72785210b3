"""GRPOTrainerWithLogits: TRL's GRPOTrainer with a logit-free loss and logit-aware rewards.

Adopt it by changing one import; every GRPOConfig option keeps its meaning.

1. The loss is `fused_grpo_loss` on the policy's final hidden states and output embedding: no
   (B, T, V) logits or logits gradient exist in training, and the entropy metric is kept. Options
   outside what the fused loss computes (loss types cispo/sapo/vespo/luspo, sequence-level
   importance sampling, entropy masking or bonus, off-policy masking, vLLM importance-sampling
   correction, router aux loss, tool masks, PEFT models, FSDP/ZeRO-3 sharded heads) use TRL's own
   loss, with a warning.
2. Reward functions that declare a ``completion_logits`` and/or ``completion_logprobs`` parameter
   receive them. ``completion_logits[i]`` is a `CompletionLogits` view of completion i: its rows are
   computed on demand from the hidden states generation already produced (captured from the LM
   head's input while ``generate`` runs), divided by the loss's temperature. ``completion_logprobs[i]``
   is the (C_i,) log-prob of each sampled token. No reward causes another generation or another
   policy forward, and nothing of size (C, V) is stored. Other reward functions are called as before.
   (Generation through vLLM, continuous batching, ``rollout_func`` or tools is not supported with
   them yet: the trainer raises when it is built.)
3. Each ``checkpoint-STEP`` directory appears complete or not at all: it is written in a staging
   directory, sealed and published with one rename (`logitless.checkpoint`), and
   ``train(resume_from_checkpoint=True)`` resumes from the newest COMPLETE checkpoint, logging any
   newer one it skips.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import shutil
import types
from pathlib import Path

import torch
from accelerate.utils import is_peft_model
from transformers.integrations import is_deepspeed_zero3_enabled
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints
from trl import GRPOTrainer
from trl.trainer.utils import nanmax, nanmin

from logitless.checkpoint import last_complete_checkpoint, publish_directory
from logitless.hf import lm_head_of, model_body
from logitless.ops.fused import fused_grpo_loss, fused_linear_logprobs
from logitless.ops.head import LinearHead
from logitless.ops.lazy import CompletionLogits

logger = logging.getLogger(__name__)

LOGIT_KWARGS = ("completion_logits", "completion_logprobs")
CHECKPOINT_STAGING = ".logitless-staging"  # in the output directory: checkpoints being written
FUSED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


def wanted_logit_kwargs(reward_func) -> tuple[str, ...]:
    """Which of completion_logits / completion_logprobs a reward function declares by name."""
    if isinstance(reward_func, torch.nn.Module):
        return ()
    try:
        parameters = inspect.signature(reward_func).parameters
    except (TypeError, ValueError):
        return ()
    return tuple(name for name in LOGIT_KWARGS if name in parameters)


def _add_hidden_states_forward(model) -> None:
    """``model(..., logitless_hidden_states=True)`` returns the final hidden states (B, T, H).

    Going through ``model.forward`` (not the body directly) keeps DDP/FSDP wrappers' hooks in play.
    """
    original_forward = model.forward
    body = model_body(model)

    @functools.wraps(type(model).forward)
    def forward(self, *args, logitless_hidden_states: bool = False, **kwargs):
        if not logitless_hidden_states:
            return original_forward(*args, **kwargs)
        return body(*args, use_cache=False, **kwargs).last_hidden_state

    model.forward = types.MethodType(forward, model)


class GRPOTrainerWithLogits(GRPOTrainer):
    """Drop-in for `trl.GRPOTrainer`; see the module docstring."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._logit_reward_funcs = {i: wanted for i, f in enumerate(self.reward_funcs)
                                    if (wanted := wanted_logit_kwargs(f))}
        other_generation = (self.use_vllm or self.use_transformers_continuous_batching or self.rollout_func is not None
                            or self.tools)
        if self._logit_reward_funcs and other_generation:
            raise NotImplementedError(
                "reward_funcs: completion_logits/completion_logprobs are captured during transformers' generate; "
                "vLLM, continuous batching, rollout_func and tools are not supported with them yet")
        if self._logit_reward_funcs and (sharded_by := self._sharded_head()):
            raise NotImplementedError(
                f"reward_funcs: completion_logits/completion_logprobs read the LM head's weight, which "
                f"{sharded_by} shards; not supported yet")
        self._fallback_reason = self._why_not_fused()
        if self._fallback_reason:
            logger.warning("GRPOTrainerWithLogits: using TRL's own loss because %s", self._fallback_reason)
        else:
            _add_hidden_states_forward(self.accelerator.unwrap_model(self.model))
        self._completion_hidden: list[torch.Tensor] = []  # per generate step: (B, H)

    def _why_not_fused(self) -> str | None:
        checks = [
            (self.loss_type not in FUSED_LOSS_TYPES, f"loss_type={self.loss_type!r}"),
            (self.importance_sampling_level != "token", "importance_sampling_level='sequence'"),
            (self.top_entropy_quantile < 1.0, "top_entropy_quantile < 1"),
            (self.off_policy_mask_threshold is not None, "off_policy_mask_threshold is set"),
            (self.use_vllm and self.vllm_importance_sampling_correction, "vLLM importance-sampling correction"),
            (self._entropy_bonus_enabled, "an entropy bonus is set"),
            (self.aux_loss_enabled, "the router aux loss is enabled"),
            (self._is_vlm, "the model is a vision-language model"),
            (bool(sharded_by := self._sharded_head()), f"{sharded_by} shards the LM head"),
            (is_peft_model(self.model), "the model is a PEFT model"),
        ]
        for failed, reason in checks:
            if failed:
                return reason
        try:
            lm_head_of(self.accelerator.unwrap_model(self.model))
        except (TypeError, ValueError) as err:
            return str(err)
        return None

    def _sharded_head(self) -> str | None:
        """What shards the LM head's weight across processes (so it cannot be read directly), if anything."""
        if self.is_fsdp_enabled:
            return "FSDP"
        if is_deepspeed_zero3_enabled():
            return "DeepSpeed ZeRO-3"
        return None

    def _head_inputs(self, hidden: torch.Tensor, head: LinearHead) -> tuple[torch.Tensor, LinearHead]:
        """Hidden states and head on the head's device and in one dtype, as TRL's fused LM head takes them:
        fp32 with ``cast_lm_head_to_fp32``, else the head's dtype (accelerate's mixed precision hands the
        body's output back in fp32; for a bf16 model its values are bf16's, so the cast loses nothing)."""
        hidden = hidden.to(head.weight.device)
        if self.args.cast_lm_head_to_fp32:
            return hidden.float(), dataclasses.replace(
                head, weight=head.weight.float(), bias=None if head.bias is None else head.bias.float())
        return hidden.to(head.weight.dtype), head

    def _head_precision(self):
        """The autocast TRL runs its LM head under: the accelerator's (bf16 matmuls under ``bf16=True``, as for
        TRL's old and reference log-probs), or none with ``cast_lm_head_to_fp32``."""
        if self.args.cast_lm_head_to_fp32:
            return torch.autocast(self.accelerator.device.type, enabled=False)
        return self.accelerator.autocast()

    # -- logit-aware rewards -------------------------------------------------------------------

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if not self._logit_reward_funcs:
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                 has_tool_images)
        head = self.accelerator.unwrap_model(self.model).get_output_embeddings()
        self._completion_hidden = []

        def keep_last_position(_module, module_args):  # (B, L, H): L is the prompt at prefill, then 1
            self._completion_hidden.append(module_args[0][:, -1, :].detach())

        handle = head.register_forward_pre_hook(keep_last_position)
        try:
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                 has_tool_images)
        finally:
            handle.remove()

    def completion_views(self, completion_ids_list: list[list[int]]):
        """(completion_logits, completion_logprobs) for the completions generated last."""
        if not self._completion_hidden:
            raise RuntimeError("no hidden states were captured during generation for completion_logits")
        hidden = torch.stack(self._completion_hidden, dim=1)  # (B, steps, H): step k produced token k
        self._completion_hidden = []
        if hidden.shape[0] != len(completion_ids_list):
            raise RuntimeError(f"captured {hidden.shape[0]} rows of hidden states for {len(completion_ids_list)} "
                               "completions")
        policy = self.accelerator.unwrap_model(self.model)
        hidden, head = self._head_inputs(hidden, lm_head_of(policy, self.temperature))
        lengths = [len(ids) for ids in completion_ids_list]
        ids = torch.zeros(hidden.shape[:2], dtype=torch.long, device=hidden.device)
        mask = torch.zeros(hidden.shape[:2], dtype=torch.bool, device=hidden.device)
        for row, completion in enumerate(completion_ids_list):
            ids[row, : len(completion)] = torch.tensor(completion, dtype=torch.long)
            mask[row, : len(completion)] = True
        with torch.no_grad(), self._head_precision():
            log_probs = fused_linear_logprobs(hidden, head.weight, ids.to(hidden.device), mask=mask.to(hidden.device),
                                              **head.options())  # (B, steps)
        views = [CompletionLogits(hidden[row, :length], head) for row, length in enumerate(lengths)]
        return views, [log_probs[row, :length] for row, length in enumerate(lengths)]

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        if not self._logit_reward_funcs:
            return super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        views, log_probs = self.completion_views(completion_ids_list)
        available = {"completion_logits": views, "completion_logprobs": log_probs}
        originals = list(self.reward_funcs)
        for index, wanted in self._logit_reward_funcs.items():
            bound = functools.partial(originals[index], **{name: available[name] for name in wanted})
            self.reward_funcs[index] = functools.update_wrapper(bound, originals[index])
        try:
            return super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        finally:
            self.reward_funcs[:] = originals

    # -- the loss --------------------------------------------------------------------------------

    def _compute_loss(self, model, inputs):
        if self._fallback_reason or "tool_mask" in inputs:
            return super()._compute_loss(model, inputs)
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        prompt_length, completion_length = prompt_ids.shape[1], completion_ids.shape[1]
        with self.accelerator.autocast():  # as TRL scores: the body under the mixed-precision autocast
            hidden = model(input_ids=torch.cat([prompt_ids, completion_ids], dim=1),
                           attention_mask=torch.cat([prompt_mask, completion_mask], dim=1),
                           logitless_hidden_states=True)  # (B, P + C, H)
        completion_hidden, head = self._head_inputs(
            hidden[:, prompt_length - 1: prompt_length + completion_length - 1],
            lm_head_of(self.accelerator.unwrap_model(model), self.temperature))
        # with the model split across devices (device_map) the body can end on another device than the head
        on_head = {name: None if inputs.get(name) is None else inputs[name].to(head.weight.device)
                   for name in ("completion_ids", "completion_mask", "advantages", "old_per_token_logps",
                                "ref_per_token_logps")}

        mode = "train" if self.model.training else "eval"
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
        dapo_normalizer = None
        if self.loss_type == "dapo":  # TRL: the generation batch's tokens, per process and accumulation window
            dapo_normalizer = inputs["num_items_in_batch"].clamp(min=1.0).item() / self.accelerator.num_processes
            if mode == "train":
                dapo_normalizer *= self.current_gradient_accumulation_steps / self.args.steps_per_generation
        with self._head_precision():
            loss, metrics = fused_grpo_loss(
                completion_hidden, head.weight, on_head["completion_ids"], on_head["completion_mask"],
                on_head["advantages"], old_logprobs=on_head["old_per_token_logps"],
                ref_logprobs=on_head["ref_per_token_logps"], beta=self.beta, epsilon_low=self.epsilon_low,
                epsilon_high=self.epsilon_high, delta=self.args.delta, loss_type=self.loss_type, **head.options(),
                max_completion_length=self.max_completion_length, num_items_in_batch=dapo_normalizer,
                gradient_accumulation_steps=accumulation, use_bias_correction_kl=self.args.use_bias_correction_kl)
        self._log_loss_metrics(mode, metrics, completion_mask)
        return loss

    def _log_loss_metrics(self, mode: str, metrics: dict[str, float], completion_mask: torch.Tensor) -> None:
        """TRL's metric names and cross-process reductions: token means weighted by token counts,
        per-sequence extremes gathered."""
        tokens = completion_mask.sum().float()

        def global_mean(local_mean: float) -> float:
            local = torch.stack([torch.tensor(local_mean, device=tokens.device) * tokens, tokens])
            totals = self.accelerator.reduce(local, reduction="sum")
            return (totals[0] / totals[1].clamp(min=1.0)).item()

        names = (["kl"] if self.beta != 0.0 else []) + ["entropy", "clip_ratio/low_mean", "clip_ratio/high_mean",
                                                       "clip_ratio/region_mean"]
        for name in names:
            self._metrics[mode][name].append(global_mean(metrics[name]))
        for name, extreme in (("clip_ratio/low_min", nanmin), ("clip_ratio/high_max", nanmax)):
            gathered = self.accelerator.gather(torch.tensor([metrics[name]], device=tokens.device))
            self._metrics[mode][name].append(extreme(gathered).item())

    # -- checkpoints: a checkpoint-STEP directory appears complete or not at all -----------------

    def _get_output_dir(self, trial) -> str:
        return getattr(self, "_checkpoint_staging", None) or super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial):
        """TRL's save into OUTPUT_DIR/.logitless-staging/checkpoint-STEP, published with one rename once every
        process has written its part; then the usual rotation (``save_total_limit``)."""
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
