"""`logitless bench compile`: every Triton kernel of the ops compiled ahead of time for the GPUs they are meant for,
on a machine that need not have one, and what the compilers report of each: registers, bytes spilled, shared memory,
and the warps per multiprocessor those leave resident (`gpu_targets`).

What is compiled: each kernel of `logitless.ops.triton` at the tile of its table (``STATS_TILES`` or
``GRAD_TILES``) for each target, the only tiles the ops launch (no autotuner picks others); ``--tiles sweep`` adds
every tile of `CANDIDATE_TILES`, the ones each table's tile is chosen from (`best_tiles`). Each in the dtype of the
blocks the ops hand it (fp32 for fp32, bf16 and fp16 inputs alike: `logitless.ops.head.stat_dtype`), with the
flags under which it has the most code (``--flags all``: every combination), as a launch on aligned tensors and on
unaligned ones specializes it, with int64 and int32 token ids where it reads them: one row per kernel, tile and
target, the worst of those compiles. The command fails when a tile the ops launch does not compile, spills, or
needs more shared memory than its target has.
"""

from __future__ import annotations

import argparse
import itertools
import os
import tempfile
from dataclasses import asdict

from logitless.bench.compile_job import ID_DTYPES, Variant
from logitless.bench.gpu_targets import TARGETS
from logitless.bench.options import (benchmark_parser, choices_metavar, require_positive, require_writable,
                                     rows_so_far, write_report)
from logitless.bench.text_table import column, header_line, row_line

# the tiles a table's tile is chosen from: tokens x vocabulary columns, powers of two, at most 2048 elements (16 per
# thread of a program of 4 warps of 32 threads; beyond, the NVIDIA kernels keep few warps resident or spill)
CANDIDATE_TILES = tuple((tokens, vocab) for tokens in (1, 2, 4, 8, 16) for vocab in (128, 256, 512, 1024, 2048)
                        if tokens * vocab <= 2048)
TILE_MODES = ("default", "sweep")
USABLE_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
FLAG_MODES = ("heaviest", "all")


def _variants(catalogue: dict, targets: list[str], tiles: str, flags: str) -> list[Variant]:
    variants = []
    for name, kernel in catalogue["kernels"].items():
        flag_sets = ([tuple(map(tuple, kernel["heaviest"]))] if flags == "heaviest" else
                     [tuple(zip(kernel["flags"], values))
                      for values in itertools.product((False, True), repeat=len(kernel["flags"]))])
        for target in targets:
            default = tuple(kernel["defaults"][target])
            shapes = [default] + ([tile for tile in CANDIDATE_TILES if tile != default] if tiles == "sweep" else [])
            for (tokens, vocab), flag_set, aligned, ids, blocks in itertools.product(
                    shapes, flag_sets, (True, False), ID_DTYPES if kernel["reads_ids"] else (None,),
                    sorted(set(catalogue["blocks"].values()))):
                variants.append(Variant(name, target, tokens, vocab, flag_set, aligned, ids, blocks))
    return variants


def new_row(variant: Variant, default: tuple[int, int]) -> dict:
    """The row of ``variant``'s kernel, tile and target, before any of its compiles."""
    return {"kernel": variant.kernel, "target": variant.target, "tokens": variant.tokens, "vocab": variant.vocab,
            "default": (variant.tokens, variant.vocab) == default, "compiles": 0, "errors": [], "registers": 0,
            "spill_bytes": 0, "shared_bytes": 0, "warps": 0, "occupancy": None}


def fold(row: dict, result: dict) -> None:
    """Add one variant's compile to its row: the row keeps the worst of its variants."""
    row["compiles"] += 1
    if "error" in result:
        row["errors"].append(result["error"])
        return
    target = TARGETS[row["target"]]
    occupancy = target.occupancy(result["registers"], result["shared_bytes"], result["warps"], result.get("sgprs", 0))
    for key in ("registers", "spill_bytes", "shared_bytes", "warps"):
        row[key] = max(row[key], result[key])
    if "sgprs" in result:
        row["sgprs"] = max(row.get("sgprs", 0), result["sgprs"])
    row["occupancy"] = occupancy if row["occupancy"] is None else min(row["occupancy"], occupancy)


def problems(row: dict) -> list[str]:
    """Why a row's tile is not fit to launch on its target: it does not compile, spills, or needs more shared memory
    than a block may have (empty: it is fit)."""
    target = TARGETS[row["target"]]
    found = [f"does not compile: {row['errors'][0]}"] if row["errors"] else []
    if row["spill_bytes"]:
        found.append(f"spills {row['spill_bytes']} bytes")
    if row["shared_bytes"] > target.shared_per_block:
        found.append(f"needs {row['shared_bytes']} bytes of shared memory, over the {target.shared_per_block} a block "
                     "may have")
    if not found and not row["occupancy"]:
        found.append("no block can be resident")
    return found


