"""`logitless bench lmhead`: a loss through the LM head, forward + backward, peers side by side.

Every implementation does the same work on the same seeded inputs and returns the gradients of hidden
and weight. Every token is valid unless ``masked_fraction`` pads the end of each completion (the
padded case). Two losses (``--loss``):

``grpo`` (the default): hidden (B, T, H), weight (V, H), completion ids, advantages, old and reference
log-probs; TRL's GRPO loss (loss_type "grpo", beta 0.04). Implementations:

* materialized          logits -> log_softmax -> gather -> loss, plus the entropy metric under no_grad,
                        128 rows at a time, as TRL's classic path logs it: what a user writes
* materialized_minimal  the same without the entropy metric: the smallest materialized step
* gemm                  the three bare matmuls of the head (logits, grad hidden, grad weight), no loss:
                        the 6*N*H*V FLOP bound, measured
* torch_chunked         PyTorch's F.linear_cross_entropy(reduction="none"), chunked, for log p (no entropy)
* liger                 Liger-Kernel's LigerFusedLinearGRPOLoss (no entropy)
* trl                   TRL 1.16's own fused LM head (ChunkedLogProbFunction, with its entropy output)
* logitless             fused_grpo_loss (entropy metric included)

``kl``: the exact per-token KL(p || q) over the full vocabulary between the trained head (hidden, weight)
and a fixed one (hidden_q, weight_q), summed over the valid tokens, as GRADE's KL term and
distillation use it. Implementations:

* materialized          both heads' logits -> log_softmax -> F.kl_div(log_target=True)
* materialized_minimal  both heads' logits -> log_softmax -> sum p (log p - log q)
* gemm                  the four bare matmuls (both heads' logits, grad hidden, grad weight)
* logitless             fused_linear_kl

Each runs in a fresh subprocess: one warm-up step, a steady-state step whose peak memory beyond the
inputs is measured (`bench.memory.PeakMemory`), the same with the gradient outputs counted, then
timed repeats (the median is reported). Gradients go to a temporary safetensors file and are
compared with the materialized path's in the parent.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from logitless.bench.options import (add_device_option, add_report_options, add_shape_options, choices_metavar,
                                     require_device, require_positive, require_writable, write_report)
from logitless.bench.ratios import add_ratios, format_ratio, ratio
from logitless.bench.worker import run_worker_process
from logitless.ops.blocks import BlockSizes
from logitless.ops.grpo_settings import GRPOSettings

IMPLEMENTATIONS = ("materialized", "materialized_minimal", "gemm", "torch_chunked", "liger", "trl", "logitless")
KL_IMPLEMENTATIONS = ("materialized", "materialized_minimal", "gemm", "logitless")
LOSSES = {"grpo": "GRPO loss", "kl": "KL(p || q)"}
TEMPERATURE = 1.0
SETTINGS = GRPOSettings(loss_type="grpo", beta=0.04)  # the GRPO loss every implementation computes
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class Shape:
    batch: int = 2
    seq: int = 512
    hidden: int = 512
    vocab: int = 151936
    dtype: str = "float32"
    device: str = "cpu"
    masked_fraction: float = 0.0  # the end of each completion that is padding
    loss: str = "grpo"  # a key of LOSSES
    block_tokens: int | None = None  # logitless's tokens per row chunk (BlockSizes.tokens); None: its default

    @property
    def tokens(self) -> int:
        return self.batch * (self.seq - int(self.seq * self.masked_fraction))

    @property
    def head_matmuls(self) -> int:
        """Matmuls of N x H x V in a step: the logits of each head read, grad hidden, grad weight."""
        return 4 if self.loss == "kl" else 3


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
                  old_logprobs=base + 0.05 * per_token[0], ref_logprobs=base + 0.05 * per_token[1],
                  block_sizes=BlockSizes(tokens=shape.block_tokens))
    if shape.loss == "kl":  # the fixed head: a reference model or a teacher
        inputs.update(hidden_q=randn(shape.batch, shape.seq, shape.hidden, scale=0.5),
                      weight_q=randn(shape.vocab, shape.hidden, scale=0.02))
    return inputs


def _grpo_from_log_probs(log_probs, inputs):
    """TRL's GRPO loss (grpo normalization) on (B, T) log-probs: the same code for every implementation."""
    from logitless.ops.grpo import token_objective, token_weights

    parts = token_objective(log_probs, inputs["advantages"][:, None], inputs["old_logprobs"], inputs["ref_logprobs"],
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
                     inputs["advantages"], ref_per_token_logps=inputs["ref_logprobs"],
                     old_per_token_logps=inputs["old_logprobs"])
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
                              inputs["advantages"], old_logprobs=inputs["old_logprobs"],
                              ref_logprobs=inputs["ref_logprobs"], settings=SETTINGS, temperature=TEMPERATURE,
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


