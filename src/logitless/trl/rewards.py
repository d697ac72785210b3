"""Reward functions that read the policy's own logits: ``completion_logits`` and ``completion_logprobs``.

A reward function that declares a ``completion_logits`` and/or ``completion_logprobs`` parameter
receives, for completion i, a `CompletionLogits` view (row t: the logits completion token t was
scored from, divided by the training temperature, computed on demand) and the ``(C_i,)`` log-prob of
each completion token. Nothing of size ``(C, V)`` is stored, and nothing is generated twice. The
hidden states behind the views come from the cheapest place that has them:

1. TRL's old-log-prob pass, when it runs before the rewards (vLLM importance sampling, or generation
   and optimizer steps that do not line up): no extra work;
2. else, with transformers' ``generate`` (one turn, no tools), the LM head's input while generating;
3. else (vLLM, continuous batching, ``rollout_func``, tools), one no-grad pass of the body over
   prompt + completion, counted in the ``logitless/reward_body_passes`` metric.

Rows equal ``model(prompt + completion).logits / temperature`` at the completion positions. Tool
results inside a completion were not sampled: their rows are teacher-forced like every other row.
"""

from __future__ import annotations

import functools
import inspect

import torch
from trl.trainer.utils import pad

from logitless.ops.fused import linear_token_stats
from logitless.ops.head import LinearHead, stat_dtype
from logitless.ops.lazy import CompletionLogits
from logitless.trl.lm_head import detached_head

LOGIT_KWARGS = ("completion_logits", "completion_logprobs")
BODY_PASSES_METRIC = "logitless/reward_body_passes"


def wanted_logit_kwargs(reward_func) -> tuple[str, ...]:
    """Which of completion_logits / completion_logprobs a reward function declares by name."""
    if isinstance(reward_func, torch.nn.Module):
        return ()
    try:
        parameters = inspect.signature(reward_func).parameters
    except (TypeError, ValueError):
        return ()
    return tuple(name for name in LOGIT_KWARGS if name in parameters)


def completion_views(hidden: torch.Tensor, completion_ids_list: list[list[int]], head: LinearHead):
    """hidden (B, C, H), row t of completion i scoring its token t -> (completion_logits, completion_logprobs)."""
    if hidden.shape[0] != len(completion_ids_list):
        raise RuntimeError(f"{hidden.shape[0]} rows of hidden states for {len(completion_ids_list)} completions")
    lengths = [len(ids) for ids in completion_ids_list]
    hidden = hidden.to(head.weight.device, head.weight.dtype)
    mask = torch.zeros(hidden.shape[:2], dtype=torch.bool, device=hidden.device)
    ids = torch.zeros(hidden.shape[:2], dtype=torch.long, device=hidden.device)
    for row, completion in enumerate(completion_ids_list):
        ids[row, : len(completion)] = torch.tensor(completion, dtype=torch.long)
        mask[row, : len(completion)] = True
    with torch.no_grad():
        log_probs = torch.zeros(mask.shape, dtype=stat_dtype(hidden.dtype), device=hidden.device).masked_scatter(
            mask, linear_token_stats(hidden[mask], targets=ids[mask], head=head, need_entropy=False)[0])
    views = [CompletionLogits(hidden[row, :length], head) for row, length in enumerate(lengths)]
    return views, [log_probs[row, :length] for row, length in enumerate(lengths)]



def _policy_adapters_on(model) -> bool:
    """False while TRL scores the reference through the policy's own PEFT model (``beta > 0``): its adapters are
    off, or its "ref" adapter is the active one. Those rows are not the policy's."""
    if not hasattr(model, "peft_config"):
        return True
    from peft.tuners.tuners_utils import BaseTunerLayer

    active = getattr(model, "active_adapters", ())  # a property of a PeftModel, a method of transformers' mixin
    if "ref" in (active() if callable(active) else active):
        return False
    return not any(isinstance(module, BaseTunerLayer) and module.disable_adapters for module in model.modules())

