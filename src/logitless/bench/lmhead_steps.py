"""The implementations `logitless bench lmhead` compares (see `logitless.bench.lmhead` for what each one is), and
the worker process that runs one of them: warm-up, the measured steps, timed repeats."""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from logitless.bench.lmhead_shape import IMPLEMENTATIONS, Shape
from logitless.bench.timing import step_seconds
from logitless.op_settings import BlockSizes
from logitless.op_settings import GRPOSettings

TEMPERATURE = 1.0
SETTINGS = GRPOSettings(loss_type="grpo", beta=0.04, use_bias_correction_kl=False)  # every implementation's loss:
# Liger's has no importance-ratio correction of the KL
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def make_inputs(shape: Shape) -> dict:
    generator = torch.Generator().manual_seed(0)
    dtype, device = DTYPES[shape.dtype], torch.device(shape.device)

    def randn(*size, scale=1.0):
        return (torch.randn(*size, generator=generator) * scale).to(dtype=dtype, device=device)

    ids = torch.randint(0, shape.vocab, (shape.batch, shape.seq), generator=generator).to(device)
    mask = torch.ones(shape.batch, shape.seq, device=device)
    mask[:, shape.seq - int(shape.seq * shape.masked_fraction):] = 0
    per_token = torch.randn(2, shape.batch, shape.seq, generator=generator).to(device)
    base = -torch.rand(shape.batch, shape.seq, generator=generator).to(device) * 3 - 9  # ~ log(1/V)-ish
    inputs = dict(hidden=randn(shape.batch, shape.seq, shape.hidden, scale=0.5).requires_grad_(),
                  weight=randn(shape.vocab, shape.hidden, scale=0.02).requires_grad_(),
                  completion_ids=ids, completion_mask=mask,
                  advantages=torch.randn(shape.batch, generator=generator).to(device),
                  old_log_probs=base + 0.05 * per_token[0], ref_log_probs=base + 0.05 * per_token[1],
                  block_sizes=BlockSizes(tokens=shape.block_tokens))
    if shape.loss == "kl":  # the fixed head: a reference model or a teacher
        inputs.update(hidden_q=randn(shape.batch, shape.seq, shape.hidden, scale=0.5),
                      weight_q=randn(shape.vocab, shape.hidden, scale=0.02))
    return inputs


def _grpo_from_log_probs(log_probs, inputs):
    """TRL's GRPO loss (grpo normalization) on (B, T) log-probs: the same code for every implementation."""
    from logitless.ops.grpo import token_objective, token_weights

    parts = token_objective(log_probs, inputs["advantages"][:, None], inputs["old_log_probs"], inputs["ref_log_probs"],
                            SETTINGS)
    weights = token_weights(inputs["completion_mask"].bool(), SETTINGS)
    return (parts[0] * weights).sum()


def _materialized_log_probs(inputs):
    logits = (inputs["hidden"] @ inputs["weight"].T).float() / TEMPERATURE  # (B, T, V)
    log_probs = torch.log_softmax(logits, dim=-1).gather(-1, inputs["completion_ids"][..., None]).squeeze(-1)
    return logits, log_probs


def step_materialized(inputs):
    logits, log_probs = _materialized_log_probs(inputs)
    with torch.no_grad():  # the entropy metric, 128 rows at a time as TRL's entropy_from_logits does
        flat = logits.reshape(-1, logits.shape[-1])
        for rows in flat.split(128):
            row_log_probs = torch.log_softmax(rows, dim=-1)
            -(row_log_probs.exp() * row_log_probs).sum(-1)
    return _grpo_from_log_probs(log_probs, inputs)


def step_materialized_minimal(inputs):
    return _grpo_from_log_probs(_materialized_log_probs(inputs)[1], inputs)


class _BareHeadMatmuls(torch.autograd.Function):
    """The head's matmuls and nothing else: logits in forward (discarded; a fixed second head's too when
    given), grad hidden and grad weight from a fixed (N, V) upstream gradient in backward."""

    @staticmethod
    def forward(ctx, hidden, weight, upstream, hidden_q=None, weight_q=None):
        flat_hidden = hidden.reshape(-1, hidden.shape[-1])  # (N, H)
        flat_hidden @ weight.T  # (N, V) logits
        if weight_q is not None:
            hidden_q.reshape(-1, hidden_q.shape[-1]) @ weight_q.T  # (N, V) the fixed head's logits
        ctx.save_for_backward(flat_hidden, weight, upstream)
        ctx.hidden_shape = hidden.shape
        return hidden.new_zeros(())

    @staticmethod
    def backward(ctx, _grad):
        flat_hidden, weight, upstream = ctx.saved_tensors
        return (upstream @ weight).reshape(ctx.hidden_shape), upstream.T @ flat_hidden, None, None, None


