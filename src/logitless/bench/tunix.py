"""`logitless bench tunix`: one training step of each of Tunix 0.1.7's learners, stock Tunix against Tunix switched
onto the fused head (`logitless.tunix.use_fused_head`), side by side.

The learners (`bench/tunix_learners.py`), each on tiny models with the real 151,936-token vocabulary by default (one
layer, hidden size 32), B sequences of T tokens:

* ``grpo``: the jitted value and gradient of Tunix's GRPO policy loss on a Qwen2 (prompts of T - T // 2 tokens,
  completions of T // 2), the scoring every GRPO and PPO step does, without the sampling around it;
* ``dpo``: Tunix's DPOTrainer's train step, a tied Qwen2 against a reference, chosen and rejected completions;
* ``orpo``: the same trainer, ORPO on a Llama3, no reference;
* ``peft``: Tunix's PeftTrainer's train step with its default cross-entropy, on a Gemma3;
* ``distillation``: Tunix's DistillationTrainer's train step, a LogitStrategy from a Qwen3 teacher to a Qwen2.

For each, stock and then fused: the step compiled (``lower(...).compile()``), its program's temporaries
(``compiled.memory_analysis()``, `bench/xla_memory.py`) and the largest array in its optimized HLO; then one
warm-up step and ``--repeats`` timed steps, the median reported. Stock and fused of one learner run one after the
other, not in turn: switching the head retraces every step.

Beside them, at the seed shape (``--seed-shape``, by default B=1 T=8192 H=4096 V=151936 bf16) the GRPO step's
scoring is lowered and compiled only: the policy loss's value and gradient on a Qwen2 without layers (embedding,
final norm, head), its parameters `jax.ShapeDtypeStruct`s from `flax.nnx.eval_shape`, so nothing of that size is
allocated; what differs between stock and fused there is the head's temporaries.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from dataclasses import asdict, dataclass

from logitless.bench.jax import COMPILE_SHAPE, Shape, shape_option
from logitless.bench.options import (add_report_options, benchmark_parser, choices_metavar, require_positive,
                                     require_writable, rows_so_far, write_report)
from logitless.bench.ratios import ratio
from logitless.bench.text_table import MB_PER_BYTE, column, header_line, row_line
from logitless.bench.xla_memory import memory_of

LEARNERS = ("grpo", "dpo", "orpo", "peft", "distillation")
HEADS = ("stock", "fused")
ELEMENT_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4,
                 "f64": 8, "s64": 8, "u64": 8}
HLO_ARRAY = re.compile(rf"\b({'|'.join(ELEMENT_BYTES)})\[(\d+(?:,\d+)*)\]")  # f32[2,128,151936]


@dataclass
class Sizes:
    batch: int = 2
    seq: int = 128
    vocab: int = 151936


def largest_array(hlo_text: str) -> tuple[str, int]:
    """The largest array a compiled program's HLO text names (an input, a temporary or an output): (its type, as
    ``f32[2,128,151936]``, and its bytes)."""
    best = ("none", 0)
    for dtype, dims in HLO_ARRAY.findall(hlo_text):
        size = ELEMENT_BYTES[dtype]
        for dim in dims.split(","):
            size *= int(dim)
        if size > best[1]:
            best = (f"{dtype}[{dims}]", size)
    return best


def _compiled_row(lowered) -> tuple[object, dict]:
    started = time.perf_counter()
    compiled = lowered.compile()
    array, array_bytes = largest_array(compiled.as_text())
    return compiled, {"compile_s": time.perf_counter() - started, **memory_of(compiled), "largest_array": array,
                      "largest_array_bytes": array_bytes}


def _timings(step, repeats: int) -> dict:
    """One warm-up ``step()``, then ``repeats`` timed: their seconds and median."""
    import jax

    jax.block_until_ready(step())
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        jax.block_until_ready(step())
        times.append(time.perf_counter() - started)
    return {"time_s": statistics.median(times), "times_s": times}


def measure_learner(learner: str, sizes: Sizes, repeats: int) -> dict:
    """One learner's step with the head as switched now: compiled memory, largest array, and its timed steps."""
    from logitless.bench import tunix_learners as learners

    if learner == "grpo":
        model = learners.tiny_qwen2(sizes.vocab)
        example = learners.on_policy_example(sizes.vocab, sizes.batch, sizes.seq - sizes.seq // 2, sizes.seq // 2)
        step, state = learners.grpo_loss_step(model, example, learners.grpo_config())
        compiled, row = _compiled_row(step.lower(state))
        return {**row, **_timings(lambda: compiled(state), repeats)}
    trainer, batch = learners.SFT_LEARNERS[learner](sizes.vocab, sizes.batch, sizes.seq)
    step, inputs = learners.train_step(trainer, batch)
    compiled, row = _compiled_row(step.func.lower(*step.args, inputs))  # nnx's: takes the model and optimizer
    return {**row, **_timings(lambda: compiled(*step.args, inputs), repeats)}


def measure_seed_shape(shape: Shape) -> dict:
    """The GRPO policy loss's value and gradient on a Qwen2 without layers at ``shape``, lowered from the shapes of
    its parameters and compiled only (the example's token ids, small, are made)."""
    import jax.numpy as jnp
    from flax import nnx

    from logitless.bench import tunix_learners as learners

    dtype = jnp.dtype(shape.dtype)
    model = nnx.eval_shape(lambda: learners.tiny_qwen2(shape.vocab, layers=0, embed_dim=shape.hidden, dtype=dtype,
                                                       param_dtype=dtype))
    example = learners.on_policy_example(shape.vocab, shape.batch, shape.seq - shape.seq // 2, shape.seq // 2)
    step, state = learners.grpo_loss_step(model, example, learners.grpo_config())
    return _compiled_row(step.lower(state))[1]


def _add_ratios(by_head: dict) -> None:
    stock = by_head["stock"]
    for row in by_head.values():
        for key, ratio_key in (("temp_size_in_bytes", "temp_ratio"), ("time_s", "time_ratio")):
            if key in row:
                row[ratio_key] = ratio(row[key], stock[key])


def run(learners=LEARNERS, sizes: Sizes = Sizes(), seed_shape: Shape | None = COMPILE_SHAPE,
        repeats: int = 3, progress: bool = True) -> dict:
    """Each learner's step, stock then fused, at ``sizes``; the GRPO step's scoring compiled at ``seed_shape``."""
    import importlib.metadata

    import jax
    from tqdm.auto import tqdm

    import logitless.tunix as switch

    report = {"learners": list(learners), "sizes": asdict(sizes),
              "seed_shape": None if seed_shape is None else asdict(seed_shape), "repeats": repeats,
              "backend": jax.default_backend(), "device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "tunix": importlib.metadata.version("google-tunix"),
              "results": rows_so_far({"run": {}, "seed": {}})}
    jobs = [("run", learner) for learner in learners] + ([("seed", "grpo")] if seed_shape else [])
    with tqdm(total=len(jobs) * len(HEADS), desc="bench tunix", disable=not progress) as bar:
        for name, learner in jobs:
            by_head = report["results"][name][learner] = {}
            for head in HEADS:
                bar.set_postfix_str(f"{learner} {head}" + (" (seed shape)" if name == "seed" else ""))
                if head == "fused":
                    switch.use_fused_head()
                try:
                    by_head[head] = (measure_seed_shape(seed_shape) if name == "seed"
                                     else measure_learner(learner, sizes, repeats))
                finally:
                    switch.use_stock_head()
                bar.update()
            _add_ratios(by_head)
    return report


COLUMNS = (column("learner", "<14", "learner"), column("head", "<7", "head"),
           column("temp MB", ">10,.1f", "temp_size_in_bytes", MB_PER_BYTE), column("x stock", ">9.3f", "temp_ratio"),
           column("largest array", ">24", "largest_array"),
           column("MB", ">9,.1f", "largest_array_bytes", MB_PER_BYTE), column("compile s", ">11.1f", "compile_s"))
TIMED_COLUMNS = (column("time s", ">9.3f", "time_s"), column("x stock", ">9.2f", "time_ratio"))


def format_table(report: dict) -> str:
    sizes = Sizes(**report["sizes"])
    lines = [f"one step of each Tunix {report['tunix']} learner, stock vs fused head, on {report['backend']} "
             f"({report['device']}), jax {report['jax']}",
             f"run: B={sizes.batch} T={sizes.seq} V={sizes.vocab}, hidden 32, one layer; median of "
             f"{report['repeats']} steps", header_line(COLUMNS + TIMED_COLUMNS)]
    for learner, by_head in report["results"]["run"].items():
        lines += [row_line(COLUMNS + TIMED_COLUMNS, {**row, "learner": learner, "head": head})
                  for head, row in by_head.items()]
    if report["results"]["seed"]:
        lines += [f"compile only: the GRPO step's scoring at {Shape(**report['seed_shape']).label()}, no layers",
                  header_line(COLUMNS)]
        lines += [row_line(COLUMNS, {**row, "learner": "grpo", "head": head})
                  for head, row in report["results"]["seed"]["grpo"].items()]
    return "\n".join(lines)


SUMMARY = "one step of each Tunix learner (grpo, dpo, orpo, peft, distillation): stock vs fused head"
DESCRIPTION = ("One training step of each of Tunix 0.1.7's learners on tiny models with the real 151,936-token "
               "vocabulary (one layer, hidden size 32), stock Tunix and then Tunix switched onto logitless's fused "
               "head: the compiled step's temporaries (compiled.memory_analysis()), the largest array in its HLO, "
               "and the median time of --repeats steps after one warm-up; fused / stock ratios side by side. Beside "
               "them, the GRPO step's scoring at the seed shape (--seed-shape), lowered from the parameters' shapes "
               "and compiled only, nothing of that size allocated. Needs Tunix (pip install 'logitless[tunix]').")


def add_parser(targets) -> None:
    """Register ``logitless bench tunix`` on the ``bench`` subcommand's subparsers (its --repeats: the timed steps
    of each learner and head, after one warm-up)."""
    parser = benchmark_parser(targets, "tunix", SUMMARY, DESCRIPTION)
    parser.add_argument("--batch", "-B", type=int, default=Sizes.batch,
                        help="sequences (DPO and ORPO: prompts, each with a chosen and a rejected completion) "
                             "(default: %(default)s)")
    parser.add_argument("--seq", "-T", type=int, default=Sizes.seq,
                        help="tokens per sequence, prompt and completion (at least 8) (default: %(default)s)")
    parser.add_argument("--vocab", "-V", type=int, default=Sizes.vocab,
                        help="vocabulary size of the tiny models (default: %(default)s, Qwen2's)")
    parser.add_argument("--learners", nargs="+", default=list(LEARNERS), metavar=choices_metavar(LEARNERS),
                        help=f"the learners to measure (default: {' '.join(LEARNERS)})")
    parser.add_argument("--seed-shape", dest="seed_shape", default="1,8192,4096,151936,bfloat16",
                        metavar="B,T,H,V,DTYPE",
                        help="the shape at which the GRPO step's scoring is compiled only, or none (default: "
                             "%(default)s)")
    add_report_options(parser, plot=False)
    parser.set_defaults(handler=run_cli)


def run_cli(args: argparse.Namespace) -> int:
    unknown = [learner for learner in args.learners if learner not in LEARNERS]
    if unknown:
        raise SystemExit(f"--learners: expected some of {', '.join(LEARNERS)}, got {unknown[0]!r}")
    require_positive(args, ("batch", "seq", "vocab", "repeats"))
    if args.seq < 8:
        raise SystemExit(f"--seq: must be >= 8 (a completion of 4 tokens, 3 of them before its padding), got "
                         f"{args.seq}")
    seed_shape = shape_option(args.seed_shape, "--seed-shape")
    if seed_shape is not None and seed_shape.seq < 8:
        raise SystemExit(f"--seed-shape: T must be >= 8, got {seed_shape.seq}")
    require_writable(args, ("json",))
    try:
        import logitless.tunix  # noqa: F401
    except ImportError:
        raise SystemExit("bench tunix: Tunix is not installed (pip install 'logitless[tunix]')") from None
    report = run(tuple(dict.fromkeys(args.learners)), Sizes(args.batch, args.seq, args.vocab), seed_shape,
                 args.repeats)
    return write_report(report, args, format_table)
