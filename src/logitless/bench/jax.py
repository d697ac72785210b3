"""`logitless bench jax`: the GRPO loss through the LM head in JAX, plain-JAX baseline vs fused.

For each implementation, ``jax.jit(jax.value_and_grad(loss, argnums=(hidden, weight)))`` is lowered
with `jax.ShapeDtypeStruct`s (nothing is allocated) and compiled; `compiled.memory_analysis()` gives
the program's temporary, argument, output and alias bytes. Unless ``--compile-only``, the inputs are
then made, both programs run (warm-up, then the timed repeats taken in turn, baseline and fused, so
the machine's load hits both alike; medians reported) and the loss and gradients are compared.

On a GPU or TPU each implementation also runs once in a fresh process to read the device's
``peak_bytes_in_use``: a high-water mark of the whole process, which is why it is reported beside
the compiled program's temporaries and not instead of them (docs/jax.md explains why).

The loss: `logitless.jax.fused_grpo_loss` with loss_type "grpo", beta 0.04, old and reference
log-probs, one completion a quarter masked; ``impl="materialized"`` is the baseline (full logits,
log_softmax, gather), ``impl="fused"`` the vocabulary-blocked custom_vjp.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from logitless.bench.options import (add_report_options, add_shape_options, require_positive, require_writable,
                                     write_report)
from logitless.ops.grpo_settings import GRPOSettings

IMPLEMENTATIONS = ("materialized", "fused")
DTYPES = ("float32", "bfloat16")
SETTINGS = GRPOSettings(loss_type="grpo", beta=0.04)  # the GRPO loss both implementations compute
MEMORY_FIELDS = ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes")


@dataclass
class Shape:
    batch: int = 1
    seq: int = 512
    hidden: int = 512
    vocab: int = 151936
    dtype: str = "float32"
    vocab_block: int | None = None  # BlockSizes.vocab of the fused loss; None: its default


def _specs(shape: Shape) -> dict:
    """The step's inputs as ShapeDtypeStructs: what lowering needs, with nothing allocated."""
    import jax
    import jax.numpy as jnp

    per_token = (shape.batch, shape.seq)
    return dict(hidden=jax.ShapeDtypeStruct((*per_token, shape.hidden), jnp.dtype(shape.dtype)),
                weight=jax.ShapeDtypeStruct((shape.vocab, shape.hidden), jnp.dtype(shape.dtype)),
                completion_ids=jax.ShapeDtypeStruct(per_token, jnp.int32),
                completion_mask=jax.ShapeDtypeStruct(per_token, jnp.float32),
                advantages=jax.ShapeDtypeStruct((shape.batch,), jnp.float32),
                old_logprobs=jax.ShapeDtypeStruct(per_token, jnp.float32),
                ref_logprobs=jax.ShapeDtypeStruct(per_token, jnp.float32))


def make_inputs(shape: Shape) -> dict:
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    per_token = (shape.batch, shape.seq)
    mask = np.ones(per_token, np.float32)
    mask[0, shape.seq * 3 // 4:] = 0  # one shorter completion
    base = -np.log(shape.vocab) - 0.5 * rng.random(per_token, np.float32)  # ~ log(1/V): near the policy's
    return dict(hidden=jnp.asarray(rng.standard_normal((*per_token, shape.hidden), np.float32) * 0.5, shape.dtype),
                weight=jnp.asarray(rng.standard_normal((shape.vocab, shape.hidden), np.float32) * 0.02, shape.dtype),
                completion_ids=jnp.asarray(rng.integers(0, shape.vocab, per_token), jnp.int32),
                completion_mask=jnp.asarray(mask), advantages=jnp.asarray(rng.standard_normal(shape.batch, np.float32)),
                old_logprobs=jnp.asarray(base + 0.05 * rng.standard_normal(per_token, np.float32)),
                ref_logprobs=jnp.asarray(base + 0.05 * rng.standard_normal(per_token, np.float32)))


def compile_step(impl: str, shape: Shape):
    """The compiled ``value_and_grad`` of the loss with respect to hidden and weight; lowered from specs."""
    import jax

    from logitless.jax import BlockSizes, fused_grpo_loss

    blocks = BlockSizes() if shape.vocab_block is None else BlockSizes(vocab=shape.vocab_block)

    def loss(hidden, weight, completion_ids, completion_mask, advantages, old_logprobs, ref_logprobs):
        value, _ = fused_grpo_loss(hidden, weight, completion_ids, completion_mask, advantages,
                                   old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, settings=SETTINGS, impl=impl,
                                   block_sizes=blocks if impl == "fused" else None)
        return value

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*_specs(shape).values()).compile()


