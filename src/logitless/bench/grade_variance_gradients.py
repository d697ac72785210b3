"""The gradients `logitless bench grade-variance` compares: each method's minibatch gradients at fixed weights and
their running statistics, against a reference gradient of E[reward] (`logitless.grade.gradients`; see
`logitless.bench.grade_variance`)."""

from __future__ import annotations

import statistics
from dataclasses import asdict

import torch

from logitless.bench.grade_variance_config import METHODS, PROMPTS, GradeVarianceConfig
from logitless.grade.gradients import exact_reward_gradient, flat_gradient, reinforce_reward_gradient


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


def _body_mask(parameters, parts) -> torch.Tensor:
    """Over the flattened gradient: True outside the embedding / LM head matrices (the transformer body).

    A sampled estimator touches only the embedding rows of the tokens it saw, while the true gradient
    has every row: the body's gradient is dense for all of them and compares like with like."""
    vocabulary_matrices = {id(parts.embedding.weight), id(parts.head.weight)}
    return torch.cat([torch.full((p.numel(),), id(p) not in vocabulary_matrices) for p in parameters])


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
        reference, half_cosine, kind = exact_reward_gradient(policy, reward, prompts), None, "exact"
    else:
        reference, half_cosine = reinforce_reward_gradient(policy, reward, prompts,
                                                           samples_per_prompt=config.reference_samples // len(PROMPTS),
                                                           max_new_tokens=config.max_new_tokens)
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
            gradient = flat_gradient(trainer.parameters)
            stats["all"].add(gradient)
            stats["body"].add(gradient[body])
        results[method] = stats["all"].summary()
        results[method]["body"] = stats["body"].summary()
    return {"config": asdict(config), "reference": kind, "reference_half_cosine": half_cosine, "results": results}
