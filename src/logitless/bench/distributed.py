"""`logitless bench distributed`: what one step on a head sharded on the vocabulary moves between ranks and holds on
each, gathering the head (what TRL and FSDP2 do) against logitless's vocabulary-parallel step.

Measured: for each ``--ranks``, torchrun starts that many CPU processes (gloo) running `bench.distributed_rank`,
which takes steps (forward and backward of `fused_linear_logprobs`, ``--tokens`` tokens per rank) each way: one
whose every collective's bytes it counts and whose peak it counts as the most bytes of tensors the step allocated
and held at once (`bench.allocated.AllocatedPeak`: the same on every run, where the resident set is not), then
``--repeats`` timed (each the slowest rank's time from a barrier; the median reported, with its ratio to gathering's).
Computed: `logitless.ops.sharded.moved_bytes`, the byte count by which the ops choose between the two ways, at the
measured shape (beside the measurement, which it must equal) and at the shapes of ``--at`` (by default the
seed's, 8192 tokens per rank, H=4096, V=151,936, bf16, 8 ranks, and the same with V=262,144), with the number of
tokens per rank past which gathering the head moves less.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from logitless.bench.options import (benchmark_parser, choices_metavar, require_positive, require_writable,
                                     rows_so_far, write_report)
from logitless.bench.ratios import format_ratio, ratio
from logitless.bench.text_table import MB_PER_BYTE, column, header_line, row_line

WAYS = ("gather", "vocab_parallel", "tensor_parallel")
DTYPES = {"float32": 4, "bfloat16": 2}
AT = ("8192,4096,151936,bfloat16,8", "8192,4096,262144,bfloat16,8")


@dataclass(frozen=True)
class Step:
    tokens: int  # per rank
    hidden: int
    vocab: int
    dtype: str
    ranks: int

    def label(self) -> str:
        return f"{self.tokens} tokens/rank H={self.hidden} V={self.vocab} {self.dtype} {self.ranks} ranks"


def sent_per_rank(kind: str, whole_bytes: int, ranks: int) -> float:
    """What one rank sends for a collective whose whole tensor is ``whole_bytes``, on a ring."""
    share = (ranks - 1) / ranks * whole_bytes
    return 2 * share if kind == "all_reduce" else share


def computed(step: Step) -> dict:
    """`moved_bytes` of a data-parallel step at ``step``: each way's whole tensors, what each rank sends, and the
    tokens per rank past which gathering the head moves less."""
    from logitless.ops.sharded import moved_bytes

    size = DTYPES[step.dtype]
    moved = moved_bytes(step.tokens * step.ranks, step.hidden, step.vocab, size, size)
    per_token = moved_bytes(step.ranks, step.hidden, step.vocab, size, size)["vocab_parallel"]  # one token per rank
    return {"step": asdict(step), "moved_bytes": moved,
            "sent_per_rank": {way: (step.ranks - 1) / step.ranks * value for way, value in moved.items()},
            "crossover_tokens_per_rank": moved["gather"] / per_token}


def measure(step: Step, ways: tuple[str, ...], repeats: int) -> dict:
    """Every rank's collectives and peak of one step each way, and the time of ``repeats`` steps, from
    `bench.distributed_rank` under torchrun."""
    with tempfile.TemporaryDirectory() as directory:
        output = Path(directory) / "ranks.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(step.ranks),
                   "-m", "logitless.bench.distributed_rank", str(output), str(repeats), str(step.tokens),
                   str(step.hidden), str(step.vocab), step.dtype, *ways]
        done = subprocess.run(command, capture_output=True, text=True, env=os.environ | {"OMP_NUM_THREADS": "1"})
        if done.returncode != 0:
            raise SystemExit(f"bench distributed: the {step.ranks} ranks failed:\n{done.stderr[-3000:]}")
        ranks = json.loads(output.read_text())
    rows = {}
    for way, per_rank in ranks.items():
        by_kind = {}
        for kind, whole in per_rank[0]["collectives"]:
            by_kind[kind] = by_kind.get(kind, 0) + whole
        slowest = [max(times) for times in zip(*(rank["seconds"] for rank in per_rank))]  # each repeat's slowest rank
        rows[way] = {"collectives_bytes": by_kind, "collectives": per_rank[0]["collectives"],
                     "sent_per_rank": sum(sent_per_rank(kind, whole, step.ranks)
                                          for kind, whole in per_rank[0]["collectives"]),
                     "peak_bytes_per_rank": [rank["peak_bytes"] for rank in per_rank],
                     "step_seconds": statistics.median(slowest), "step_seconds_per_repeat": slowest,
                     "same_on_every_rank": all(rank["collectives"] == per_rank[0]["collectives"] for rank in per_rank)}
    for row in rows.values():
        row["time_x_gather"] = ratio(row["step_seconds"], rows["gather"]["step_seconds"]) if "gather" in rows else None
    return rows


def run(shape: Step, ranks: list[int], at: list[Step], ways: tuple[str, ...] = WAYS, repeats: int = 3) -> dict:
    measured = rows_so_far({})
    for count in ranks:
        step = Step(shape.tokens, shape.hidden, shape.vocab, shape.dtype, count)
        measured[str(count)] = {"computed": computed(step), **measure(step, ways, repeats)}
    return {"shape": asdict(shape), "repeats": repeats, "measured": measured, "at": [computed(step) for step in at]}


# the measured table's columns, docs/BENCHMARKS.md's table's; MB are text_table's (10^6 bytes)
MEASURED = (column("ranks", "<7", "ranks"), column("way", "<16", "way"),
            column("all-gather MB", ">14.1f", "all_gather", MB_PER_BYTE),
            column("reduce-scatter MB", ">18.1f", "reduce_scatter", MB_PER_BYTE),
            column("all-reduce MB", ">14.1f", "all_reduce", MB_PER_BYTE),
            column("sent/rank MB", ">13.1f", "sent_per_rank", MB_PER_BYTE),
            column("computed MB", ">12", "computed"),
            column("peak/rank MB", ">13.1f", "peak_bytes", MB_PER_BYTE),
            column("step ms", ">9.1f", "step_ms"), column("x gather", ">9", "time_x_gather"))


def measured_rows(report: dict) -> list[dict]:
    """One dict per (ranks, way) with `MEASURED`'s keys."""
    rows = []
    for count, measured in report["measured"].items():
        moved = measured["computed"]["moved_bytes"]
        for way in WAYS:
            if way not in measured:
                continue
            row, kinds = measured[way], measured[way]["collectives_bytes"]
            collectives = {kind: kinds.get(kind, 0) for kind in ("all_gather", "reduce_scatter", "all_reduce")}
            rows.append({"ranks": count, "way": way, **collectives, "sent_per_rank": row["sent_per_rank"],
                         "computed": f"{moved[way] * MB_PER_BYTE:.1f}" if way in moved else "-",
                         "peak_bytes": max(row["peak_bytes_per_rank"]), "step_ms": 1000 * row["step_seconds"],
                         "time_x_gather": format_ratio(row["time_x_gather"], 0)})
    return rows