def step_gemm(inputs):
    """The 2*N*H*V FLOPs per head matmul of any LM-head loss's step, measured: the bound the others are compared
    with."""
    hidden, weight = inputs["hidden"], inputs["weight"]
    if "gemm_upstream" not in inputs:  # allocated in the warm-up step, like the inputs
        inputs["gemm_upstream"] = torch.full((hidden.shape[0] * hidden.shape[1], weight.shape[0]), 1e-6,
                                             dtype=hidden.dtype, device=hidden.device)
    return _BareHeadMatmuls.apply(hidden, weight, inputs["gemm_upstream"], inputs.get("hidden_q"),
                                  inputs.get("weight_q"))


def step_torch_chunked(inputs):
    import torch.nn.functional as F

    hidden = inputs["hidden"]
    # 256-row chunks: chunking_method="auto" alone picked chunks that took 71 s a step at B=2 T=512 V=151936
    # on this project's 2-core CPU, against 4.5 s with this setting (see docs/BENCHMARKS.md).
    options = torch.nn.LinearCrossEntropyOptions(chunking_method="auto", batch_chunk_size=256)
    nll = F.linear_cross_entropy((hidden / TEMPERATURE).reshape(-1, hidden.shape[-1]), inputs["weight"],
                                 inputs["completion_ids"].reshape(-1), reduction="none", options=options)
    return _grpo_from_log_probs(-nll.float().reshape(inputs["completion_ids"].shape), inputs)


def step_liger(inputs):
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    module = LigerFusedLinearGRPOLoss(beta=SETTINGS.beta, compiled=inputs["hidden"].is_cuda, use_ref_model=True,
                                      loss_type=SETTINGS.loss_type, temperature=TEMPERATURE)
    loss, _ = module(inputs["hidden"], inputs["weight"], inputs["completion_ids"], inputs["completion_mask"],
                     inputs["advantages"], ref_per_token_logps=inputs["ref_log_probs"],
                     old_per_token_logps=inputs["old_log_probs"])
    return loss


def step_trl(inputs):
    """TRL 1.16's fused head as GRPOTrainer calls it (its default 32768-column tiles; the valid tokens only,
    as on Triton devices), with the entropy it logs; then the same GRPO loss."""
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

    hidden, mask = inputs["hidden"], inputs["completion_mask"].bool()
    log_probs, entropy, *_ = ChunkedLogProbFunction.apply(
        hidden[mask], inputs["weight"], None, inputs["completion_ids"][mask], TEMPERATURE,
        _CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0, ("entropy",))
    full = log_probs.new_zeros(mask.shape).masked_scatter(mask, log_probs)
    with torch.no_grad():
        entropy.mean()
    return _grpo_from_log_probs(full, inputs)


def step_logitless(inputs):
    from logitless.ops.fused import fused_grpo_loss

    loss, _ = fused_grpo_loss(inputs["hidden"], inputs["weight"], inputs["completion_ids"], inputs["completion_mask"],
                              inputs["advantages"], old_log_probs=inputs["old_log_probs"],
                              ref_log_probs=inputs["ref_log_probs"], settings=SETTINGS, temperature=TEMPERATURE,
                              block_sizes=inputs["block_sizes"])
    return loss


def _materialized_kl_log_probs(inputs):
    """(B, T, V) log-softmax of the trained head and of the fixed one."""
    log_p = torch.log_softmax((inputs["hidden"] @ inputs["weight"].T).float() / TEMPERATURE, dim=-1)
    with torch.no_grad():
        log_q = torch.log_softmax((inputs["hidden_q"] @ inputs["weight_q"].T).float() / TEMPERATURE, dim=-1)
    return log_p, log_q


def step_kl_materialized(inputs):
    import torch.nn.functional as F

    log_p, log_q = _materialized_kl_log_probs(inputs)
    kl = F.kl_div(log_q, log_p, reduction="none", log_target=True).sum(-1)  # (B, T): sum p (log p - log q)
    return (kl * inputs["completion_mask"]).sum()


def step_kl_materialized_minimal(inputs):
    log_p, log_q = _materialized_kl_log_probs(inputs)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)  # (B, T)
    return (kl * inputs["completion_mask"]).sum()


def step_kl_trl(inputs):
    """TRL 1.16's fused two-head divergence as its distillation trainer calls it on Triton devices (beta 1.0: the
    reverse KL(student || teacher), the trained head being the student; the valid tokens only), with the student
    entropy it returns."""
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

    mask = inputs["completion_mask"].bool()
    kl, entropy = ChunkedDivergenceFunction.apply(inputs["hidden"][mask], inputs["weight"], None,
                                                  inputs["hidden_q"][mask], inputs["weight_q"], None, 1.0, TEMPERATURE)
    with torch.no_grad():
        entropy.mean()
    return kl.sum()


