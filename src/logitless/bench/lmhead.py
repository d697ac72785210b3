"""`logitless bench lmhead`: a loss through the LM head, forward + backward, peers side by side.

Every implementation does the same work on the same seeded inputs and returns the gradients of hidden
and weight. Every token is valid unless ``masked_fraction`` pads the end of each completion (the
padded case). Two losses (``--loss``):

``grpo`` (the default): hidden (B, T, H), weight (V, H), completion ids, advantages, old and reference
log-probs; TRL's GRPO loss (loss_type "grpo", beta 0.04, the KL without
TRL 1.16's ratio correction, which Liger lacks). Implementations:

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
* trl                   TRL 1.16's ChunkedDivergenceFunction (beta 1.0, with the student entropy it returns), as
                        its distillation trainer calls it
* logitless             fused_linear_kl

Each runs in a fresh subprocess (`bench.lmhead_steps`, where the implementations are): one warm-up step, a
steady-state step whose peak memory beyond the inputs is measured (`logitless.memory.PeakMemory`), the same with
the gradient outputs counted, then timed repeats (the median is reported; on a GPU each is timed by CUDA events).
Gradients go to a temporary safetensors
file and are compared with the materialized path's in the parent.

``block_tokens`` (``--block-tokens N [N ...]``): logitless runs once per value, its tokens per row chunk
(``BlockSizes.tokens``), as the rows ``logitless@N``: the curve of time and memory against the chunk from which
the CPU default is chosen. Each logitless row reports the chunk it ran (``chunk_tokens``) and the logits it held
at once (``logits_mb``). ``busy`` (``--busy N``): every implementation runs with N busy processes beside it
(`bench.busy`), as on a shared machine. ``profile`` (``--profile``): one more step of each under torch.profiler,
whose table of the operators and kernels that took the most time is printed after the results.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

from logitless.bench.busy import busy_processes
from logitless.bench.lmhead_shape import IMPLEMENTATIONS, LOSSES, Shape
from logitless.bench.options import (add_device_option, add_report_options, add_shape_options, benchmark_parser,
                                     choices_metavar, require_device, require_positive, require_writable,
                                     rows_so_far, write_report)
from logitless.bench.ratios import add_ratios, format_ratio, ratio
from logitless.bench.worker import run_worker_process

KL_IMPLEMENTATIONS = ("materialized", "materialized_minimal", "gemm", "trl", "logitless")
DTYPES = ("float32", "bfloat16")

SUMMARY = ("a loss (GRPO, or the KL between two heads) fwd+bwd through the LM head: time, peak memory, "
           "accuracy")
DESCRIPTION = ("A loss forward and backward through the LM head, from final hidden states and the output "
               "embedding, for each implementation in a fresh process on the same seeded inputs: time per "
               "step (median of --repeats), peak memory beyond the inputs, and the loss and gradient "
               "differences from the materialized path. --loss grpo: TRL's GRPO loss (loss_type grpo, beta "
               "0.04 with the KL uncorrected by the ratio, as Liger computes it, old and reference log-probs); "
               "--loss kl: the exact KL(p || q) between the trained head "
               "and a fixed one (a reference model's, a teacher's) over the full vocabulary. Peers that are "
               "not installed are skipped.")


def _spawn(implementation: str, shape: Shape, repeats: int, grads_path: str, profile: bool) -> dict:
    return run_worker_process("logitless.bench.lmhead_steps",
                              ["--worker", implementation, "--shape", json.dumps(asdict(shape)), "--repeats",
                               str(repeats), "--grads", grads_path, *(["--profile"] if profile else [])])


def _runs(shape: Shape, implementations, block_tokens) -> dict[str, tuple[str, Shape]]:
    """Row name -> (implementation, shape): the yardsticks first, logitless once per ``block_tokens`` value."""
    from logitless.bench.lmhead_steps import STEPS, available

    chosen = [name for name in implementations if name in STEPS[shape.loss] and available(name)]
    for yardstick in ("materialized_minimal", "materialized"):
        if yardstick not in chosen:
            chosen.insert(0, yardstick)
    runs = {}
    for name in chosen:
        if name == "logitless" and block_tokens:
            runs.update({f"logitless@{tokens}": (name, replace(shape, block_tokens=tokens)) for tokens in block_tokens})
        else:
            runs[name] = (name, shape)
    return runs


def run(shape: Shape, implementations=IMPLEMENTATIONS, repeats: int = 3, progress: bool = True,
        block_tokens: tuple[int, ...] = (), busy: int = 0, profile: bool = False) -> dict:
    """Run each implementation in its own process (with ``busy`` busy processes beside them); ratios are to
    ``materialized`` and ``materialized_minimal``. With ``profile``, each result holds torch.profiler's table of one
    more step (``profile``). A peer that fails (a kernel that does not build on this machine, say) is reported
    under ``failed`` with its error, and the others still run; a yardstick that fails ends the run."""
    import torch
    from safetensors.torch import load_file
    from tqdm.auto import tqdm

    results, failed = rows_so_far({}), {}
    flops = 2 * shape.head_matmuls * shape.tokens * shape.hidden * shape.vocab  # the head's matmuls, valid tokens
    with tempfile.TemporaryDirectory() as scratch, busy_processes(busy):
        for name, (implementation, run_shape) in tqdm(_runs(shape, implementations, block_tokens).items(),
                                                      desc="bench lmhead", disable=not progress):
            try:
                results[name] = _spawn(implementation, run_shape, repeats,
                                       str(Path(scratch) / f"{name}.safetensors"), profile)
            except RuntimeError as err:
                if implementation.startswith("materialized"):  # the yardsticks every row is compared with
                    raise
                failed[name] = str(err)
                tqdm.write(f"bench lmhead: {name} failed, the others go on: {err}", file=sys.stderr)
                continue
            tqdm.write(f"bench lmhead: {name}: {results[name]['time_s']:.4g} s per step, peak "
                       f"{results[name]['peak_mb']:.0f} MB beyond the inputs", file=sys.stderr)  # stdout: the table
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
    return {"shape": asdict(shape), "tokens": shape.tokens, "flops": flops, "repeats": repeats, "busy": busy,
            "torch": torch.__version__, "results": results, "failed": failed}


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
             f"shape {report['shape']}"
             + (f", {report['busy']} busy processes beside it" if report.get("busy") else ""),
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
    chunks = [(name, r) for name, r in report["results"].items() if "chunk_tokens" in r]
    lines += [f"{name}: {r['chunk_tokens']} tokens per row chunk, {r['logits_mb']:.0f} MB of logits held at once"
              for name, r in chunks]
    lines += [f"{name}: failed: {error.strip().splitlines()[-1]}" for name, error in report.get("failed", {}).items()]
    lines += [f"\nwhere the time of {name}'s step goes (torch.profiler):\n{r['profile']}"
              for name, r in report["results"].items() if r.get("profile")]
    return "\n".join(lines)


def plot(report: dict, path: str | Path) -> Path:
    from logitless.plots import ratio_bar_panels

    names = list(report["results"])
    colors = ["#dd8452" if n.startswith("logitless") else "#999999" if n.startswith("materialized") or n == "gemm"
              else "#4c72b0" for n in names]
    panels = [("time_s", "time_ratio_minimal", 1.0, "time per step (s, median)", 2),
              ("peak_mb", "peak_ratio_minimal", 1.0, "peak memory beyond inputs (MB)", 2)]
    s = report["shape"]
    title = (f"{LOSSES[s['loss']]} fwd+bwd, B={s['batch']} T={s['seq']} H={s['hidden']} V={s['vocab']} "
             f"{s['dtype']} {s['device']}, {report['tokens']} valid tokens"
             + (f", {report['busy']} busy processes beside it" if report.get("busy") else "")
             + "\nlabels: x materialized_minimal")
    return ratio_bar_panels(report["results"], panels, colors, title, path, rotate_names=True)


def add_parser(targets) -> None:
    """Register ``logitless bench lmhead`` on the ``bench`` subparsers."""
    defaults = Shape()
    parser = benchmark_parser(targets, "lmhead", SUMMARY, DESCRIPTION)
    add_shape_options(parser, defaults, DTYPES, vocab_help="vocabulary size; Qwen2/2.5's is 151936, Qwen3.5's 248320")
    add_device_option(parser)
    parser.add_argument("--masked-fraction", dest="masked_fraction", type=float, default=defaults.masked_fraction,
                        help="fraction at the end of each completion that is padding, in [0, 1) (default: "
                             "%(default)s, every token valid)")
    parser.add_argument("--loss", default=defaults.loss, metavar=choices_metavar(LOSSES),
                        help="the loss: grpo, or kl (whose implementations are "
                             f"{', '.join(KL_IMPLEMENTATIONS)}) (default: %(default)s)")
    parser.add_argument("--block-tokens", dest="block_tokens", type=int, nargs="+", default=[], metavar="N",
                        help="tokens per row chunk of logitless's blocks (BlockSizes.tokens); several values run "
                             "logitless once per value, the rows logitless@N: the curve of time and logits held "
                             "against the chunk (default: the per-device default)")
    parser.add_argument("--busy", type=int, default=0, metavar="N",
                        help="run every implementation with N processes keeping a core busy beside it, as on a "
                             "shared machine (default: %(default)s)")
    parser.add_argument("--impl", nargs="+", default=list(IMPLEMENTATIONS), metavar=choices_metavar(IMPLEMENTATIONS),
                        help="implementations to compare (both materialized yardsticks always run; peers not "
                             "installed, or without the chosen loss, are skipped) (default: all)")
    parser.add_argument("--profile", action="store_true",
                        help="run one more step of each implementation under torch.profiler and print where its "
                             "time goes (the operators and kernels with the most time of their own) (default: off)")
    add_report_options(parser)
    parser.set_defaults(handler=run_cli)


def run_cli(args: argparse.Namespace) -> int:
    require_positive(args, ("batch", "seq", "hidden", "vocab", "repeats"))
    for tokens in args.block_tokens:
        if tokens < 1:
            raise SystemExit(f"--block-tokens: must be >= 1, got {tokens}")
    if args.busy < 0:
        raise SystemExit(f"--busy: must be >= 0, got {args.busy}")
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
    shape = Shape(batch=args.batch, seq=args.seq, hidden=args.hidden, vocab=args.vocab, dtype=args.dtype,
                  device=args.device, masked_fraction=args.masked_fraction, loss=args.loss)
    report = run(shape, args.impl, repeats=args.repeats, block_tokens=tuple(args.block_tokens), busy=args.busy,
                 profile=args.profile)
    return write_report(report, args, format_table, plot)
