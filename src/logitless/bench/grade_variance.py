"""`logitless bench grade-variance`: how noisy and how biased each gradient estimator is, at fixed weights.

The policy (embedded tiny Qwen2, real vocabulary) and the reward (the capitalized-word fraction) stay
fixed; no optimizer step is taken. For GRADE (Gumbel-softmax), GRADE-STE and GRPO, ``minibatches``
independent minibatches (fresh noise / samples, the same prompts) of ``batch_size`` rollouts each give
flattened gradients g_1..g_M of the reward objective (kl_coef = 0, so only the reward's gradient is
estimated). Reported per method:

* ``relative_variance``: sum of the per-coordinate variances across minibatches / |mean g|^2, i.e.
  E|g_i - mean g|^2 / |mean g|^2 (below 1: one minibatch already points where the mean does);
* ``cosine_to_reference`` (mean, std over minibatches) and ``mean_cosine_to_reference`` (of mean g):
  agreement with the true gradient of E[reward]. With ``max_new_tokens`` 1 it is exact: the reward is
  linear in the soft token, so E_{v ~ p}[r(v)] = r(p) and autograd through the policy's softmax p gives
  the true gradient (``reference: "exact"``). With longer completions it is a many-sample estimate, the
  REINFORCE gradient (unbiased, group-mean baseline) over ``reference_samples`` sampled completions, and
  ``reference_half_cosine`` (the cosine between the estimates of the two halves of those samples) says
  how much of it is noise.

GRADE's gradient is biased (the relaxation is not the sampled sequence), GRPO's is not: the cosine of
the method's mean gradient to the reference separates bias from noise. Every number is given for all
parameters and for the body alone (without the embedding / LM head matrix, whose sampled gradients
touch only the rows of the tokens a minibatch saw).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

import torch

from logitless.bench.options import require_writable, write_report

PROMPTS = ["Once upon a time", "The weather today is", "My favourite food is", "Yesterday I went to"]
METHODS = ("gumbel", "ste", "grpo")


@dataclass
class GradeVarianceConfig:
    minibatches: int = 32
    batch_size: int = 8  # rollouts per minibatch: every prompt batch_size / 4 times (GRPO's group size)
    max_new_tokens: int = 1  # 1: the reference gradient is exact
    gumbel_topk: int = 1024
    tau: float = 0.7
    reference_samples: int = 256


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


def run(config: GradeVarianceConfig, progress: bool = True) -> dict:
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


def format_table(report: dict) -> str:
    c = report["config"]
    halves = report["reference_half_cosine"]
    lines = [f"gradient estimators at fixed weights: {c['minibatches']} minibatches of {c['batch_size']} rollouts x "
             f"{c['max_new_tokens']} tokens, tau {c['tau']}, top-k {c['gumbel_topk']}; reference gradient: "
             f"{report['reference']}" + ("" if halves is None else f" (its two halves agree to cosine {halves:.3f})"),
             f"{'method':<8}{'rel. variance':>15}{'cos(g_i, ref)':>16}{'cos(mean g, ref)':>18}"]
    for part in ("all parameters", "body only (no embedding / LM head)"):
        lines.append(f"  {part}")
        for name, r in report["results"].items():
            r = r if part.startswith("all") else r["body"]
            lines.append(f"{name:<8}{r['relative_variance']:>15.3f}{r['cosine_to_reference']:>9.3f} ± "
                         f"{r['cosine_to_reference_std']:<5.3f}{r['mean_cosine_to_reference']:>17.3f}")
    return "\n".join(lines)


def add_parser(targets) -> None:
    defaults = GradeVarianceConfig()
    parser = targets.add_parser(
        "grade-variance",
        help="variance and bias of the GRADE, GRADE-STE and GRPO gradient estimators at fixed weights",
        description="At the embedded tiny Qwen2's initial weights, each method's gradient of -reward (the "
                    "capitalized-word fraction, kl_coef 0) on independent minibatches: their relative variance "
                    "and their cosines, one by one and averaged, with the true gradient (exact for one-token "
                    "completions, otherwise a REINFORCE estimate over --reference-samples).")
    meaning = {"minibatches": "independent minibatches per method", "batch_size": "rollouts per minibatch",
               "max_new_tokens": "tokens per rollout (1: the reference gradient is exact)",
               "gumbel_topk": "tokens kept per step by GRADE", "tau": "Gumbel-softmax temperature",
               "reference_samples": "samples of the REINFORCE reference when max_new_tokens > 1"}
    for name, value in asdict(defaults).items():
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, type=type(value), default=value,
                            help=f"{meaning[name]} (default: %(default)s)")
    parser.add_argument("--json", help="write the report here (default: not written)")
    parser.set_defaults(handler=_main)


def _main(args) -> int:
    for name in asdict(GradeVarianceConfig()):
        value, flag = getattr(args, name), f"--{name.replace('_', '-')}"
        if name == "minibatches" and value < 2:
            raise SystemExit(f"{flag}: must be >= 2 (a variance needs two minibatches), got {value}")
        if not value > 0:
            raise SystemExit(f"{flag}: must be > 0, got {value}")
    config = GradeVarianceConfig(**{name: getattr(args, name) for name in asdict(GradeVarianceConfig())})
    if config.reference_samples < 2 * len(PROMPTS) or config.batch_size % len(PROMPTS) or config.batch_size < 8:
        raise SystemExit(f"--batch-size / --reference-samples: need multiples of the {len(PROMPTS)} prompts "
                         f"(batch >= 8 so that GRPO's groups have 2 completions, reference >= {2 * len(PROMPTS)})")
    require_writable(args, ("json",))
    report = run(config)
    return write_report(report, args, format_table)
