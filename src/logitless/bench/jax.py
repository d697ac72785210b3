"""`logitless bench jax`: the LM-head losses in JAX (cross-entropy, the KL of two heads, the GRPO loss), three ways.

* ``plain``: plain JAX, the ops' ``impl="reference"`` (the whole (N, V) logits, log_softmax, gather).
* ``seq_chunked``: what JAX trainers use today against that (MaxText's batch-sequence tiling, Levanter's and many
  scripts' ``lax.map`` over the sequence): the tokens cut into ``--seq-chunks`` slices, each slice's logits over
  the whole vocabulary computed inside ``jax.checkpoint`` under ``lax.map``, so one slice's logits exist at a
  time and backward recomputes them; the weight's gradient is summed over the slices in its own dtype.
* ``logitless``: the fused ops, ``impl="auto"`` (vocabulary blocks, no (N, V) array).

For each, ``jax.jit(jax.value_and_grad(loss, argnums=(hidden, weight)))`` is compiled and
`compiled.memory_analysis()` gives the program's temporary, argument, output and alias bytes, at two shapes in
one run: the memory shape (``--compile-shape``, by default B=1 T=8192 H=4096 V=151936 bf16), lowered from
`jax.ShapeDtypeStruct`s and compiled only (nothing allocated), and the run shape (-B -T -H -V --dtype, by default
B=1 T=512 H=512 V=151936 fp32), whose steps also run: warm-up, then the timed repeats taken in turn (every
implementation of a loss once per round, so the machine's load hits them alike; medians reported), and the loss
and gradients compared with plain JAX's.

The losses: ``ce``, `fused_linear_cross_entropy` (mean, a quarter of one sequence ignored); ``kl``, the masked mean
of `fused_linear_kl` to a second head of the same shape (a teacher, not differentiated); ``grpo``,
`fused_grpo_loss` (loss_type "grpo", beta 0.04, old and reference log-probs, one completion a quarter masked).

On a GPU or TPU each implementation also runs once in a fresh process to read the device's ``peak_bytes_in_use``:
a high-water mark of the whole process, which is why it is reported beside the compiled program's temporaries
and not instead of them (docs/jax.md explains why).

Beside them, the cross-entropy against Tokamax's ``xla`` and ``chunked_xla`` implementations at the run shape's
tokens, hidden size and vocabulary, per token and mean, in ``--tokamax-dtypes`` (`bench/tokamax.py`): in this
interpreter when it has Tokamax, else in a peer interpreter (``--peer-python``), logitless's rows run again there
beside them; ``--tokamax off`` leaves them out, ``--tokamax only`` measures them alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

from logitless.bench import tokamax as bench_tokamax
from logitless.bench.options import (add_report_options, add_shape_options, benchmark_parser, choices_metavar,
                                     require_positive, require_writable, rows_so_far, write_report)
from logitless.bench.text_table import MB_PER_BYTE, column, header_line, row_line
from logitless.bench.xla_memory import memory_of
from logitless.op_settings import GRPOSettings

LOSSES = ("ce", "kl", "grpo")
IMPLEMENTATIONS = ("plain", "seq_chunked", "logitless")
DTYPES = ("float32", "bfloat16")
SETTINGS = GRPOSettings(loss_type="grpo", beta=0.04, use_bias_correction_kl=False)  # every implementation's loss
SEQ_CHUNKS = 8
TOKAMAX_MODES = ("auto", "off", "only")


@dataclass
class Shape:
    batch: int = 1
    seq: int = 512
    hidden: int = 512
    vocab: int = 151936
    dtype: str = "float32"
    vocab_block: int | None = None  # BlockSizes.vocab of the fused ops; None: their default
    seq_chunks: int = SEQ_CHUNKS  # slices of the tokens for seq_chunked

    def label(self) -> str:
        return f"B={self.batch} T={self.seq} H={self.hidden} V={self.vocab} {self.dtype}"


COMPILE_SHAPE = Shape(1, 8192, 4096, 151936, "bfloat16")


def _specs(loss: str, shape: Shape) -> dict:
    """The step's inputs as ShapeDtypeStructs, in the order the loss takes them: what lowering needs."""
    import jax
    import jax.numpy as jnp

    per_token, dtype = (shape.batch, shape.seq), jnp.dtype(shape.dtype)
    specs = dict(hidden=jax.ShapeDtypeStruct((*per_token, shape.hidden), dtype),
                 weight=jax.ShapeDtypeStruct((shape.vocab, shape.hidden), dtype))
    if loss == "kl":
        specs.update(teacher_hidden=specs["hidden"], teacher_weight=specs["weight"],
                     mask=jax.ShapeDtypeStruct(per_token, jnp.float32))
    elif loss == "ce":
        specs.update(targets=jax.ShapeDtypeStruct(per_token, jnp.int32))
    else:
        specs.update(completion_ids=jax.ShapeDtypeStruct(per_token, jnp.int32),
                     completion_mask=jax.ShapeDtypeStruct(per_token, jnp.float32),
                     advantages=jax.ShapeDtypeStruct((shape.batch,), jnp.float32),
                     old_log_probs=jax.ShapeDtypeStruct(per_token, jnp.float32),
                     ref_log_probs=jax.ShapeDtypeStruct(per_token, jnp.float32))
    return specs