def step_kl_logitless(inputs):
    from logitless.ops.two_heads import fused_linear_kl

    kl = fused_linear_kl(inputs["hidden"], inputs["weight"], inputs["hidden_q"], inputs["weight_q"],
                         temperature=TEMPERATURE, mask=inputs["completion_mask"], block_sizes=inputs["block_sizes"])
    return kl.sum()


STEPS = {
    "grpo": {"materialized": step_materialized, "materialized_minimal": step_materialized_minimal, "gemm": step_gemm,
             "torch_chunked": step_torch_chunked, "liger": step_liger, "trl": step_trl, "logitless": step_logitless},
    "kl": {"materialized": step_kl_materialized, "materialized_minimal": step_kl_materialized_minimal,
           "gemm": step_gemm, "trl": step_kl_trl, "logitless": step_kl_logitless},
}


def available(implementation: str) -> bool:
    modules = {"liger": ["liger_kernel.chunked_loss"],
               "trl": ["trl.kernels.chunked_logprob", "trl.kernels.chunked_divergence"]}
    try:
        for module in modules.get(implementation, []):
            __import__(module)
    except ImportError:
        return False
    if implementation == "torch_chunked":
        return hasattr(torch.nn, "LinearCrossEntropyOptions")
    return True


def run_worker(implementation: str, shape: Shape, repeats: int, grads_path: str | None,
               profile: bool = False) -> dict:
    """One implementation in this (fresh) process: warm-up, measured step, timed repeats."""
    from logitless.memory import PeakMemory

    inputs = make_inputs(shape)
    device = inputs["hidden"].device
    step = STEPS[shape.loss][implementation]

    def forward_backward():
        inputs["hidden"].grad = inputs["weight"].grad = None
        loss = step(inputs)
        loss.backward()
        return loss

    forward_backward()  # warm-up: lazy initialization, compilation
    # Steady state of a training loop: the step starts by dropping the previous gradients
    # (zero_grad(set_to_none=True), PyTorch's default) and allocates new ones, so the growth
    # measured here is what the loss needs beyond the inputs.
    with PeakMemory(device) as peak:
        loss = forward_backward()
    # The same step with no gradient held at its start: the gradient outputs count too.
    inputs["hidden"].grad = inputs["weight"].grad = None
    with PeakMemory(device) as peak_with_grads:
        forward_backward()
    times = [step_seconds(forward_backward, device) for _ in range(repeats)]
    profile_table = _profile(forward_backward, device) if profile else None
    if grads_path:
        from safetensors.torch import save_file

        save_file({"hidden": inputs["hidden"].grad.float().cpu().contiguous(),
                   "weight": inputs["weight"].grad.float().cpu().contiguous()}, grads_path)
    result = {"time_s": statistics.median(times), "times_s": times, "peak_mb": peak.megabytes,
              "peak_with_grads_mb": peak_with_grads.megabytes, "loss": loss.item()}
    if profile_table is not None:
        result["profile"] = profile_table
    return {**result, **_blocks_held(shape, inputs)} if implementation == "logitless" else result


def _profile(step, device: torch.device, rows: int = 15) -> str:
    """torch.profiler's table of one more ``step``: the ``rows`` operators and kernels that took the most time of
    their own (on the GPU where the step ran on one)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as profiler:
        step()
    order = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return profiler.key_averages().table(sort_by=order, row_limit=rows)


def _blocks_held(shape: Shape, inputs: dict) -> dict:
    """logitless's tokens per row chunk, and the fp32 logits it holds at once (MB): a row chunk's whole row in one
    pass, one block of each head in two."""
    from logitless.ops.plan import plan_blocks
    from logitless.ops.head import LinearHead

    weight = inputs["weight"]
    plan = plan_blocks(shape.tokens, LinearHead(weight), weight.device, inputs["block_sizes"],
                       loss_known=shape.loss == "grpo")
    columns = shape.vocab if plan.single_pass else plan.sizes.vocab * (2 if shape.loss == "kl" else 1)
    return {"chunk_tokens": plan.sizes.tokens, "logits_mb": plan.sizes.tokens * columns * 4 / 2**20}


def _main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", choices=IMPLEMENTATIONS, required=True)
    parser.add_argument("--shape", required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--grads")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    result = run_worker(args.worker, Shape(**json.loads(args.shape)), args.repeats, args.grads, args.profile)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