def step_kl_logitless(inputs):
    from logitless.ops.kl import fused_linear_kl

    kl = fused_linear_kl(inputs["hidden"], inputs["weight"], inputs["hidden_q"], inputs["weight_q"],
                         temperature=TEMPERATURE, mask=inputs["completion_mask"], block_sizes=inputs["block_sizes"])
    return kl.sum()


STEPS = {
    "grpo": {"materialized": step_materialized, "materialized_minimal": step_materialized_minimal, "gemm": step_gemm,
             "torch_chunked": step_torch_chunked, "liger": step_liger, "trl": step_trl, "logitless": step_logitless},
    "kl": {"materialized": step_kl_materialized, "materialized_minimal": step_kl_materialized_minimal,
           "gemm": step_gemm, "logitless": step_kl_logitless},
}


def available(implementation: str) -> bool:
    modules = {"liger": "liger_kernel.chunked_loss", "trl": "trl.kernels.chunked_logprob"}
    if implementation in modules:
        try:
            __import__(modules[implementation])
        except ImportError:
            return False
    if implementation == "torch_chunked":
        return hasattr(torch.nn, "LinearCrossEntropyOptions")
    return True


def run_worker(implementation: str, shape: Shape, repeats: int, grads_path: str | None) -> dict:
    """One implementation in this (fresh) process: warm-up, measured step, timed repeats."""
    from logitless.bench.memory import PeakMemory, synchronize

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
    times = []
    for _ in range(repeats):
        synchronize(device)
        started = time.perf_counter()
        forward_backward()
        synchronize(device)
        times.append(time.perf_counter() - started)
    if grads_path:
        from safetensors.torch import save_file

        save_file({"hidden": inputs["hidden"].grad.float().cpu().contiguous(),
                   "weight": inputs["weight"].grad.float().cpu().contiguous()}, grads_path)
    return {"time_s": statistics.median(times), "times_s": times, "peak_mb": peak.megabytes,
            "peak_with_grads_mb": peak_with_grads.megabytes, "loss": loss.item()}


def _spawn(implementation: str, shape: Shape, repeats: int, grads_path: str) -> dict:
    return run_worker_process("logitless.bench.lmhead", ["--worker", implementation, "--shape", json.dumps(asdict(shape)),
                                                         "--repeats", str(repeats), "--grads", grads_path])


