"""The gradients `logitless bench grade-variance` compares: each method's minibatch gradients at fixed weights,
their running statistics, and the reference gradient of E[reward] (see `logitless.bench.grade_variance`)."""

from __future__ import annotations

import statistics
from dataclasses import asdict

import torch

from logitless.bench.grade_variance import METHODS, PROMPTS, GradeVarianceConfig


class _GradientStats:
    """Running sums over flattened gradients: their mean, the spread around it, cosines to a reference."""

    def __init__(self, reference: torch.Tensor | None = None):
        self.reference, self.total, self.square_norms, self.cosines = reference, None, [], []

    def add(self, gradient: torch.Tensor) -> None:
        self.total = gradient.clone() if self.total is None else self.total.add_(gradient)
        self.square_norms.append(float(gradient.square().sum()))
        if self.reference is not None:
            self.cosines.append(float(torch.nn.functional.cosine_similarity(gradient, self.reference, dim=0)))

    def summary(self) -> dict:
        count = len(self.square_norms)
        mean = self.total / count
        mean_square = float(mean.square().sum())
        spread = (sum(self.square_norms) - count * mean_square) / (count - 1)  # sum of unbiased variances
        return {"relative_variance": spread / mean_square, "cosine_to_reference": statistics.mean(self.cosines),
                "cosine_to_reference_std": statistics.stdev(self.cosines),
                "mean_cosine_to_reference": float(torch.nn.functional.cosine_similarity(mean, self.reference, dim=0)),
                "minibatches": count}


def _flat_gradient(parameters) -> torch.Tensor:
    gradient = torch.cat([p.grad.flatten() for p in parameters])
    for p in parameters:
        p.grad = None
    return gradient


