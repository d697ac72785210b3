"""Reference gradients of GRADE's objective, -E[reward], at fixed weights: what an estimator's minibatch gradients
(GRADE's relaxed rollouts, GRPO's samples) are judged against.

* `exact_reward_gradient`: exact for one-token completions and a reward linear in the soft token (the expected
  reward is the reward of the next-token distribution p, so autograd through p gives the true gradient).
* `reinforce_reward_gradient`: for longer completions, REINFORCE with the group-mean baseline over many sampled
  completions per prompt (unbiased), with the cosine between the estimates of its two halves (how much of it is
  noise).

Both return the gradient flattened over the policy's trainable parameters (`flat_gradient`).
"""

from __future__ import annotations

import torch

from logitless.grade.parts import CausalLMParts
from logitless.grade.rewards import RewardInputs
from logitless.grade.rollout import sample_tokens
from logitless.grade.soft_tokens import PromptBatch, SoftTokens
from logitless.hf import final_hidden_states
from logitless.logprobs import get_response_log_probs


def flat_gradient(parameters) -> torch.Tensor:
    """The parameters' gradients as one flat vector (P,); the gradients are cleared."""
    gradient = torch.cat([p.grad.flatten() for p in parameters])
    for p in parameters:
        p.grad = None
    return gradient


def reinforce_reward_gradient(policy, reward, prompts: PromptBatch, *, samples_per_prompt: int,
                              max_new_tokens: int) -> tuple[torch.Tensor, float]:
    """REINFORCE with the group-mean baseline over ``samples_per_prompt`` completions of each prompt:
    (mean gradient (P,), the cosine between the two halves' estimates)."""
    parts = CausalLMParts.of(policy, "policy")
    parameters = [p for p in policy.parameters() if p.requires_grad]
    num_prompts = prompts.input_ids.shape[0]
    batches = max(2, samples_per_prompt // 16)  # samples of one prompt per batch: samples_per_prompt / batches
    per_batch = samples_per_prompt // batches
    halves = [None, None]
    for batch in range(batches):
        repeated = PromptBatch(prompts.input_ids.repeat_interleave(per_batch, 0),
                               prompts.attention_mask.repeat_interleave(per_batch, 0),
                               [r for r in prompts.records for _ in range(per_batch)])
        generator = torch.Generator().manual_seed(10_000 + batch)
        completion = sample_tokens(parts, repeated, max_new_tokens, generator)  # (N, T)
        with torch.no_grad():
            rewards = reward(RewardInputs(repeated, SoftTokens.hard(completion))).view(num_prompts, -1)
        advantages = (rewards - rewards.mean(dim=1, keepdim=True)).flatten()  # group-mean baseline
        sequence = torch.cat([repeated.input_ids, completion], dim=1)
        attention = torch.cat([repeated.attention_mask, torch.ones_like(completion)], dim=1)[:, :-1]
        log_probs = get_response_log_probs(policy, sequence[:, :-1], sequence[:, 1:],
                                           attention_mask=attention)["log_probs"][:, -max_new_tokens:]
        (-(advantages[:, None] * log_probs).sum(dim=1).mean()).backward()  # the gradient of -E[reward]
        gradient = flat_gradient(parameters)
        half = batch * 2 // batches
        halves[half] = gradient if halves[half] is None else halves[half].add_(gradient)
    half_cosine = float(torch.nn.functional.cosine_similarity(halves[0], halves[1], dim=0))
    return (halves[0] + halves[1]) / batches, half_cosine


def exact_reward_gradient(policy, reward, prompts: PromptBatch) -> torch.Tensor:
    """The true gradient of -E[reward] (P,) for one-token completions and a reward linear in the soft token."""
    parts = CausalLMParts.of(policy, "policy")
    hidden = final_hidden_states(policy, prompts.input_ids,
                                 prompts.attention_mask)[:, -1]  # left padded: last prompt token
    probs = torch.softmax(parts.logits(hidden), dim=-1)  # (P, V): the next-token distribution
    (-reward(RewardInputs(prompts, SoftTokens(probs.unsqueeze(1)))).mean()).backward()
    return flat_gradient([p for p in policy.parameters() if p.requires_grad])
