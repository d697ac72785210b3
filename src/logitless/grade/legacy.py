"""The legacy differentiable rollout of `GumbelTrainer`, the original GRADE design (its KL put in the loss).

Dense everything: each step's full logits (B, V) keep a graph and are stored for the whole rollout; the
soft token is the dense Gumbel-softmax (B, V) over the vocabulary, embedded as ``y @ E``; the policy
re-reads the prompt and every soft token so far at each step (`PrefixStepper`); after the rollout the
reference reads the same prefix (the detached soft tokens through its own embedding) in one forward,
its logits (B, T, V) are stored, and the KL is computed from the two stored logits tensors.
The obvious implementation: the memory-efficient rollout must match it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from logitless.grade.parts import CausalLMParts
from logitless.grade.rewards import sequence_inputs
from logitless.grade.rollout import NoiseStream, Rollout
from logitless.grade.soft_tokens import PromptBatch, SoftTokens
from logitless.grade.steppers import PrefixStepper
from logitless.ops.gumbel import relaxed_weights
from logitless.ops.reference import kl_from_log_probs


def dense_rollout(policy: CausalLMParts, reference: CausalLMParts, prompt: PromptBatch, noise: NoiseStream, *,
                  steps: int, tau: float, hard: bool) -> Rollout:
    stepper = PrefixStepper(policy, policy.embedding.of_ids(prompt.input_ids), prompt.attention_mask)
    hidden = stepper.start()
    policy_logits, soft_tokens = [], []
    for t in range(steps):
        logits = policy.logits(hidden)  # (B, V), kept with its graph for the KL at the end
        soft = relaxed_weights(logits + noise.at(t), tau, hard)  # (B, V)
        policy_logits.append(logits)
        soft_tokens.append(soft)
        if t + 1 < steps:
            hidden = stepper.step(policy.embedding.of_soft(SoftTokens(soft.unsqueeze(1)))[:, 0])  # dense y @ E
    completion = SoftTokens(torch.stack(soft_tokens, dim=1))  # (B, T, V)
    reference_logits = _reference_logits(reference, prompt, completion)  # (B, T, V), stored
    kl = kl_from_log_probs(F.log_softmax(torch.stack(policy_logits, dim=1), dim=-1),
                           F.log_softmax(reference_logits, dim=-1))  # (B, T)
    top_weight = float(completion.weights.detach().amax(-1).mean())
    return Rollout(completion, kl.sum(dim=1), 0.0, top_weight)


@torch.no_grad()
def _reference_logits(reference: CausalLMParts, prompt: PromptBatch, completion: SoftTokens) -> torch.Tensor:
    """The reference's logits at every generated position, from one forward over prompt + soft tokens."""
    # prompt and every soft token but the last: (B, P + T - 1, H)
    inputs = sequence_inputs(reference.embedding, prompt, SoftTokens(completion.weights.detach()[:, :-1]))
    hidden = reference.body(**inputs, use_cache=False).last_hidden_state
    steps = completion.weights.shape[1]
    return reference.logits(hidden[:, -steps:].reshape(-1, hidden.shape[-1])).reshape(hidden.shape[0], steps, -1)
