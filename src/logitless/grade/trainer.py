"""GRADE trainers: the legacy `GumbelTrainer` and `GumbelTrainerMemoryEfficient`, one loop for both.

An optimizer step takes ``gradient_accumulation_steps`` microbatches of ``batch_size`` prompts. For each
microbatch the trainer rolls out ``max_new_tokens`` relaxed tokens (`dense_rollout` or `sparse_rollout`),
scores the soft completion with the reward, and backpropagates

    loss = mean over rollouts of (-reward + kl_coef * KL(policy || reference)) / gradient_accumulation_steps

where KL is the exact per-token KL summed over the rollout's positions. Then the gradients are
clipped to ``max_grad_norm`` and the optimizer steps. tau follows `GradeConfig.tau_at(step)`.

The Gumbel noise of microbatch m of optimizer step s is drawn from a generator seeded with
(seed, s, m), so a run resumed at step s draws what the uninterrupted run drew; ``noise=`` overrides it
(tests feed both trainers the same tensor).
"""

from __future__ import annotations

import copy
import time

import torch

from logitless.grade.config import GradeConfig
from logitless.grade.legacy import dense_rollout
from logitless.grade.lora import base_of, with_lora
from logitless.grade.metrics import step_metrics
from logitless.grade.parts import CausalLMParts
from logitless.grade.rewards import RewardInputs, SoftReward
from logitless.grade.rollout import NoiseStream, Rollout, sample_tokens, sparse_rollout
from logitless.grade.soft_tokens import PromptBatch, SoftTokens, as_records
from logitless.memory import PeakMemory
from logitless.nonfinite import check_step
from logitless.ops.gumbel import check_topk


def microbatch_generator(seed: int, step: int, microbatch: int, device) -> torch.Generator:
    """The noise generator of one microbatch: a function of (seed, step, microbatch) only."""
    return torch.Generator(device=device).manual_seed(((seed * 1_000_003 + step) * 1_009 + microbatch) % 2**63)


class TrainerBase:
    """What the GRADE trainers and the GRPO baseline share: models, optimizer, accumulation, clipping, metrics."""

    def __init__(self, policy, reward: SoftReward, config: GradeConfig, *, tokenizer, reference=None,
                 optimizer: torch.optim.Optimizer | None = None):
        if not isinstance(config, GradeConfig):
            raise TypeError(f"config: expected a GradeConfig, got {type(config).__name__}")
        if not isinstance(reward, SoftReward):
            raise TypeError(f"reward: expected a logitless.grade SoftReward, got {type(reward).__name__}")
        if not callable(tokenizer):
            raise TypeError(f"tokenizer: expected a Hugging Face tokenizer, got {type(tokenizer).__name__}")
        CausalLMParts.of(policy, "policy")  # before anything is copied or wrapped
        reference = reference if reference is not None else copy.deepcopy(policy)
        if config.lora_rank:
            policy = with_lora(policy, config.lora_rank, config.lora_alpha, config.lora_target_modules, config.seed)
        self.model = policy  # what trains (and is saved): the policy, or its peft wrapper
        self.policy = CausalLMParts.of(base_of(policy), "policy")
        self.reference = CausalLMParts.of(reference.eval().requires_grad_(False), "reference")
        if self.reference.vocab_size != self.policy.vocab_size:
            raise ValueError(f"reference: vocabulary of {self.reference.vocab_size}, "
                             f"the policy's {self.policy.vocab_size}")
        reward.check_vocabulary(self.policy.vocab_size)
        self.reward, self.config, self.tokenizer = reward, config, tokenizer
        self.parameters = [p for p in policy.parameters() if p.requires_grad]
        self.optimizer = optimizer or torch.optim.AdamW(self.parameters, lr=config.learning_rate, weight_decay=0.0)
        self.step = 0  # optimizer steps taken
        self.device = self.policy.head.weight.device

    def train_step(self, prompts, noise: torch.Tensor | None = None) -> dict:
        """One optimizer step on ``batch_size * gradient_accumulation_steps`` prompts; returns its metrics.

        ``prompts``: strings, or dicts with a "prompt" and whatever the reward reads ("answer", ...).
        ``noise``: optional Gumbel noise (batch_size * gradient_accumulation_steps, max_new_tokens, V).
        """
        records = as_records(prompts)
        config = self.config
        expected = config.batch_size * config.gradient_accumulation_steps
        if len(records) != expected:
            raise ValueError(f"prompts: expected batch_size * gradient_accumulation_steps = {expected}, "
                             f"got {len(records)}")
        with PeakMemory(self.device) as peak:
            started = time.perf_counter()
            self.model.train()
            sums = {}
            for micro in range(config.gradient_accumulation_steps):
                rows = slice(micro * config.batch_size, (micro + 1) * config.batch_size)
                prompt = PromptBatch.from_records(records[rows], self.tokenizer, self.device)
                generator = microbatch_generator(config.seed, self.step, micro, self.device)
                parts = self.microbatch(prompt, None if noise is None else noise[rows], generator)
                for name, value in parts.items():
                    sums[name] = sums.get(name, 0.0) + value / config.gradient_accumulation_steps
            applied = check_step(self.step + 1, self.model, [sums["loss"]], policy=config.on_nonfinite,
                                 advice="Lower learning_rate, or set on_nonfinite='skip' to skip such steps.")
            grad_norm = float("nan")
            if applied:
                grad_norm = float(torch.nn.utils.clip_grad_norm_(self.parameters, config.max_grad_norm))
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            step_s = time.perf_counter() - started
        self.step += 1
        return step_metrics(step=self.step, grad_norm=grad_norm, step_s=step_s, peak_mb=peak.megabytes,
                            skipped=not applied, **sums)

    def microbatch(self, prompt: PromptBatch, noise, generator) -> dict:
        """Forward and backward of one microbatch; returns its metrics (means over its rollouts)."""
        raise NotImplementedError

    @torch.no_grad()
    def evaluate(self, prompts, *, seed: int = 0) -> float:
        """The held-out score: the mean reward of ordinary sampled completions of ``prompts`` (hard tokens at
        temperature 1, ``max_new_tokens`` each, the training reward), ``batch_size`` prompts at a time.

        The sampling noise is a function of ``seed`` alone, so successive evaluations, and the trainers of
        different methods, differ only by their policies. Nothing is trained; the global RNG is untouched.
        """
        records = as_records(prompts)
        if not records:
            raise ValueError("prompts: expected at least one prompt to evaluate")
        generator = torch.Generator(device=self.device).manual_seed(seed)
        training = self.model.training
        self.model.eval()
        rewards = []
        for start in range(0, len(records), self.config.batch_size):
            prompt = PromptBatch.from_records(records[start:start + self.config.batch_size], self.tokenizer,
                                              self.device)
            completion_ids = sample_tokens(self.policy, prompt, self.config.max_new_tokens, generator)  # (B, T)
            rewards.append(self.reward(RewardInputs(prompt, SoftTokens.hard(completion_ids))).float())  # (B,)
        self.model.train(training)
        return float(torch.cat(rewards).mean())