def make_inputs(loss: str, shape: Shape) -> dict:
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    per_token = (shape.batch, shape.seq)
    mask = np.ones(per_token, np.float32)
    mask[0, shape.seq * 3 // 4:] = 0  # one shorter completion
    ids = rng.integers(0, shape.vocab, per_token)
    inputs = dict(hidden=jnp.asarray(rng.standard_normal((*per_token, shape.hidden), np.float32) * 0.5, shape.dtype),
                  weight=jnp.asarray(rng.standard_normal((shape.vocab, shape.hidden), np.float32) * 0.02, shape.dtype))
    if loss == "kl":
        inputs.update(teacher_hidden=jnp.asarray(rng.standard_normal((*per_token, shape.hidden), np.float32) * 0.5,
                                                 shape.dtype),
                      teacher_weight=jnp.asarray(rng.standard_normal((shape.vocab, shape.hidden), np.float32) * 0.02,
                                                 shape.dtype), mask=jnp.asarray(mask))
    elif loss == "ce":
        inputs.update(targets=jnp.asarray(np.where(mask > 0, ids, -100), jnp.int32))
    else:
        base = -np.log(shape.vocab) - 0.5 * rng.random(per_token, np.float32)  # ~ log(1/V): near the policy's
        inputs.update(completion_ids=jnp.asarray(ids, jnp.int32), completion_mask=jnp.asarray(mask),
                      advantages=jnp.asarray(rng.standard_normal(shape.batch, np.float32)),
                      old_log_probs=jnp.asarray(base + 0.05 * rng.standard_normal(per_token, np.float32)),
                      ref_log_probs=jnp.asarray(base + 0.05 * rng.standard_normal(per_token, np.float32)))
    return inputs


def _seq_chunked(stats_of_slice, num_chunks: int, *per_token):
    """``stats_of_slice`` (a function of per-token arrays (n, ...) returning per-token statistics (n,)) over all
    tokens, one slice of N / num_chunks tokens at a time inside `jax.checkpoint`: each slice's logits exist only
    while it is computed, and backward recomputes them. per_token: arrays (N, ...)."""
    import jax
    from jax import lax

    slices = [array.reshape(num_chunks, -1, *array.shape[1:]) for array in per_token]
    stats = lax.map(lambda arrays: jax.checkpoint(stats_of_slice)(*arrays), slices)
    return jax.tree.map(lambda values: values.reshape(-1), stats)


def _loss_function(loss: str, impl: str, shape: Shape):
    """loss(hidden, weight, *the other inputs of `_specs`) -> the scalar loss, by ``impl``."""
    import jax
    import jax.numpy as jnp

    from logitless.jax import (BlockSizes, Head, fused_grpo_loss, fused_linear_cross_entropy, fused_linear_kl,
                               reference)
    from logitless.jax.grpo import GRPOData, GRPOTerms, token_weights

    ops_impl = "auto" if impl == "logitless" else "reference"
    blocks = BlockSizes(vocab=shape.vocab_block) if impl == "logitless" and shape.vocab_block else None

    def flat(array):
        return array.reshape(-1, *array.shape[2:])

    if loss == "ce":
        def ce(hidden, weight, targets):
            if impl != "seq_chunked":
                return fused_linear_cross_entropy(hidden, weight, targets, block_sizes=blocks, impl=ops_impl)
            keep = flat(targets) != -100

            def terms(hidden, targets):  # (n,)
                return -reference.token_stats(Head(weight), hidden, jnp.maximum(targets, 0)).log_probs

            return jnp.where(keep, _seq_chunked(terms, shape.seq_chunks, flat(hidden), flat(targets)), 0).sum() \
                / keep.sum()
        return ce

    if loss == "kl":
        def kl(hidden, weight, teacher_hidden, teacher_weight, mask):
            if impl != "seq_chunked":
                per_token = fused_linear_kl(hidden, weight, teacher_hidden, teacher_weight, mask=mask,
                                            block_sizes=blocks, impl=ops_impl)
            else:
                def slice_kl(hidden, teacher_hidden):  # (n,)
                    return reference.token_kl(Head(weight), hidden, Head(teacher_weight), teacher_hidden)

                per_token = jnp.where(flat(mask) > 0, _seq_chunked(slice_kl, shape.seq_chunks, flat(hidden),
                                                                    flat(teacher_hidden)), 0)
            return per_token.sum() / mask.sum()
        return kl

    def grpo(hidden, weight, completion_ids, completion_mask, advantages, old_log_probs, ref_log_probs):
        if impl != "seq_chunked":
            return fused_grpo_loss(hidden, weight, completion_ids, completion_mask, advantages,
                                   old_log_probs=old_log_probs, ref_log_probs=ref_log_probs, settings=SETTINGS,
                                   block_sizes=blocks, impl=ops_impl)[0]

        def slice_stats(hidden, ids):  # (n,)
            return reference.token_stats(Head(weight), hidden, ids)

        keep = completion_mask > 0
        stats = _seq_chunked(slice_stats, shape.seq_chunks, flat(hidden), flat(completion_ids))
        data = GRPOData(jnp.broadcast_to(advantages[:, None], keep.shape), old_log_probs, ref_log_probs,
                        token_weights(keep, SETTINGS), keep.astype(jnp.float32))
        return GRPOTerms(SETTINGS)(stats, jax.tree.map(flat, data)).sum()
    return grpo


def compile_step(loss: str, impl: str, shape: Shape):
    """The compiled ``value_and_grad`` of the loss with respect to hidden and weight; lowered from specs."""
    import jax

    step = jax.jit(jax.value_and_grad(_loss_function(loss, impl, shape), argnums=(0, 1)))
    return step.lower(*_specs(loss, shape).values()).compile()


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


def run_peak_worker(loss: str, impl: str, shape: Shape) -> dict:
    """In this (fresh) process: one step of ``impl``; the device's peak before and after it."""
    inputs = make_inputs(loss, shape)
    compiled = compile_step(loss, impl, shape)
    before = device_peak_bytes()
    _timed(compiled, inputs)
    return {"peak_bytes_in_use_before_step": before, "peak_bytes_in_use": device_peak_bytes()}


def _peak_in_fresh_process(loss: str, impl: str, shape: Shape) -> dict:
    done = subprocess.run([sys.executable, "-m", "logitless.bench.jax", "--peak-worker", loss, impl,
                           "--shape", json.dumps(asdict(shape))], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"bench jax peak worker {loss} {impl} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _compiled_memory(loss: str, shape: Shape, progress) -> tuple[dict, dict]:
    """(the compiled steps, their memory and compile time by implementation, with the ratios to plain JAX's)."""
    results, compiled = {}, {}
    for impl in IMPLEMENTATIONS:
        progress.set_postfix_str(f"{loss} {impl} {shape.label()}")
        started = time.perf_counter()
        compiled[impl] = compile_step(loss, impl, shape)
        results[impl] = {"compile_s": time.perf_counter() - started, **memory_of(compiled[impl])}
        progress.update()
    baseline = results["plain"]["temp_size_in_bytes"]
    for result in results.values():
        result["temp_ratio"] = result["temp_size_in_bytes"] / baseline if baseline else None
    return compiled, results


def _timed_runs(loss: str, shape: Shape, compiled: dict, results: dict, repeats: int) -> None:
    inputs = make_inputs(loss, shape)
    outputs = {impl: _timed(step, inputs)[1] for impl, step in compiled.items()}  # warm-up
    times = {impl: [] for impl in compiled}
    for _ in range(repeats):
        for impl, step in compiled.items():  # in turn, so all see the same load
            times[impl].append(_timed(step, inputs)[0])
    for impl, result in results.items():
        result.update(time_s=statistics.median(times[impl]), times_s=times[impl],
                      **_differences(outputs[impl], outputs["plain"]))
        result["time_ratio"] = result["time_s"] / statistics.median(times["plain"])
    if device_peak_bytes() is not None:
        for impl, result in results.items():
            result.update(_peak_in_fresh_process(loss, impl, shape))


def run(losses=LOSSES, run_shape: Shape = Shape(), compile_shape: Shape | None = COMPILE_SHAPE, repeats: int = 3,
        compile_only: bool = False, progress: bool = True) -> dict:
    """Every loss at the compile shape (memory only) and at the run shape (memory, and unless ``compile_only`` the
    timed steps)."""
    import jax
    from tqdm.auto import tqdm

    shapes = {"run": run_shape} if compile_shape is None else {"compile": compile_shape, "run": run_shape}
    report = {"losses": list(losses), "shapes": {name: asdict(shape) for name, shape in shapes.items()},
              "compile_only": compile_only, "repeats": 0 if compile_only else repeats,
              "backend": jax.default_backend(), "device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "results": rows_so_far({name: {} for name in shapes})}
    with tqdm(total=len(losses) * len(shapes) * len(IMPLEMENTATIONS), desc="bench jax: compile",
              disable=not progress) as bar:
        for loss in losses:
            for name, shape in shapes.items():
                compiled, results = _compiled_memory(loss, shape, bar)
                if name == "run" and not compile_only:
                    bar.set_postfix_str(f"{loss}: timed steps")
                    _timed_runs(loss, shape, compiled, results, repeats)
                report["results"][name][loss] = results
    return report


COLUMNS = (column("loss", "<6", "loss"), column("impl", "<13", "impl"),
           column("temp MB", ">10,.0f", "temp_size_in_bytes", MB_PER_BYTE), column("x plain", ">9.3f", "temp_ratio"),
           column("arg MB", ">9,.0f", "argument_size_in_bytes", MB_PER_BYTE),
           column("out MB", ">9,.0f", "output_size_in_bytes", MB_PER_BYTE))
TIMED_COLUMNS = (column("time s", ">9.3f", "time_s"), column("x plain", ">9.2f", "time_ratio"),
                 column("loss diff", ">11.1e", "loss_diff"), column("max|dgrad|", ">12.1e", "max_abs_grad_diff"))


def format_table(report: dict) -> str:
    lines = [f"value_and_grad(hidden, weight) of each loss in JAX, on {report['backend']} ({report['device']}), "
             f"jax {report['jax']}"]
    for name, by_loss in report["results"].items():
        if not by_loss:  # --tokamax only
            continue
        shape = Shape(**report["shapes"][name])
        timed = name == "run" and not report["compile_only"]
        lines.append(f"{'compile only' if not timed else 'run'}: {shape.label()}, seq_chunked in {shape.seq_chunks} "
                     "slices")
        columns = COLUMNS + (TIMED_COLUMNS if timed else ())
        lines.append(header_line(columns))
        for loss, results in by_loss.items():
            for impl, r in results.items():
                line = row_line(columns, {**r, "loss": loss, "impl": impl})
                if "peak_bytes_in_use" in r:
                    line += f"  peak {r['peak_bytes_in_use'] * MB_PER_BYTE:,.0f} MB"
                lines.append(line)
    if "results" in report.get("tokamax", {}):
        from logitless.bench.tokamax import format_table as tokamax_table

        lines.append(tokamax_table(report["tokamax"]))
    return "\n".join(lines)


def plot(report: dict, path):
    """Bars of each loss's compiled temporaries at the compile shape (or the run shape), and its step time."""
    from logitless.plots import ratio_bar_panels

    memory_shape = "compile" if "compile" in report["results"] else "run"
    rows = {}
    for loss in report["losses"]:
        for impl in IMPLEMENTATIONS:
            rows[f"{loss} {impl}"] = dict(report["results"][memory_shape][loss][impl])
            if not report["compile_only"]:
                timed = report["results"]["run"][loss][impl]
                rows[f"{loss} {impl}"].update(time_s=timed["time_s"], time_ratio=timed["time_ratio"])
    panels = [("temp_size_in_bytes", "temp_ratio", 1e-6,
               f"compiled temporaries (MB)\n{Shape(**report['shapes'][memory_shape]).label()}", 3)]
    if not report["compile_only"]:
        panels.append(("time_s", "time_ratio", 1.0, f"time per step (s)\n{Shape(**report['shapes']['run']).label()}",
                       2))
    colors = {"plain": "#999999", "seq_chunked": "#dd8452", "logitless": "#4c72b0"}
    return ratio_bar_panels(rows, panels, [colors[name.split()[1]] for name in rows],
                            f"JAX LM-head losses, value_and_grad ({report['backend']})", path, rotate_names=True)


def shape_option(text: str, option: str = "--compile-shape") -> Shape | None:
    """The value of a shape option (``option``, named in its error): B,T,H,V,DTYPE, or none."""
    if text == "none":
        return None
    parts = text.split(",")
    if len(parts) != 5 or not all(part.isdigit() and int(part) > 0 for part in parts[:4]) or parts[4] not in DTYPES:
        raise SystemExit(f"{option}: expected B,T,H,V,DTYPE (positive ints, DTYPE one of {', '.join(DTYPES)}) "
                         f"or none, got {text!r}")
    return Shape(*map(int, parts[:4]), parts[4])


SUMMARY = "JAX LM-head losses (ce, kl, grpo): plain JAX, sequence-chunked and logitless; memory and time"
DESCRIPTION = ("Cross-entropy, the KL of two heads and the GRPO loss through the LM head in JAX, value and "
               "gradients of hidden and weight under jax.jit, three ways: plain JAX (the whole logits), the "
               "sequence-chunked baseline (full-vocabulary logits for one slice of the tokens at a time, "
               "recomputed in backward) and logitless's fused ops. Reports each compiled program's memory "
               "(compiled.memory_analysis()) at the compile shape (compiled only, nothing allocated) and at "
               "the run shape, where the steps also run: step time (median of --repeats) and the loss and "
               "gradient differences to plain JAX. Beside them, the cross-entropy against Tokamax's xla and "
               "chunked_xla implementations (per token and mean, each dtype of --tokamax-dtypes, at the run "
               "shape's N=B*T, H and V): temporaries, step time and the errors of the loss and both gradients "
               "against a float64 reference; run by --peer-python, logitless's rows again beside them, where "
               "this interpreter cannot import Tokamax (make tokamax-env makes that interpreter). Needs JAX "
               "(pip install 'logitless[jax]').")


def add_parser(targets) -> None:
    """Register ``logitless bench jax`` on the ``bench`` subcommand's subparsers."""
    defaults = Shape()
    parser = benchmark_parser(targets, "jax", SUMMARY, DESCRIPTION)
    parser.add_argument("--loss", nargs="+", default=list(LOSSES), metavar=choices_metavar(LOSSES),
                        help=f"the losses to measure (default: {' '.join(LOSSES)})")
    add_shape_options(parser, defaults, DTYPES)
    parser.add_argument("--compile-shape", dest="compile_shape", default="1,8192,4096,151936,bfloat16",
                        metavar="B,T,H,V,DTYPE",
                        help="a second shape, compiled only (no inputs are made), or none (default: %(default)s)")
    parser.add_argument("--vocab-block", dest="vocab_block", type=int, default=None,
                        help="vocabulary columns per block of the fused ops (default: BlockSizes' default, 2048)")
    parser.add_argument("--seq-chunks", dest="seq_chunks", type=int, default=SEQ_CHUNKS,
                        help="slices of the tokens for the sequence-chunked baseline, dividing B*T (default: "
                             "%(default)s)")
    parser.add_argument("--compile-only", dest="compile_only", action="store_true",
                        help="at the run shape too, lower and compile only (default: off)")
    parser.add_argument("--tokamax", default="auto", metavar=choices_metavar(TOKAMAX_MODES),
                        help="the cross-entropy against Tokamax's xla and chunked_xla at the run shape: auto (where "
                             "this interpreter or --peer-python has Tokamax; else one line says how to get it), "
                             "off, or only (the Tokamax rows alone) (default: %(default)s)")
    parser.add_argument("--tokamax-dtypes", dest="tokamax_dtypes", nargs="+", default=list(DTYPES),
                        metavar=choices_metavar(DTYPES),
                        help=f"the dtypes of the Tokamax rows (default: {' '.join(DTYPES)})")
    parser.add_argument("--peer-python", dest="peer_python", default=bench_tokamax.PEER_PYTHON, metavar="PATH",
                        help="a Python with Tokamax (>= 3.12) that runs the Tokamax rows, logitless's beside them, "
                             "where this one cannot import Tokamax; make tokamax-env makes the default "
                             "(default: %(default)s)")
    add_report_options(parser)
    parser.set_defaults(handler=run_cli)


def run_cli(args: argparse.Namespace) -> int:
    if args.dtype not in DTYPES:
        raise SystemExit(f"--dtype: expected one of {', '.join(DTYPES)}, got {args.dtype!r}")
    unknown = [loss for loss in args.loss if loss not in LOSSES]
    if unknown:
        raise SystemExit(f"--loss: expected some of {', '.join(LOSSES)}, got {unknown[0]!r}")
    if args.tokamax not in TOKAMAX_MODES:
        raise SystemExit(f"--tokamax: expected one of {', '.join(TOKAMAX_MODES)}, got {args.tokamax!r}")
    unknown = [dtype for dtype in args.tokamax_dtypes if dtype not in DTYPES]
    if unknown:
        raise SystemExit(f"--tokamax-dtypes: expected some of {', '.join(DTYPES)}, got {unknown[0]!r}")
    if args.tokamax == "only" and args.plot:
        raise SystemExit("--plot: draws the ce, kl and grpo rows, which --tokamax only leaves out")
    require_positive(args, ("batch", "seq", "hidden", "vocab", "repeats", "vocab_block", "seq_chunks"))
    compile_shape = None if args.tokamax == "only" else shape_option(args.compile_shape)
    run_shape = Shape(args.batch, args.seq, args.hidden, args.vocab, args.dtype, args.vocab_block, args.seq_chunks)
    for shape in (run_shape, compile_shape):
        if shape is not None and (shape.batch * shape.seq) % args.seq_chunks:
            raise SystemExit(f"--seq-chunks: {args.seq_chunks} does not divide the {shape.batch * shape.seq} tokens "
                             f"of {shape.label()}")
    if compile_shape is not None:
        compile_shape.vocab_block, compile_shape.seq_chunks = args.vocab_block, args.seq_chunks
    require_writable(args)
    try:
        import jax  # noqa: F401
    except ImportError:
        raise SystemExit("bench jax: JAX is not installed (pip install 'logitless[jax]')") from None
    losses = () if args.tokamax == "only" else tuple(dict.fromkeys(args.loss))
    report = run(losses, run_shape, compile_shape, repeats=args.repeats, compile_only=args.compile_only)
    if args.tokamax != "off":
        comparison = bench_tokamax.Comparison(args.batch * args.seq, args.hidden, args.vocab,
                                              list(dict.fromkeys(args.tokamax_dtypes)), args.repeats,
                                              args.compile_only, args.vocab_block)
        report["tokamax"] = bench_tokamax.tokamax_section(comparison, args.peer_python)
    status = write_report(report, args, format_table, plot)
    return 1 if "failed" in report.get("tokamax", {}) else status


def _main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--peak-worker", dest="worker", nargs=2, metavar=("LOSS", "IMPL"), required=True)
    parser.add_argument("--shape", required=True)
    args = parser.parse_args()
    loss, impl = args.worker
    print(json.dumps(run_peak_worker(loss, impl, Shape(**json.loads(args.shape)))))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
