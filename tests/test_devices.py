"""Every fused op on every device this machine has (the CPU; a CUDA GPU where there is one, where "auto" runs the
compiled Triton block kernels and bf16 goes through cuBLAS), in fp32 and bf16, against the materialized oracle in
fp64 on the CPU from the same input values: the values and the gradients of hidden, weight and bias. The losses
known at forward time (cross-entropy, GRPO) run on both schedules, one pass and two (``LOGITLESS_ONE_PASS``).

fp32 must agree to 1e-5 of each tensor's scale. bf16 rounds the inputs' products differently on each device, so it
is judged against what a user would otherwise run on that device: the materialized path (``impl="reference"``) at
the same dtype, whose error the fused op may not exceed by more than half again.
"""

import pytest
import torch

from logitless import (GRPOSettings, fused_grpo_loss, fused_linear_cross_entropy, fused_linear_jsd, fused_linear_kl,
                       fused_linear_logprobs)
from logitless.ops import BlockSizes

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
BATCH, SEQ, HIDDEN, VOCAB = 2, 37, 64, 4001  # 74 tokens: not a multiple of the chunk; a vocabulary of 4 blocks
BLOCKS = BlockSizes(16, 1024)


def _inputs() -> dict:
    generator = torch.Generator().manual_seed(0)

    def randn(*size, scale=1.0):
        return torch.randn(*size, generator=generator, dtype=torch.float64) * scale

    return dict(hidden=randn(BATCH, SEQ, HIDDEN, scale=0.5), weight=randn(VOCAB, HIDDEN, scale=0.3),
                bias=randn(VOCAB, scale=0.1), hidden_q=randn(BATCH, SEQ, HIDDEN, scale=0.5),
                weight_q=randn(VOCAB, HIDDEN, scale=0.3),
                targets=torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator),
                mask=torch.rand(BATCH, SEQ, generator=generator) > 0.2,
                upstream=randn(2, BATCH, SEQ), advantages=randn(BATCH),
                old_log_probs=randn(BATCH, SEQ, scale=0.1) - 8, ref_log_probs=randn(BATCH, SEQ, scale=0.1) - 8)


def _logprobs(x, impl):
    log_probs, entropy = fused_linear_logprobs(x["hidden"], x["weight"], x["targets"], bias=x["bias"], temperature=0.7,
                                               return_token_entropy=True, mask=x["mask"], block_sizes=BLOCKS, impl=impl)
    return [log_probs, entropy], (log_probs * x["upstream"][0] + entropy * x["upstream"][1]).sum()


def _cross_entropy(x, impl):
    loss = fused_linear_cross_entropy(x["hidden"], x["weight"], x["targets"].masked_fill(~x["mask"], -100),
                                      bias=x["bias"], label_smoothing=0.1, block_sizes=BLOCKS, impl=impl)
    return [loss], loss


def _grpo(x, impl):
    loss, _ = fused_grpo_loss(x["hidden"], x["weight"], x["targets"], x["mask"], x["advantages"], bias=x["bias"],
                              old_log_probs=x["old_log_probs"], ref_log_probs=x["ref_log_probs"],
                              settings=GRPOSettings(loss_type="dapo", beta=0.04), block_sizes=BLOCKS, impl=impl)
    return [loss], loss


def _kl(x, impl):
    kl = fused_linear_kl(x["hidden"], x["weight"], x["hidden_q"], x["weight_q"], bias_p=x["bias"], mask=x["mask"],
                         block_sizes=BLOCKS, impl=impl)
    return [kl], (kl * x["upstream"][0]).sum()


def _jsd(x, impl):
    jsd = fused_linear_jsd(x["hidden"], x["weight"], x["hidden_q"], x["weight_q"], bias_s=x["bias"], beta=0.3,
                           mask=x["mask"], block_sizes=BLOCKS, impl=impl)
    return [jsd], (jsd * x["upstream"][0]).sum()


OPS = {"logprobs": _logprobs, "cross_entropy": _cross_entropy, "grpo": _grpo, "kl": _kl, "jsd": _jsd}
TRAINED = ("hidden", "weight", "bias")


def _run(op, dtype: torch.dtype, device: str, impl: str, values: torch.dtype | None = None) -> list[torch.Tensor]:
    """The op's outputs and the gradients of hidden, weight and bias, in fp64 on the CPU. The heads' inputs hold
    values of ``values`` (default: ``dtype``), computed in ``dtype``."""
    x = {name: value.to(device) for name, value in _inputs().items()}
    for name in ("hidden", "weight", "bias", "hidden_q", "weight_q"):
        x[name] = x[name].to(values or dtype).to(dtype).requires_grad_(name in TRAINED)
    outputs, loss = op(x, impl)
    grads = torch.autograd.grad(loss, [x[name] for name in TRAINED])
    return [tensor.detach().double().cpu() for tensor in (*outputs, *grads)]


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


# (op, LOGITLESS_ONE_PASS): the losses known at forward time once more on each schedule, whatever the default is
CASES = [(op, "auto") for op in OPS] + [(op, one_pass) for op in ("cross_entropy", "grpo") for one_pass in "01"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("op,one_pass", CASES)
def test_fused_op_on_this_device_matches_the_fp64_oracle(op, one_pass, dtype, device, monkeypatch):
    monkeypatch.setenv("LOGITLESS_ONE_PASS", one_pass)
    exact = _run(OPS[op], torch.float64, "cpu", "reference", values=dtype)
    fused = _run(OPS[op], dtype, device, "auto")
    materialized = _run(OPS[op], dtype, device, "reference") if dtype == torch.bfloat16 else None
    names = [f"output {index}" for index in range(len(exact) - len(TRAINED))] + [f"grad {n}" for n in TRAINED]
    for index, (name, got, want) in enumerate(zip(names, fused, exact)):
        error = _relative_error(got, want)
        if dtype == torch.float32:
            assert error <= 1e-5, (name, error)
        else:
            bound = _relative_error(materialized[index], want)
            assert error <= 1.5 * bound + 1e-6, (name, error, bound)