def memory_of(compiled) -> dict:
    analysis = compiled.memory_analysis()
    return {field: int(getattr(analysis, field)) for field in MEMORY_FIELDS}


def _timed(compiled, inputs) -> tuple[float, tuple]:
    import jax

    started = time.perf_counter()
    result = jax.block_until_ready(compiled(*inputs.values()))  # in _specs' order
    return time.perf_counter() - started, result


def _differences(result, reference) -> dict:
    import jax.numpy as jnp

    (loss, grads), (reference_loss, reference_grads) = result, reference
    return {"loss": float(loss), "loss_diff": abs(float(loss) - float(reference_loss)),
            "max_abs_grad_diff": max(float(jnp.abs(g.astype(jnp.float32) - r.astype(jnp.float32)).max())
                                     for g, r in zip(grads, reference_grads))}


def device_peak_bytes() -> int | None:
    """The device allocator's ``peak_bytes_in_use`` (GPU/TPU), or None where it keeps none (CPU)."""
    import jax

    stats = jax.devices()[0].memory_stats()
    return None if not stats else stats.get("peak_bytes_in_use")


def run_peak_worker(impl: str, shape: Shape) -> dict:
    """In this (fresh) process: one step of ``impl``; the device's peak before and after it."""
    inputs = make_inputs(shape)
    compiled = compile_step(impl, shape)
    before = device_peak_bytes()
    _timed(compiled, inputs)
    return {"peak_bytes_in_use_before_step": before, "peak_bytes_in_use": device_peak_bytes()}


