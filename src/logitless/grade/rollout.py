"""The memory-efficient differentiable rollout (top-k Gumbel, sparse soft tokens, KV cache, online exact KL),
and hard sampling for the GRPO baseline.

At each of the T steps, from the policy's final hidden state h (B, H):

1. under no_grad, the full logits z (B, V) pick the k tokens with the largest z + g (g the step's
   Gumbel noise), and in the same pass over that buffer give the metric of the relaxed sample's mass
   outside those k (`perturbed_topk_and_tail_mass`: no (B, V) softmax);
2. with a graph, only those k logits are recomputed, ``h @ W[idx].T``, and relaxed:
   ``w = softmax((z_idx + g_idx) / tau)`` (straight-through one-hot for STE);
3. the two models' final hidden states are kept (B, H each, the policy's in the graph); after the
   rollout `fused_linear_kl` gives every step's exact full-vocabulary KL(policy || reference) from them
   in one chunked pass (the LM heads are streamed once per chunk of rows, not once per step), and the
   KL is in the loss;
4. the soft token ``sum_j w_j E[idx_j]`` is the policy's next input (`CachedStepper`), and the same
   weights, detached, through the reference's own embedding are the reference's next input: the
   reference reads the same prefix as the policy (the legacy trainer uses the same convention).

No (B, T, V) tensor and no (B, V) tensor with a graph exist; the step's logits (B, V) are the only (B, V)
buffer besides its noise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from logitless.grade.parts import CausalLMParts
from logitless.grade.soft_tokens import PromptBatch, SoftTokens
from logitless.grade.steppers import CachedStepper
from logitless.op_settings import BlockSizes
from logitless.ops.gumbel import gumbel_noise, perturbed_topk_and_tail_mass, relaxed_weights


# The rollout's KL takes 64 tokens per row chunk: each chunk streams both LM heads once and holds a few
# (tokens, vocab) fp32 blocks (64 x 151,936 = 39 MB each at the default vocabulary block).
KL_BLOCK_SIZES = BlockSizes(tokens=64)


@dataclass
class Rollout:
    completion: SoftTokens  # (B, T, k) or (B, T, V)
    kl: torch.Tensor  # (B,) KL(policy || reference) summed over the T positions, in the graph
    topk_tail_mass: float  # mean over positions of the relaxed sample's weight outside the kept tokens
    max_soft_weight: float  # mean over positions of the largest soft weight


class NoiseStream:
    """The Gumbel noise of each step, (B, V): slices of a given (B, T, V) tensor, or drawn from a generator."""

    def __init__(self, noise: torch.Tensor | None, generator: torch.Generator | None, batch: int, vocab: int,
                 device):
        if noise is not None and (noise.dim() != 3 or noise.shape[0] != batch or noise.shape[2] != vocab):
            raise ValueError(f"noise: expected ({batch}, max_new_tokens, {vocab}), got {tuple(noise.shape)}")
        self.noise, self.generator, self.shape, self.device = noise, generator, (batch, vocab), device

    def at(self, step: int) -> torch.Tensor:
        if self.noise is not None:
            return self.noise[:, step].to(self.device, torch.float32)
        return gumbel_noise(self.shape, generator=self.generator, device=self.device)


def _embed_prompt(parts: CausalLMParts, prompt: PromptBatch) -> torch.Tensor:
    return parts.embedding.of_ids(prompt.input_ids)


def sparse_rollout(policy: CausalLMParts, reference: CausalLMParts, prompt: PromptBatch, noise: NoiseStream, *,
                   steps: int, k: int, tau: float, hard: bool, checkpointing: bool = True,
                   stepper_class=CachedStepper) -> Rollout:
    """T = ``steps`` relaxed tokens with k kept per step; ``stepper_class`` may be `PrefixStepper` (tests)."""
    options = {"checkpointing": checkpointing} if stepper_class is CachedStepper else {}
    policy_steps = stepper_class(policy, _embed_prompt(policy, prompt), prompt.attention_mask, **options)
    hidden = policy_steps.start()  # (B, H)
    with torch.no_grad():
        reference_steps = CachedStepper(reference, _embed_prompt(reference, prompt), prompt.attention_mask)
        reference_hidden = reference_steps.start()
    indices, weights, hiddens, reference_hiddens, tail_mass, top_weight = [], [], [], [], 0.0, 0.0
    for t in range(steps):
        step_noise = noise.at(t)  # (B, V)
        with torch.no_grad():
            step_indices, step_tail_mass = perturbed_topk_and_tail_mass(policy.logits(hidden), step_noise, k, tau)
            tail_mass = tail_mass + step_tail_mass.mean()  # a tensor: no device sync per step
        step_weights = relaxed_weights(policy.selected_logits(hidden, step_indices)
                                       + step_noise.gather(-1, step_indices), tau, hard)  # (B, k)
        hiddens.append(hidden)
        reference_hiddens.append(reference_hidden)
        indices.append(step_indices)
        weights.append(step_weights)
        top_weight = top_weight + step_weights.detach().amax(-1).mean()
        if t + 1 < steps:
            token = SoftTokens(step_weights.unsqueeze(1), step_indices.unsqueeze(1))
            hidden = policy_steps.step(policy.embedding.of_soft(token)[:, 0])
            with torch.no_grad():
                reference_hidden = reference_steps.step(reference.embedding.of_soft(token.detach())[:, 0])
    completion = SoftTokens(torch.stack(weights, dim=1), torch.stack(indices, dim=1))
    # every step's exact KL in one chunked pass over the (B, T) final hidden states of both models
    kl = policy.kl_to(torch.stack(hiddens, dim=1), reference, torch.stack(reference_hiddens, dim=1),
                      block_sizes=KL_BLOCK_SIZES)  # (B, T)
    return Rollout(completion, kl.sum(dim=1), float(tail_mass) / steps, float(top_weight) / steps)


@torch.no_grad()
def sample_tokens(policy: CausalLMParts, prompt: PromptBatch, steps: int, generator: torch.Generator | None = None,
                  ) -> torch.Tensor:
    """(B, T) token ids sampled from the policy at temperature 1 (Gumbel-max over the full vocabulary)."""
    stepper = CachedStepper(policy, _embed_prompt(policy, prompt), prompt.attention_mask)
    hidden = stepper.start()
    tokens = []
    for t in range(steps):
        logits = policy.logits(hidden)
        tokens.append((logits + gumbel_noise(logits.shape, generator=generator, device=logits.device)).argmax(-1))
        if t + 1 < steps:
            hidden = stepper.step(policy.embedding.of_ids(tokens[-1].unsqueeze(1))[:, 0])
    return torch.stack(tokens, dim=1)
