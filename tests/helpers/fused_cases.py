"""The five fused ops as test cases, for the engine's tests and the device tests.

Each op takes a dict of inputs (``case_inputs`` put ``on`` a device and dtype) and keyword options for the op
(``impl``, ``block_sizes``), and returns its outputs and one scalar loss built from them. Every option that changes an
op's arithmetic is set away from its default: a bias, a mask, temperature, softcap, logit scale, label smoothing,
GRPO's KL term, and a second head with another hidden size.
"""

import math

import torch

from logitless import (GRPOSettings, fused_grpo_loss, fused_linear_cross_entropy, fused_linear_jsd, fused_linear_kl,
                       fused_linear_logprobs)

TRAINED = ("hidden", "weight", "bias")
HEADS = ("hidden", "weight", "bias", "hidden_q", "weight_q")


def case_inputs(batch: int, seq: int, hidden: int, vocab: int, seed: int = 0,
                teacher_hidden: int | None = None) -> dict[str, torch.Tensor]:
    """fp64 inputs on the CPU: the head (hidden [batch, seq, hidden], weight [vocab, hidden], bias [vocab]), a second
    head of ``teacher_hidden`` features (default ``hidden - 2``: hidden_q, weight_q), targets, a mask with about a
    fifth of its tokens off, upstream weights of two per-token outputs [2, batch, seq], one advantage per sequence,
    and old and reference log-probs near a uniform distribution's."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*size, scale=1.0):
        return torch.randn(*size, generator=generator, dtype=torch.float64) * scale

    teacher_hidden = hidden - 2 if teacher_hidden is None else teacher_hidden
    return dict(hidden=randn(batch, seq, hidden, scale=0.5), weight=randn(vocab, hidden, scale=0.3),
                bias=randn(vocab, scale=0.1), hidden_q=randn(batch, seq, teacher_hidden, scale=0.5),
                weight_q=randn(vocab, teacher_hidden, scale=0.3),
                targets=torch.randint(0, vocab, (batch, seq), generator=generator),
                mask=torch.rand(batch, seq, generator=generator) > 0.2,
                upstream=randn(2, batch, seq), advantages=randn(batch),
                old_log_probs=randn(batch, seq, scale=0.1) - math.log(vocab),
                ref_log_probs=randn(batch, seq, scale=0.1) - math.log(vocab))


def on(inputs: dict[str, torch.Tensor], device: str = "cpu", dtype: torch.dtype = torch.float32,
       values: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """``inputs`` on ``device``. The heads hold values of ``values`` (default: ``dtype``) computed in ``dtype``, the
    trained ones requiring grad; the other floats are fp32 (fp64 when ``dtype`` is)."""
    others = torch.float64 if dtype == torch.float64 else torch.float32
    moved = {}
    for name, tensor in inputs.items():
        tensor = tensor.to(device)
        if name in HEADS:
            tensor = tensor.to(values or dtype).to(dtype).requires_grad_(name in TRAINED)
        elif tensor.is_floating_point():
            tensor = tensor.to(others)
        moved[name] = tensor
    return moved


def logprobs(x, **options):
    log_probs, entropy = fused_linear_logprobs(x["hidden"], x["weight"], x["targets"], bias=x["bias"], mask=x["mask"],
                                               return_token_entropy=True, temperature=0.8, softcap=3.0, **options)
    return [log_probs, entropy], (log_probs * x["upstream"][0] + entropy * x["upstream"][1]).sum()


def cross_entropy(x, **options):
    loss = fused_linear_cross_entropy(x["hidden"], x["weight"], x["targets"].masked_fill(~x["mask"], -100),
                                      bias=x["bias"], label_smoothing=0.1, logit_scale=1.3, **options)
    return [loss], loss


def grpo(x, **options):
    loss, _ = fused_grpo_loss(x["hidden"], x["weight"], x["targets"], x["mask"], x["advantages"], bias=x["bias"],
                              old_log_probs=x["old_log_probs"], ref_log_probs=x["ref_log_probs"],
                              settings=GRPOSettings(loss_type="dapo", beta=0.04), **options)
    return [loss], loss


def kl(x, **options):
    divergence = fused_linear_kl(x["hidden"], x["weight"], x["hidden_q"], x["weight_q"], bias_p=x["bias"],
                                 mask=x["mask"], temperature=0.9, softcap=2.5, logit_scale=0.8, **options)
    return [divergence], (divergence * x["upstream"][0]).sum()


def jsd(x, **options):
    divergence = fused_linear_jsd(x["hidden"], x["weight"], x["hidden_q"], x["weight_q"], bias_s=x["bias"],
                                  mask=x["mask"], beta=0.3, temperature=0.9, softcap=2.5, logit_scale=0.8, **options)
    return [divergence], (divergence * x["upstream"][0]).sum()


OPS = {"logprobs": logprobs, "cross_entropy": cross_entropy, "grpo": grpo, "kl": kl, "jsd": jsd}


def outputs_and_grads(op, x, **options) -> list[torch.Tensor]:
    """The op's outputs on ``x``, then the gradients of its loss with respect to hidden, weight and bias."""
    outputs, loss = op(x, **options)
    return [*outputs, *torch.autograd.grad(loss, [x[name] for name in TRAINED])]


def run_case(op, shape: tuple[int, int, int, int], dtype: torch.dtype, device: str, values: torch.dtype | None = None,
             **options) -> list[torch.Tensor]:
    """The op's outputs and the gradients of hidden, weight and bias on `case_inputs` of ``shape`` (batch, seq,
    hidden, vocab), in fp64 on the CPU. The heads' inputs hold values of ``values`` (default: ``dtype``), computed in
    ``dtype``; ``options`` are the op's (``impl``, ``block_sizes``)."""
    x = on(case_inputs(*shape), device, dtype, values)
    return [tensor.detach().double().cpu() for tensor in outputs_and_grads(op, x, **options)]


def output_names(outputs: list[torch.Tensor]) -> list[str]:
    """The names of `run_case`'s tensors: the op's outputs, then the gradients."""
    return [f"output {index}" for index in range(len(outputs) - len(TRAINED))] + [f"grad {n}" for n in TRAINED]


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want||."""
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