def _peak_in_fresh_process(impl: str, shape: Shape) -> dict:
    done = subprocess.run([sys.executable, "-m", "logitless.bench.jax", "--peak-worker", impl,
                           "--shape", json.dumps(asdict(shape))], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"bench jax peak worker {impl} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(shape: Shape, repeats: int = 3, compile_only: bool = False, progress: bool = True) -> dict:
    import jax
    from tqdm.auto import tqdm

    results, compiled = {}, {}
    for impl in tqdm(IMPLEMENTATIONS, desc="bench jax: compile", disable=not progress):
        started = time.perf_counter()
        compiled[impl] = compile_step(impl, shape)
        results[impl] = {"compile_s": time.perf_counter() - started, **memory_of(compiled[impl])}
    baseline = results["materialized"]["temp_size_in_bytes"]
    for result in results.values():
        result["temp_ratio"] = result["temp_size_in_bytes"] / baseline if baseline else None
    device = jax.devices()[0]
    report = {"shape": asdict(shape), "compile_only": compile_only, "repeats": 0 if compile_only else repeats,
              "backend": jax.default_backend(), "device": device.device_kind, "jax": jax.__version__,
              "results": results}
    if compile_only:
        return report
    inputs = make_inputs(shape)
    outputs = {impl: _timed(step, inputs)[1] for impl, step in compiled.items()}  # warm-up
    times = {impl: [] for impl in compiled}
    for _ in tqdm(range(repeats), desc="bench jax: timed steps", disable=not progress):
        for impl, step in compiled.items():  # in turn, so both see the same load
            times[impl].append(_timed(step, inputs)[0])
    for impl, result in results.items():
        result.update(time_s=statistics.median(times[impl]), times_s=times[impl],
                      **_differences(outputs[impl], outputs["materialized"]))
        result["time_ratio"] = result["time_s"] / statistics.median(times["materialized"])
    if device_peak_bytes() is not None:
        for impl, result in results.items():
            result.update(_peak_in_fresh_process(impl, shape))
    return report


def _megabytes(value: int) -> str:
    return f"{value / 1e6:,.0f}"  # MB = 10^6 bytes


def format_table(report: dict) -> str:
    s = report["shape"]
    lines = [f"GRPO loss value_and_grad(hidden, weight) in JAX, B={s['batch']} T={s['seq']} H={s['hidden']} "
             f"V={s['vocab']} {s['dtype']} on {report['backend']} ({report['device']})",
             f"{'impl':<14}{'temp MB':>10}{'x base':>8}{'arg MB':>9}{'out MB':>9}{'alias MB':>9}"
             + ("" if report["compile_only"] else f"{'time s':>9}{'x base':>8}{'loss diff':>11}{'max|dgrad|':>12}")
             + (f"{'peak MB':>10}" if "peak_bytes_in_use" in report["results"]["fused"] else "")]
    for name, r in report["results"].items():
        line = (f"{name:<14}{_megabytes(r['temp_size_in_bytes']):>10}{r['temp_ratio']:>8.3f}"
                f"{_megabytes(r['argument_size_in_bytes']):>9}{_megabytes(r['output_size_in_bytes']):>9}"
                f"{_megabytes(r['alias_size_in_bytes']):>9}")
        if not report["compile_only"]:
            line += f"{r['time_s']:>9.3f}{r['time_ratio']:>8.2f}{r['loss_diff']:>11.1e}{r['max_abs_grad_diff']:>12.1e}"
        if "peak_bytes_in_use" in r:
            line += f"{_megabytes(r['peak_bytes_in_use']):>10}"
        lines.append(line)
    return "\n".join(lines)


def plot(report: dict, path: str | Path) -> Path:
    from logitless.plots import ratio_bar_panels

    names = list(report["results"])
    panels = [("temp_size_in_bytes", "temp_ratio", 1e-6, "compiled temporaries (MB)", 3)]
    if not report["compile_only"]:
        panels.append(("time_s", "time_ratio", 1.0, "time per step (s, median)", 2))
    s = report["shape"]
    title = (f"JAX GRPO loss value_and_grad\nB={s['batch']} T={s['seq']} H={s['hidden']} V={s['vocab']} "
             f"{s['dtype']} ({report['backend']})")
    return ratio_bar_panels(report["results"], panels, ["#999999" if n == "materialized" else "#4c72b0" for n in names],
                            title, path)


def add_parser(targets) -> None:
    """Register ``logitless bench jax`` on the ``bench`` subcommand's subparsers."""
    defaults = Shape()
    parser = targets.add_parser(
        "jax", help="JAX GRPO loss: plain-JAX baseline vs fused, compiled memory and time",
        description="The GRPO loss (loss_type grpo, beta 0.04, old and reference log-probs) through the LM head "
                    "in JAX, value and gradients of hidden and weight under jax.jit: the plain-JAX baseline "
                    "(full logits) against the fused loss. Reports each compiled program's memory "
                    "(compiled.memory_analysis()) and, unless --compile-only, the step time (median of "
                    "--repeats) and the loss and gradient differences. Needs JAX (pip install 'logitless[jax]').")
    add_shape_options(parser, defaults, DTYPES)
    parser.add_argument("--vocab-block", dest="vocab_block", type=int, default=None,
                        help="vocabulary columns per block of the fused loss (default: BlockSizes' default, 2048)")
    parser.add_argument("--compile-only", dest="compile_only", action="store_true",
                        help="lower and compile only, allocating no inputs, so that B=1 T=8192 H=4096 V=151936 "
                             "compiles on any machine (default: off)")
    add_report_options(parser)
    parser.set_defaults(handler=run_cli)


def run_cli(args: argparse.Namespace) -> int:
    if args.dtype not in DTYPES:
        raise SystemExit(f"--dtype: expected one of {', '.join(DTYPES)}, got {args.dtype!r}")
    require_positive(args, ("batch", "seq", "hidden", "vocab", "repeats", "vocab_block"))
    require_writable(args)
    try:
        import jax  # noqa: F401
    except ImportError:
        raise SystemExit("bench jax: JAX is not installed (pip install 'logitless[jax]')") from None
    shape = Shape(args.batch, args.seq, args.hidden, args.vocab, args.dtype, args.vocab_block)
    report = run(shape, repeats=args.repeats, compile_only=args.compile_only)
    return write_report(report, args, format_table, plot)


def _main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--peak-worker", dest="impl", choices=IMPLEMENTATIONS, required=True)
    parser.add_argument("--shape", required=True)
    args = parser.parse_args()
    print(json.dumps(run_peak_worker(args.impl, Shape(**json.loads(args.shape)))))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