class _GradeTrainer(TrainerBase):
    def rollout(self, prompt: PromptBatch, noise: NoiseStream, tau: float) -> Rollout:
        raise NotImplementedError

    def microbatch(self, prompt: PromptBatch, noise, generator) -> dict:
        config = self.config
        tau = config.tau_at(self.step)
        stream = NoiseStream(noise, generator, prompt.input_ids.shape[0], self.policy.vocab_size, self.device)
        rollout = self.rollout(prompt, stream, tau)
        reward = self.reward(RewardInputs(prompt, rollout.completion))  # (B,)
        loss = (-reward + config.kl_coef * rollout.kl).mean()
        (loss / config.gradient_accumulation_steps).backward()
        return {"reward": float(reward.detach().mean()), "kl": float(rollout.kl.detach().mean()),
                "loss": float(loss.detach()), "tau": tau, "topk_tail_mass": rollout.topk_tail_mass,
                "max_soft_weight": rollout.max_soft_weight}


class GumbelTrainer(_GradeTrainer):
    """Legacy GRADE (the original design): dense (B, V) soft tokens, the policy re-reading its whole prefix
    each step, the reference's logits stored for the whole rollout, the KL from stored logits (in the loss).
    ``gumbel_topk`` is not used: every token is kept."""

    def rollout(self, prompt, noise, tau):
        return dense_rollout(self.policy, self.reference, prompt, noise, steps=self.config.max_new_tokens, tau=tau,
                             hard=self.config.straight_through)


class GumbelTrainerMemoryEfficient(_GradeTrainer):
    """GRADE without (B, T, V) tensors: top-k Gumbel with sparse soft tokens, a differentiable KV cache
    (checkpointed per step), the reference on its own KV cache, the exact KL per step with `fused_linear_kl`."""

    def __init__(self, policy, reward: SoftReward, config: GradeConfig, **kwargs):
        super().__init__(policy, reward, config, **kwargs)
        check_topk(config.gumbel_topk, self.policy.vocab_size, "gumbel_topk")  # the one trainer that keeps k tokens

    def rollout(self, prompt, noise, tau):
        config = self.config
        return sparse_rollout(self.policy, self.reference, prompt, noise, steps=config.max_new_tokens,
                              k=config.gumbel_topk, tau=tau, hard=config.straight_through,
                              checkpointing=config.activation_checkpointing)