def run(shape: Shape, implementations=IMPLEMENTATIONS, repeats: int = 3, progress: bool = True) -> dict:
    """Run each implementation in its own process; ratios are to ``materialized`` and ``materialized_minimal``."""
    from safetensors.torch import load_file
    from tqdm.auto import tqdm

    chosen = [name for name in implementations if name in STEPS[shape.loss] and available(name)]
    for yardstick in ("materialized_minimal", "materialized"):
        if yardstick not in chosen:
            chosen.insert(0, yardstick)
    results = {}
    flops = 2 * shape.head_matmuls * shape.tokens * shape.hidden * shape.vocab  # the head's matmuls, valid tokens
    with tempfile.TemporaryDirectory() as scratch:
        for name in tqdm(chosen, desc="bench lmhead", disable=not progress):
            results[name] = _spawn(name, shape, repeats, str(Path(scratch) / f"{name}.safetensors"))
        reference = load_file(str(Path(scratch) / "materialized.safetensors"))
        for name, result in results.items():
            if name == "gemm":  # no loss: its gradients are not the loss's
                result["loss_diff"] = result["max_abs_grad_diff"] = None
            else:
                grads = load_file(str(Path(scratch) / f"{name}.safetensors"))
                result["max_abs_grad_diff"] = max((grads[k] - reference[k]).abs().max().item() for k in reference)
                result["loss_diff"] = abs(result["loss"] - results["materialized"]["loss"])
            result["tokens_per_s"] = shape.tokens / result["time_s"]
            result["tflops"] = flops / result["time_s"] / 1e12
    add_report_ratios(results)
    return {"shape": asdict(shape), "tokens": shape.tokens, "flops": flops, "repeats": repeats,
            "torch": torch.__version__, "results": results}


def add_report_ratios(results: dict) -> None:
    """Ratios to both materialized yardsticks, and the fraction of the FLOP bound (when gemm ran)."""
    add_ratios(results, "materialized")
    for result in results.values():
        result["time_ratio_minimal"] = ratio(result["time_s"], results["materialized_minimal"]["time_s"])
        result["peak_ratio_minimal"] = ratio(result["peak_mb"], results["materialized_minimal"]["peak_mb"], floor=1.0)
        # the bare matmuls' time over this one's
        result["bound_fraction"] = ratio(results["gemm"]["time_s"], result["time_s"]) if "gemm" in results else None


def _number(value, width: int, spec: str) -> str:
    text = "n/a" if value is None else format(value, spec)
    return f"{text:>{width}}"


def format_table(report: dict) -> str:
    lines = [f"{LOSSES[report['shape']['loss']]} fwd+bwd through the LM head, {report['tokens']} valid tokens, "
             f"shape {report['shape']}",
             f"{'impl':<21}{'time s':>8}{'x mat':>7}{'x min':>7}{'tok/s':>8}{'bound':>7}{'peak MB':>9}{'x mat':>7}"
             f"{'x min':>7}{'loss diff':>11}{'max|dgrad|':>12}"]
    for name, r in report["results"].items():
        lines.append(f"{name:<21}{r['time_s']:>8.3f}{format_ratio(r['time_ratio'], 7)}"
                     f"{format_ratio(r['time_ratio_minimal'], 7)}{r['tokens_per_s']:>8.0f}"
                     f"{format_ratio(r['bound_fraction'], 7)}{r['peak_mb']:>9.0f}{format_ratio(r['peak_ratio'], 7)}"
                     f"{format_ratio(r['peak_ratio_minimal'], 7)}{_number(r['loss_diff'], 11, '.1e')}"
                     f"{_number(r['max_abs_grad_diff'], 12, '.1e')}")
    materialized = "with the entropy metric" if report["shape"]["loss"] == "grpo" else "F.kl_div"
    lines.append(f"x mat / x min: ratio to materialized ({materialized}) / to materialized_minimal; "
                 "bound: the bare matmuls' time over this one's")
    return "\n".join(lines)


def plot(report: dict, path: str | Path) -> Path:
    from logitless.plots import ratio_bar_panels

    names = list(report["results"])
    colors = ["#dd8452" if n == "logitless" else "#999999" if n.startswith("materialized") or n == "gemm"
              else "#4c72b0" for n in names]
    panels = [("time_s", "time_ratio_minimal", 1.0, "time per step (s, median)", 2),
              ("peak_mb", "peak_ratio_minimal", 1.0, "peak memory beyond inputs (MB)", 2)]
    s = report["shape"]
    title = (f"{LOSSES[s['loss']]} fwd+bwd, B={s['batch']} T={s['seq']} H={s['hidden']} V={s['vocab']} "
             f"{s['dtype']} {s['device']}, {report['tokens']} valid tokens\nlabels: x materialized_minimal")
    return ratio_bar_panels(report["results"], panels, colors, title, path, rotate_names=True)