class LogitAwareRewards:
    """Mixin for `trl.GRPOTrainer` and `trl.RLOOTrainer`: hands ``completion_logits`` / ``completion_logprobs``
    to the reward functions
    that declare them. `LogitlessHead`, after it in the bases, installs `keep_scored_hidden` as the fused LM head's
    observer of the hidden states it scores."""

    def __init__(self, *args, **kwargs):
        self._hidden_capture: list[torch.Tensor] | None = None  # armed: scored hidden states are appended here
        super().__init__(*args, **kwargs)
        self._logit_reward_funcs = {i: wanted for i, f in enumerate(self.reward_funcs)
                                    if (wanted := wanted_logit_kwargs(f))}
        self._reward_hidden: torch.Tensor | None = None  # (B, C, H) for the rewards of the current batch
        self._prompt_completion_ids = None  # the last generated (prompt_ids_list, completion_ids_list)

    @property
    def captures_during_generate(self) -> bool:
        """Whether completion hidden states can be read from transformers' generate (one sampled turn). RLOOTrainer
        has neither tools nor a rollout_func."""
        return not (self.use_vllm or self.use_transformers_continuous_batching
                    or getattr(self, "rollout_func", None) is not None or getattr(self, "tools", None))

    @property
    def old_pass_before_rewards(self) -> bool:
        """Whether TRL scores the old log-probs (a policy pass over prompt + completion) before the rewards."""
        generate_every = self.args.steps_per_generation * self.num_iterations
        return (self.args.gradient_accumulation_steps % generate_every != 0
                or (self.use_vllm and getattr(self, "vllm_importance_sampling_correction", False)))

    def keep_scored_hidden(self, hidden: torch.Tensor, label_mask: torch.Tensor) -> None:
        """The fused LM head's observer: while armed, keep the hidden states each scoring call reads."""
        if self._hidden_capture is not None:
            self._hidden_capture.append(hidden)

    def _generate(self, prompts):
        self._reward_hidden = self._prompt_completion_ids = None  # nothing left from a batch that failed
        output = super()._generate(prompts)
        if self._logit_reward_funcs:
            self._prompt_completion_ids = (output[0], output[1])
        return output

    def _generate_single_turn(self, *args, **kwargs):
        generate = functools.partial(super()._generate_single_turn, *args, **kwargs)
        if not (self._logit_reward_funcs and self.captures_during_generate and not self.old_pass_before_rewards):
            return generate()
        steps: list[torch.Tensor] = []  # per generated token: (B, H), the head's input for its last position
        head = self.accelerator.unwrap_model(self.model).get_output_embeddings()
        handle = head.register_forward_pre_hook(lambda _module, args: steps.append(args[0][:, -1, :].detach()))
        try:
            output = generate()
        finally:
            handle.remove()
        self._reward_hidden = torch.stack(steps, dim=1)  # (B, steps, H): step k produced completion token k
        return output

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        arm = (self._logit_reward_funcs and model is self.model and not torch.is_grad_enabled()
               and self._reward_hidden is None and self._prompt_completion_ids is not None
               and _policy_adapters_on(self.accelerator.unwrap_model(model)))
        if not arm:
            return super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                              *args, **kwargs)
        self._hidden_capture = []
        try:
            result = super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                                *args, **kwargs)
            self._reward_hidden = torch.cat([h[:, -logits_to_keep:] for h in self._hidden_capture], dim=0)
        finally:
            self._hidden_capture = None
        return result

    def _hidden_for_rewards(self, mode: str) -> torch.Tensor:
        """(B, C, H) completion hidden states: captured already, or from one no-grad body pass (counted)."""
        body_passes = 0
        if self._reward_hidden is None:
            prompt_ids_list, completion_ids_list = self._prompt_completion_ids
            device = self.accelerator.device
            prompts = [torch.tensor(ids) for ids in prompt_ids_list]
            completions = [torch.tensor(ids) for ids in completion_ids_list]
            pad_id = self._tokenizer.pad_token_id
            input_ids = torch.cat([pad(prompts, pad_id, "left"), pad(completions, pad_id, "right")], 1).to(device)
            attention_mask = torch.cat([pad([torch.ones_like(p) for p in prompts], 0, "left"),
                                        pad([torch.ones_like(c) for c in completions], 0, "right")], 1).to(device)
            with torch.no_grad():
                self._get_per_token_logps_and_entropies(self.model, input_ids, attention_mask,
                                                        max(len(c) for c in completion_ids_list))
            body_passes = 1
        self._metrics[mode][BODY_PASSES_METRIC].append(float(body_passes))
        hidden, self._reward_hidden, self._prompt_completion_ids = self._reward_hidden, None, None
        return hidden

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        if not self._logit_reward_funcs:
            return super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        mode = "train" if self.model.training else "eval"
        hidden = self._hidden_for_rewards(mode)
        head = detached_head(self.accelerator.unwrap_model(self.model), self.temperature,
                             getattr(self.args, "cast_lm_head_to_fp32", False))  # RLOOConfig has no such option
        views, log_probs = completion_views(hidden, completion_ids_list, head)
        available = {"completion_logits": views, "completion_logprobs": log_probs}
        originals = list(self.reward_funcs)
        for index, wanted in self._logit_reward_funcs.items():
            bound = functools.partial(originals[index], **{name: available[name] for name in wanted})
            self.reward_funcs[index] = functools.update_wrapper(bound, originals[index])
        try:
            return super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        finally:
            self.reward_funcs[:] = originals