def best_tiles(rows: list[dict], catalogue: dict) -> dict:
    """{table: {target: ...}}: at each tile compiled for every kernel of the table, the fewest warps per SM its
    kernels leave resident (None where one of them is unfit: `problems`), and the best tile: the most warps, then
    the largest (more columns per program), then the widest; with the table's tile now."""
    best = {}
    for table in sorted({kernel["table"] for kernel in catalogue["kernels"].values()}):
        members = [name for name, kernel in catalogue["kernels"].items() if kernel["table"] == table]
        best[table] = {}
        for target in sorted({row["target"] for row in rows}, key=list(TARGETS).index):
            by_tile = {}
            for row in rows:
                if row["kernel"] in members and row["target"] == target:
                    by_tile.setdefault((row["tokens"], row["vocab"]), []).append(row)
            warps = {tile: None if any(problems(row) for row in tile_rows) else min(r["occupancy"] for r in tile_rows)
                     for tile, tile_rows in by_tile.items() if len(tile_rows) == len(members)}
            fit = [tile for tile, count in warps.items() if count is not None]
            chosen = max(fit, key=lambda tile: (warps[tile], tile[0] * tile[1], tile[1]), default=None)
            best[table][target] = {"warps_per_sm": {_tile(tile): count for tile, count in sorted(
                                       warps.items(), key=lambda item: (item[0][0] * item[0][1], item[0][1]))},
                                   "tile": chosen, "now": tuple(catalogue["kernels"][members[0]]["defaults"][target])}
    return best


class Compilers:
    """``jobs`` worker processes that compile (`compile_job`), Triton's cache in a temporary directory of their own
    (removed on leaving the ``with`` block)."""

    def __init__(self, jobs: int = 1):
        self.jobs = jobs

    def __enter__(self) -> Compilers:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        from logitless.bench import compile_job

        self._cache = tempfile.TemporaryDirectory(prefix="logitless-compile-")
        self._pool = ProcessPoolExecutor(self.jobs, mp_context=multiprocessing.get_context("spawn"),
                                         initializer=compile_job.start_worker, initargs=(self._cache.name,))
        return self

    def __exit__(self, *exc) -> None:
        self._pool.shutdown(cancel_futures=True)
        self._cache.cleanup()

    def call(self, function, *args):
        """``function(*args)`` in a worker."""
        return self._pool.submit(function, *args).result()

    def compile(self, variants: list[Variant], progress: bool = False):
        """(variant, `compile_job.compile_variant`'s result) of each of ``variants``, as each finishes."""
        from concurrent.futures import as_completed

        from tqdm.auto import tqdm

        from logitless.bench.compile_job import compile_variant

        futures = {self._pool.submit(compile_variant, variant): variant for variant in variants}
        for future in tqdm(as_completed(futures), total=len(futures), desc="bench compile", disable=not progress):
            yield futures[future], future.result()


def run(targets: list[str], tiles: str = "default", flags: str = "heaviest", jobs: int = 1,
        progress: bool = True) -> dict:
    """Compile the kernels (`_variants`) for ``targets`` in ``jobs`` worker processes; the report's rows are one per
    kernel, tile and target."""
    from concurrent.futures.process import BrokenProcessPool

    from logitless.bench import compile_job

    rows = rows_so_far({})
    try:
        with Compilers(jobs) as compilers:
            catalogue = compilers.call(compile_job.catalogue)
            unusable = {target: compilers.call(compile_job.target_unusable, target) for target in targets}
            variants = _variants(catalogue, [target for target in targets if unusable[target] is None], tiles, flags)
            for variant, result in compilers.compile(variants, progress):
                default = tuple(catalogue["kernels"][variant.kernel]["defaults"][variant.target])
                key = f"{variant.kernel} {variant.target} {variant.tokens}x{variant.vocab}"
                fold(rows.setdefault(key, new_row(variant, default)), result)
            triton_version = compilers.call(compile_job.triton_version)
    except BrokenProcessPool as err:
        raise SystemExit(f"bench compile: a compiler process died ({err})") from None
    ordered = sorted(rows.values(), key=lambda row: (not row["default"], row["kernel"], list(TARGETS).index(
        row["target"]), row["tokens"] * row["vocab"], row["vocab"]))
    for row in ordered:
        row["problems"] = problems(row)
    return {"triton": triton_version, "tiles": tiles, "flags": flags, "blocks": catalogue["blocks"],
            "targets": {name: {**asdict(TARGETS[name]), "unusable": unusable[name]} for name in targets},
            "rows": ordered, "best": best_tiles(ordered, catalogue) if tiles == "sweep" else None}


def _tile(tile) -> str:
    return "none fits" if tile is None else f"{tile[0]}x{tile[1]}"


def _occupancy(row: dict) -> str:
    return "-" if row["occupancy"] is None else f"{row['occupancy']}/{TARGETS[row['target']].max_warps}"