def add_parser(targets) -> None:
    """Register ``logitless bench lmhead`` on the ``bench`` subparsers."""
    defaults = Shape()
    parser = targets.add_parser(
        "lmhead", help="a loss (GRPO, or the KL between two heads) fwd+bwd through the LM head: time, peak memory, "
                       "accuracy",
        description="A loss forward and backward through the LM head, from final hidden states and the output "
                    "embedding, for each implementation in a fresh process on the same seeded inputs: time per "
                    "step (median of --repeats), peak memory beyond the inputs, and the loss and gradient "
                    "differences from the materialized path. --loss grpo: TRL's GRPO loss (loss_type grpo, beta "
                    "0.04, old and reference log-probs); --loss kl: the exact KL(p || q) between the trained head "
                    "and a fixed one (a reference model's, a teacher's) over the full vocabulary. Peers that are "
                    "not installed are skipped.")
    add_shape_options(parser, defaults, DTYPES, vocab_help="vocabulary size; Qwen2/2.5's is 151936, Qwen3.5's 248320")
    add_device_option(parser)
    parser.add_argument("--masked-fraction", dest="masked_fraction", type=float, default=defaults.masked_fraction,
                        help="fraction at the end of each completion that is padding, in [0, 1) (default: "
                             "%(default)s, every token valid)")
    parser.add_argument("--loss", default=defaults.loss, metavar=choices_metavar(LOSSES),
                        help="the loss: grpo, or kl (whose implementations are "
                             f"{', '.join(KL_IMPLEMENTATIONS)}) (default: %(default)s)")
    parser.add_argument("--block-tokens", dest="block_tokens", type=int, default=None,
                        help="tokens per row chunk of logitless's blocks (BlockSizes.tokens): more is faster on a "
                             "CPU and keeps more logits (default: the per-device default)")
    parser.add_argument("--impl", nargs="+", default=list(IMPLEMENTATIONS), metavar=choices_metavar(IMPLEMENTATIONS),
                        help="implementations to compare (both materialized yardsticks always run; peers not "
                             "installed, or without the chosen loss, are skipped) (default: all)")
    add_report_options(parser)
    parser.set_defaults(handler=run_cli)


def run_cli(args: argparse.Namespace) -> int:
    require_positive(args, ("batch", "seq", "hidden", "vocab", "repeats", "block_tokens"))
    if args.dtype not in DTYPES:
        raise SystemExit(f"--dtype: expected one of {sorted(DTYPES)}, got {args.dtype!r}")
    if args.loss not in LOSSES:
        raise SystemExit(f"--loss: expected one of {sorted(LOSSES)}, got {args.loss!r}")
    if not 0.0 <= args.masked_fraction < 1.0:
        raise SystemExit(f"--masked-fraction: must lie in [0, 1), got {args.masked_fraction}")
    unknown = sorted(set(args.impl) - set(IMPLEMENTATIONS))
    if unknown:
        raise SystemExit(f"--impl: unknown {unknown}; choose from {list(IMPLEMENTATIONS)}")
    require_device(args)
    require_writable(args)
    shape = Shape(args.batch, args.seq, args.hidden, args.vocab, args.dtype, args.device, args.masked_fraction,
                  args.loss, args.block_tokens)
    report = run(shape, args.impl, repeats=args.repeats)
    return write_report(report, args, format_table, plot)


def _main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", choices=IMPLEMENTATIONS, required=True)
    parser.add_argument("--shape", required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--grads")
    args = parser.parse_args()
    result = run_worker(args.worker, Shape(**json.loads(args.shape)), args.repeats, args.grads)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