def format_table(report: dict) -> str:
    shape = Step(**report["shape"])
    lines = [f"measured, CPU processes (gloo), one fused_linear_logprobs step: {shape.tokens} tokens per rank, "
             f"H={shape.hidden}, V={shape.vocab}, {shape.dtype}; peak: the most bytes of tensors the step allocated "
             f"held at once; step: the median of {report['repeats']}, each the slowest rank's",
             header_line(MEASURED), *(row_line(MEASURED, row) for row in measured_rows(report))]
    lines += ["", "computed (logitless.ops.sharded.moved_bytes), a data-parallel step, per rank:",
              f"{'shape':<48}{'gather: sent GB':>16}{'held GB':>9}{'vocab-parallel: sent GB':>24}{'held GB':>9}"
              f"{'gather wins past':>18}"]
    for row in report["at"]:
        step, moved, sent = Step(**row["step"]), row["moved_bytes"], row["sent_per_rank"]
        lines.append(f"{step.label():<48}{sent['gather'] / 1e9:>16.2f}{moved['gather'] / 1e9:>9.2f}"
                     f"{sent['vocab_parallel'] / 1e9:>24.2f}{moved['vocab_parallel'] / 1e9:>9.2f}"
                     f"{row['crossover_tokens_per_rank']:>11,.0f} tok/rank")
    return "\n".join(lines)


def _step_option(value: str) -> Step:
    parts = value.split(",")
    if len(parts) != 5 or parts[3] not in DTYPES or not all(part.isdigit() and int(part) > 0
                                                            for part in parts[:3] + parts[4:]):
        raise SystemExit(f"--at: expected TOKENS,H,V,DTYPE,RANKS (DTYPE one of {', '.join(DTYPES)}), got {value!r}")
    tokens, hidden, vocab, dtype, ranks = parts
    return Step(int(tokens), int(hidden), int(vocab), dtype, int(ranks))


def add_parser(targets) -> None:
    parser = benchmark_parser(
        targets, "distributed", "a step on a head sharded on the vocabulary: gathering it vs vocabulary-parallel",
        "One forward and backward of fused_linear_logprobs on an LM head sharded on the vocabulary over --ranks CPU "
        "processes (torchrun, gloo), three ways: the head gathered whole on every rank and its gradient "
        "reduce-scattered back (what TRL and FSDP2 do), logitless's vocabulary-parallel step with each rank's own "
        "tokens (FSDP2's layout) and with the same tokens on every rank (tensor parallelism). Per rank: the bytes "
        "of every collective, the peak (the most bytes of tensors the step allocated and held at once, the same on "
        "every run) and the step's time. Then the same byte count computed at --at's shapes, with the tokens per "
        "rank past which gathering moves less.")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4],
                        help="process counts to measure, each dividing --vocab (default: 2 4)")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per rank (default: %(default)s)")
    parser.add_argument("--hidden", "-H", type=int, default=512, help="hidden size (default: %(default)s)")
    parser.add_argument("--vocab", "-V", type=int, default=32768, help="vocabulary size (default: %(default)s)")
    parser.add_argument("--dtype", default="float32", metavar=choices_metavar(DTYPES),
                        help="dtype of the hidden states and the weight (default: %(default)s)")
    parser.add_argument("--at", nargs="*", default=list(AT), metavar="TOKENS,H,V,DTYPE,RANKS",
                        help=f"shapes to compute the bytes at, not run (default: {' '.join(AT)})")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed steps each way, after one that warms up and one that is counted; the median of "
                             "each step's slowest rank reported (default: %(default)s)")
    parser.add_argument("--json", help="write the report here (default: not written)")
    parser.set_defaults(handler=run_cli)


def run_cli(args: argparse.Namespace) -> int:
    require_positive(args, ("tokens", "hidden", "vocab", "repeats"))
    if args.dtype not in DTYPES:
        raise SystemExit(f"--dtype: expected one of {', '.join(DTYPES)}, got {args.dtype!r}")
    for count in args.ranks:
        if count < 2 or args.vocab % count:
            raise SystemExit(f"--ranks: each must be at least 2 and divide --vocab ({args.vocab}), got {count}")
    at = [_step_option(value) for value in args.at]
    require_writable(args, ("json",))
    shape = Step(args.tokens, args.hidden, args.vocab, args.dtype, 0)
    return write_report(run(shape, args.ranks, at, repeats=args.repeats), args, format_table)