def _reference_gradient(policy, reward, config: GradeVarianceConfig, prompts) -> tuple[torch.Tensor, float]:
    """REINFORCE with the group-mean baseline over many samples per prompt: (mean gradient, half-vs-half cosine)."""
    from logitless.grade.parts import CausalLMParts
    from logitless.grade.rewards import RewardInputs
    from logitless.grade.rollout import sample_tokens
    from logitless.grade.soft_tokens import PromptBatch, SoftTokens
    from logitless.logprobs import get_response_log_probs

    parts = CausalLMParts.of(policy, "policy")
    parameters = [p for p in policy.parameters() if p.requires_grad]
    per_prompt = config.reference_samples // len(PROMPTS)
    batches = max(2, per_prompt // 16)  # samples of one prompt per batch: per_prompt / batches
    halves = [None, None]
    for batch in range(batches):
        repeated = PromptBatch(prompts.input_ids.repeat_interleave(per_prompt // batches, 0),
                               prompts.attention_mask.repeat_interleave(per_prompt // batches, 0),
                               [r for r in prompts.records for _ in range(per_prompt // batches)])
        generator = torch.Generator().manual_seed(10_000 + batch)
        completion = sample_tokens(parts, repeated, config.max_new_tokens, generator)  # (N, T)
        with torch.no_grad():
            rewards = reward(RewardInputs(repeated, SoftTokens.hard(completion))).view(len(PROMPTS), -1)
        advantages = (rewards - rewards.mean(dim=1, keepdim=True)).flatten()  # group-mean baseline
        sequence = torch.cat([repeated.input_ids, completion], dim=1)
        attention = torch.cat([repeated.attention_mask, torch.ones_like(completion)], dim=1)[:, :-1]
        log_probs = get_response_log_probs(policy, sequence[:, :-1], sequence[:, 1:],
                                           attention_mask=attention)["log_probs"][:, -config.max_new_tokens:]
        (-(advantages[:, None] * log_probs).sum(dim=1).mean()).backward()  # the gradient of -E[reward]
        gradient = _flat_gradient(parameters)
        half = batch * 2 // batches
        halves[half] = gradient if halves[half] is None else halves[half].add_(gradient)
    half_cosine = float(torch.nn.functional.cosine_similarity(halves[0], halves[1], dim=0))
    return (halves[0] + halves[1]) / batches, half_cosine


def _body_mask(parameters, parts) -> torch.Tensor:
    """Over the flattened gradient: True outside the embedding / LM head matrices (the transformer body).

    A sampled estimator touches only the embedding rows of the tokens it saw, while the true gradient
    has every row: the body's gradient is dense for all of them and compares like with like."""
    vocabulary_matrices = {id(parts.embedding.weight), id(parts.head.weight)}
    return torch.cat([torch.full((p.numel(),), id(p) not in vocabulary_matrices) for p in parameters])


def _exact_reference_gradient(policy, reward, prompts) -> torch.Tensor:
    """The true gradient of -E[reward] for one-token completions and a reward linear in the soft token."""
    from logitless.grade.parts import CausalLMParts
    from logitless.grade.rewards import RewardInputs
    from logitless.grade.soft_tokens import SoftTokens
    from logitless.hf import final_hidden_states

    parts = CausalLMParts.of(policy, "policy")
    hidden = final_hidden_states(policy, prompts.input_ids, prompts.attention_mask)[:, -1]  # left padded: last prompt token
    probs = torch.softmax(parts.logits(hidden), dim=-1)  # (P, V): the next-token distribution
    (-reward(RewardInputs(prompts, SoftTokens(probs.unsqueeze(1)))).mean()).backward()
    return _flat_gradient([p for p in policy.parameters() if p.requires_grad])


def estimator_report(config: GradeVarianceConfig, progress: bool = True) -> dict:
    """The report of `logitless bench grade-variance`: each method's gradient statistics against the reference."""
    from tqdm.auto import tqdm

    from logitless.grade import GradeConfig, GRPOBaseline, GumbelTrainerMemoryEfficient, TokenSetReward
    from logitless.grade.soft_tokens import PromptBatch, as_records
    from logitless.grade.trainer import microbatch_generator
    from logitless.models import load_model_and_tokenizer

    policy, tokenizer = load_model_and_tokenizer("tiny-qwen2", seed=0)
    reward = TokenSetReward.capitalized_words(tokenizer)
    prompts = PromptBatch.from_records(as_records(PROMPTS), tokenizer)
    if config.max_new_tokens == 1:
        reference, half_cosine, kind = _exact_reference_gradient(policy, reward, prompts), None, "exact"
    else:
        reference, half_cosine = _reference_gradient(policy, reward, config, prompts)
        kind = f"REINFORCE over {config.reference_samples} samples"
    minibatch = PromptBatch.from_records(as_records([PROMPTS[i % len(PROMPTS)] for i in range(config.batch_size)]),
                                         tokenizer)
    results = {}
    for method in tqdm(METHODS, desc="bench grade-variance", disable=not progress):
        grade = GradeConfig(straight_through=method == "ste", gumbel_topk=config.gumbel_topk,
                            max_new_tokens=config.max_new_tokens, batch_size=config.batch_size, kl_coef=0.0,
                            tau_start=config.tau, tau_end=config.tau,
                            grpo_group_size=config.batch_size // len(PROMPTS))
        trainer_class = GRPOBaseline if method == "grpo" else GumbelTrainerMemoryEfficient
        trainer = trainer_class(policy, reward, grade, tokenizer=tokenizer)
        body = _body_mask(trainer.parameters, trainer.policy)
        stats = {"all": _GradientStats(reference), "body": _GradientStats(reference[body])}
        for index in range(config.minibatches):
            trainer.microbatch(minibatch, None, microbatch_generator(1, 0, index, "cpu"))
            gradient = _flat_gradient(trainer.parameters)
            stats["all"].add(gradient)
            stats["body"].add(gradient[body])
        results[method] = stats["all"].summary()
        results[method]["body"] = stats["body"].summary()
    return {"config": asdict(config), "reference": kind, "reference_half_cosine": half_cosine, "results": results}