COLUMNS = (column("kernel", "<26", "kernel"), column("target", "<8", "target"), column("tile", "<9", "tile"),
           column("compiles", ">9", "compiles"), column("registers", ">10", "registers"),
           column("spilled B", ">10", "spill_bytes"), column("shared B", ">9", "shared_bytes"),
           column("warps/SM", ">9", "warps_per_sm"), column("", ">2", "mark"), column("", "<0", "problems"))


def format_table(report: dict) -> str:
    blocks = ", ".join(f"{inputs} inputs: {blocks}" for inputs, blocks in report["blocks"].items())
    lines = [f"Triton {report['triton']}: each kernel compiled for each target ({report['flags']} flags; aligned and "
             f"unaligned launches; int64 and int32 token ids where read), the worst of its compiles per row; blocks "
             f"of logits: {blocks}; * a tile the ops launch", header_line(COLUMNS)]
    for row in report["rows"]:
        registers = f"{row['registers']}" + (f"+{row['sgprs']}s" if "sgprs" in row else "")
        shown = {**row, "tile": f"{row['tokens']}x{row['vocab']}", "registers": registers if not row["errors"] else "-",
                 "warps_per_sm": _occupancy(row), "mark": "*" if row["default"] else "",
                 "compiles": f"{row['compiles'] - len(row['errors'])}/{row['compiles']}",
                 "problems": "".join(f"  {problem}" for problem in row["problems"][:1]) + "".join(
                     f"; {problem}" for problem in row["problems"][1:])}
        lines.append(row_line(COLUMNS, shown).rstrip())
    for name, target in report["targets"].items():
        if target["unusable"]:
            lines.append(f"{name} ({target['chips']}): not compiled, this Triton cannot target it: "
                         f"{target['unusable']}")
    for table, by_target in (report["best"] or {}).items():
        tiles = list(next(iter(by_target.values()))["warps_per_sm"])
        lines += ["", f"{table}: the fewest warps per SM its kernels leave resident at each tile (- where one spills "
                      "or does not fit); the best: the most, then the largest",
                  f"{'target':<8}" + "".join(f"{tile:>8}" for tile in tiles) + f"{'best':>8}{'now':>8}"]
        for target, best in by_target.items():
            lines.append(f"{target:<8}" + "".join(f"{best['warps_per_sm'].get(tile) or '-'!s:>8}" for tile in tiles)
                         + f"{_tile(best['tile']):>8}{_tile(best['now']):>8}")
    failed = [row for row in report["rows"] if row["default"] and row["problems"]]
    lines.append(f"{len(failed)} tile(s) the ops launch unfit" + (": " + ", ".join(
        f"{row['kernel']} {row['target']} {row['tokens']}x{row['vocab']}" for row in failed) if failed else ""))
    return "\n".join(lines)


def add_parser(targets) -> None:
    parser = benchmark_parser(
        targets, "compile", "the Triton kernels compiled for each GPU: registers, spills, shared memory, occupancy",
        "Every Triton kernel of the fused ops compiled ahead of time (no GPU needed) for NVIDIA sm_80 (A100), sm_90 "
        "(H100, H200), sm_100 (B200) and sm_120 (RTX 50 series), and AMD gfx942 (MI300) where this Triton can "
        "target it, at the tiles the ops launch on each: one row per kernel, tile and target, with whether it "
        "compiled (or the compiler's error), registers per thread, bytes spilled, shared memory, and the warps per "
        "SM that leaves resident. Exits 1 when a tile the ops launch does not compile, spills or needs more "
        "shared memory than its target has.")
    parser.add_argument("--targets", nargs="+", default=list(TARGETS), metavar="TARGET",
                        help=f"targets to compile for, of {', '.join(TARGETS)} (default: all)")
    parser.add_argument("--tiles", default="default", metavar=choices_metavar(TILE_MODES),
                        help="default: the tiles the ops launch; sweep: also every candidate tile, and the best one "
                             "for each table and target (default: %(default)s)")
    parser.add_argument("--flags", default="heaviest", metavar=choices_metavar(FLAG_MODES),
                        help="heaviest: each kernel with every optional sum kept (its most code); all: every "
                             "combination of its flags (default: %(default)s)")
    parser.add_argument("--jobs", type=int, default=USABLE_CORES,
                        help="compiler processes side by side (default: this machine's usable cores, %(default)s)")
    parser.add_argument("--json", help="write the report here (default: not written)")
    parser.set_defaults(handler=run_cli)


def run_cli(args: argparse.Namespace) -> int:
    require_positive(args, ("jobs",))
    for name, value, allowed in (("targets", args.targets, TARGETS), ("tiles", [args.tiles], TILE_MODES),
                                 ("flags", [args.flags], FLAG_MODES)):
        wrong = [item for item in value if item not in allowed]
        if wrong:
            raise SystemExit(f"--{name}: expected {', '.join(allowed)}, got {wrong[0]!r}")
    require_writable(args, ("json",))
    report = run(args.targets, args.tiles, args.flags, args.jobs)
    write_report(report, args, format_table)
    return 1 if any(row["default"] and row["problems"] for row in report["rows"]) else 0
