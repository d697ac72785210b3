"""`logitless bench lmhead`: the GRPO loss through the LM head, forward + backward, peers side by side.

Implementations, all on the same seeded inputs (hidden (B, T, H), weight (V, H), completion ids,
mask, advantages, old and reference log-probs; loss_type "grpo", beta 0.04):

* materialized  logits -> log_softmax -> gather, entropy from the logits without grad (TRL's classic path)
* torch_chunked PyTorch's F.linear_cross_entropy(reduction="none") with chunking options, for log p
* liger         Liger-Kernel's LigerFusedLinearGRPOLoss (when installed)
* logitless     fused_grpo_loss

Each runs in a fresh subprocess: one warm-up step, then a steady-state step whose peak memory beyond
the inputs is measured (`bench.memory.PeakMemory`; see `run_worker`), the same with the gradient
outputs counted, then timed repeats (the median is reported). Gradients go to a
temporary safetensors file and are compared with the materialized path's in the parent.
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

from logitless.bench.ratios import add_ratios, format_ratio
from logitless.bench.worker import run_worker_process

IMPLEMENTATIONS = ("materialized", "torch_chunked", "liger", "logitless")
BETA, TEMPERATURE = 0.04, 1.0
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class Shape:
    batch: int = 2
    seq: int = 512
    hidden: int = 512
    vocab: int = 151936
    dtype: str = "float32"
    device: str = "cpu"


def make_inputs(shape: Shape) -> dict:
    generator = torch.Generator().manual_seed(0)
    dtype, device = DTYPES[shape.dtype], torch.device(shape.device)

    def randn(*size, scale=1.0):
        return (torch.randn(*size, generator=generator) * scale).to(dtype=dtype, device=device)

    ids = torch.randint(0, shape.vocab, (shape.batch, shape.seq), generator=generator).to(device)
    mask = torch.ones(shape.batch, shape.seq, device=device)
    mask[0, shape.seq * 3 // 4:] = 0  # one shorter completion
    per_token = torch.randn(2, shape.batch, shape.seq, generator=generator).to(device)
    base = -torch.rand(shape.batch, shape.seq, generator=generator).to(device) * 3 - 9  # ~ log(1/V)-ish
    return dict(hidden=randn(shape.batch, shape.seq, shape.hidden, scale=0.5).requires_grad_(),
                weight=randn(shape.vocab, shape.hidden, scale=0.02).requires_grad_(),
                completion_ids=ids, completion_mask=mask,
                advantages=torch.randn(shape.batch, generator=generator).to(device),
                old_logprobs=base + 0.05 * per_token[0], ref_logprobs=base + 0.05 * per_token[1])


def _grpo_from_log_probs(log_probs, inputs):
    from logitless.ops.grpo import GRPOSettings, token_objective, token_weights

    parts = token_objective(log_probs, inputs["advantages"][:, None], inputs["old_logprobs"], inputs["ref_logprobs"],
                            GRPOSettings(beta=BETA))
    weights = token_weights(inputs["completion_mask"].bool(), "grpo")
    return (parts[0] * weights).sum()


def step_materialized(inputs):
    logits = (inputs["hidden"] @ inputs["weight"].T).float() / TEMPERATURE  # (B, T, V)
    log_probs = torch.log_softmax(logits, dim=-1).gather(-1, inputs["completion_ids"][..., None]).squeeze(-1)
    with torch.no_grad():  # the entropy metric, 128 rows at a time as TRL's entropy_from_logits does
        flat = logits.reshape(-1, logits.shape[-1])
        for rows in flat.split(128):
            row_log_probs = torch.log_softmax(rows, dim=-1)
            -(row_log_probs.exp() * row_log_probs).sum(-1)
    return _grpo_from_log_probs(log_probs, inputs)


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

    module = LigerFusedLinearGRPOLoss(beta=BETA, compiled=inputs["hidden"].is_cuda, use_ref_model=True,
                                      loss_type="grpo", temperature=TEMPERATURE)
    loss, _ = module(inputs["hidden"], inputs["weight"], inputs["completion_ids"], inputs["completion_mask"],
                     inputs["advantages"], ref_per_token_logps=inputs["ref_logprobs"],
                     old_per_token_logps=inputs["old_logprobs"])
    return loss


def step_logitless(inputs):
    from logitless.ops.fused import fused_grpo_loss

    loss, _ = fused_grpo_loss(inputs["hidden"], inputs["weight"], inputs["completion_ids"], inputs["completion_mask"],
                              inputs["advantages"], old_logprobs=inputs["old_logprobs"],
                              ref_logprobs=inputs["ref_logprobs"], beta=BETA, temperature=TEMPERATURE)
    return loss


STEPS = {"materialized": step_materialized, "torch_chunked": step_torch_chunked, "liger": step_liger,
         "logitless": step_logitless}


def available(implementation: str) -> bool:
    if implementation == "liger":
        try:
            import liger_kernel.chunked_loss  # noqa: F401
        except ImportError:
            return False
    if implementation == "torch_chunked":
        return hasattr(torch.nn, "LinearCrossEntropyOptions")
    return True


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_worker(implementation: str, shape: Shape, repeats: int, grads_path: str | None) -> dict:
    """One implementation in this (fresh) process: warm-up, measured step, timed repeats."""
    from logitless.bench.memory import PeakMemory

    inputs = make_inputs(shape)
    device = inputs["hidden"].device
    step = STEPS[implementation]

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
        _sync(device)
        started = time.perf_counter()
        forward_backward()
        _sync(device)
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
    from safetensors.torch import load_file
    from tqdm.auto import tqdm

    chosen = [name for name in implementations if available(name)]
    if "materialized" not in chosen:
        chosen.insert(0, "materialized")
    results = {}
    flops = 6 * shape.batch * shape.seq * shape.hidden * shape.vocab  # forward + two backward matmuls
    with tempfile.TemporaryDirectory() as scratch:
        for name in tqdm(chosen, desc="bench lmhead", disable=not progress):
            results[name] = _spawn(name, shape, repeats, str(Path(scratch) / f"{name}.safetensors"))
        reference = load_file(str(Path(scratch) / "materialized.safetensors"))
        for name, result in results.items():
            grads = load_file(str(Path(scratch) / f"{name}.safetensors"))
            result["max_abs_grad_diff"] = max((grads[k] - reference[k]).abs().max().item() for k in reference)
            result["loss_diff"] = abs(result["loss"] - results["materialized"]["loss"])
            result["tflops"] = flops / result["time_s"] / 1e12
    add_ratios(results, "materialized")
    return {"shape": asdict(shape), "flops_6NHV": flops, "repeats": repeats, "results": results}


def format_table(report: dict) -> str:
    lines = [f"GRPO loss fwd+bwd through the LM head, shape {report['shape']}",
             f"{'impl':<14}{'time s':>9}{'x mat':>7}{'peak MB':>10}{'x mat':>7}{'+grads MB':>10}{'loss diff':>11}"
             f"{'max|dgrad|':>12}{'TFLOP/s':>9}"]
    for name, r in report["results"].items():
        lines.append(f"{name:<14}{r['time_s']:>9.3f}{format_ratio(r['time_ratio'], 7)}{r['peak_mb']:>10.0f}"
                     f"{format_ratio(r['peak_ratio'], 7)}{r['peak_with_grads_mb']:>10.0f}{r['loss_diff']:>11.1e}{r['max_abs_grad_diff']:>12.1e}"
                     f"{r['tflops']:>9.2f}")
    return "\n".join(lines)


def plot(report: dict, path: str | Path) -> Path:
    from logitless.plots import _pyplot

    plt = _pyplot()
    names = list(report["results"])
    figure, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for axis, key, label in ((axes[0], "time_s", "time per step (s, median)"),
                             (axes[1], "peak_mb", "peak memory beyond inputs (MB)")):
        values = [report["results"][n][key] for n in names]
        bars = axis.bar(names, values, color=["#999999" if n == "materialized" else "#4c72b0" for n in names])
        for bar, name in zip(bars, names):
            value = report["results"][name][key.replace("_s", "_ratio").replace("_mb", "_ratio")]
            axis.annotate("n/a" if value is None else f"{value:.2f}x",
                          (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom")
        axis.set_ylim(top=max(values) * 1.18 or 1.0)  # room for the ratio labels (1.0: all zero)
        axis.set_title(label)
        axis.tick_params(axis="x", rotation=20)
    s = report["shape"]
    figure.suptitle(f"GRPO loss fwd+bwd, B={s['batch']} T={s['seq']} H={s['hidden']} V={s['vocab']} "
                    f"{s['dtype']} {s['device']}")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return Path(path)


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
