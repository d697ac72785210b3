"""The Tokamax rows of `logitless bench jax`: the cross-entropy through the LM head, four ways, side by side.

* ``plain``: plain JAX, the ops' ``impl="reference"`` (the whole (N, V) logits, log_softmax, gather).
* ``tokamax_xla``: Tokamax's `linear_softmax_cross_entropy_loss` with ``implementation="xla"``, what it runs by
  default where it has no Pallas kernel (a CPU): the whole logits, as plain JAX.
* ``tokamax_chunked_xla``: ``implementation="chunked_xla"``, token and vocabulary blocks (1024 x 2048 by default)
  in `lax.fori_loop`s; the vocabulary is padded with zero columns to a multiple of the block.
* ``logitless``: `fused_linear_cross_entropy`, ``impl="auto"``.

Tokamax takes the weight as (H, V): its rows get the weight transposed once, outside the step (as a model that
keeps it so), and their weight gradient is transposed back to be compared. Two reductions: ``per_token``
(every implementation's ``reduction="none"``, the per-token losses, summed in the step) and ``mean``. Every token
counts (Tokamax has no ignore index). Each in float32 and bfloat16.

For each, ``jax.jit(jax.value_and_grad(loss, argnums=(hidden, weight)))`` is compiled: its temporaries
(``compiled.memory_analysis()``), its step time (median of the timed repeats, every program of a dtype run in
turn each round so the machine's load hits them alike), where that time goes (the loss alone, without gradient,
timed in the same rounds; the step in units of one (N, H) x (H, V) matmul of the same inputs, "GEMMs") and its
errors against a float64 reference computed in numpy on the same values (the inputs in the row's dtype, upcast),
apart from every implementation measured: the loss's relative error and, for each gradient,
``max|g - g64| / max|g64|``.

Tokamax 0.0.13 and later need Python >= 3.12 and jax >= 0.11.1. Where this interpreter cannot import a Tokamax with
``chunked_xla``, the whole comparison (logitless's and plain JAX's rows with it, on the same jax) runs in a peer
interpreter, ``.venv-tokamax/bin/python`` by default (``make tokamax-env`` makes it), as
``python -m logitless.bench.tokamax --peer SPEC``, which prints its report as one line of JSON.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from logitless.bench.text_table import MB_PER_BYTE, Column, column, header_line, row_line
from logitless.bench.xla_memory import memory_of

IMPLEMENTATIONS = ("plain", "tokamax_xla", "tokamax_chunked_xla", "logitless")
TOKAMAX = ("tokamax_xla", "tokamax_chunked_xla")
REDUCTIONS = ("per_token", "mean")
DTYPES = ("float32", "bfloat16")
PEER_PYTHON = ".venv-tokamax/bin/python"
MAKE_TARGET = "make tokamax-env"
ERROR_FIELDS = ("loss_rel_err", "dhidden_rel_err", "dweight_rel_err")
REFERENCE_CHUNK = 128  # tokens per chunk of the float64 reference's logits


@dataclass
class Comparison:
    """What one run of the Tokamax rows measures: N tokens, hidden size, vocabulary, the dtypes."""

    tokens: int = 512
    hidden: int = 512
    vocab: int = 151936
    dtypes: list[str] = field(default_factory=lambda: list(DTYPES))
    repeats: int = 3
    compile_only: bool = False
    vocab_block: int | None = None  # BlockSizes.vocab of logitless's rows; None: their default

    def label(self) -> str:
        return f"N={self.tokens} H={self.hidden} V={self.vocab}"


def tokamax_unavailable() -> str | None:
    """Why this interpreter cannot run the Tokamax rows (in a few words), or None when it can: Tokamax imports and
    has both implementations."""
    if importlib.util.find_spec("tokamax") is None:
        return f"tokamax is not installed for this Python {platform.python_version()}"
    try:
        import tokamax
        from tokamax._src.ops.linear_softmax_cross_entropy_loss import api
    except Exception as err:  # any failure means: not here
        return f"tokamax does not import here ({type(err).__name__}: {err})"
    missing = [impl for impl in TOKAMAX if impl.removeprefix("tokamax_") not in api.IMPLEMENTATIONS]
    if missing:
        return (f"tokamax {getattr(tokamax, '__version__', '?')} here has no "
                f"{' or '.join(impl.removeprefix('tokamax_') for impl in missing)}")
    return None


def make_inputs(comparison: Comparison, dtype: str) -> dict:
    """hidden (N, H), weight (V, H), its (H, V) copy for Tokamax and targets (N,), in ``dtype``; the same values as
    `logitless bench jax`'s (scale 0.5 and 0.02, seed 0)."""
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    n, h, v = comparison.tokens, comparison.hidden, comparison.vocab
    hidden = jnp.asarray(rng.standard_normal((n, h), np.float32) * 0.5, dtype)
    weight = jnp.asarray(rng.standard_normal((v, h), np.float32) * 0.02, dtype)
    return dict(hidden=hidden, weight=weight, weight_hv=jnp.asarray(weight.T),
                targets=jnp.asarray(rng.integers(0, v, n), jnp.int32))


def _arguments(impl: str, inputs: dict) -> tuple:
    weight = inputs["weight_hv"] if impl in TOKAMAX else inputs["weight"]
    return inputs["hidden"], weight, inputs["targets"]


def _specs(impl: str, comparison: Comparison, dtype: str) -> tuple:
    import jax
    import jax.numpy as jnp

    n, h, v = comparison.tokens, comparison.hidden, comparison.vocab
    return (jax.ShapeDtypeStruct((n, h), dtype), jax.ShapeDtypeStruct((h, v) if impl in TOKAMAX else (v, h), dtype),
            jax.ShapeDtypeStruct((n,), jnp.int32))


def loss_function(impl: str, reduction: str, vocab_block: int | None = None):
    """loss(hidden (N, H), weight ((H, V) for Tokamax, else (V, H)), targets (N,)) -> the scalar loss of ``impl``
    with ``reduction`` (per_token: the per-token losses' sum; mean)."""
    if impl in TOKAMAX:
        import tokamax

        implementation = impl.removeprefix("tokamax_")

        def tokamax_loss(hidden, weight_hv, targets):
            if reduction == "mean":
                return tokamax.linear_softmax_cross_entropy_loss(hidden, targets, weight_hv, reduction="mean",
                                                                 implementation=implementation)
            return tokamax.linear_softmax_cross_entropy_loss(hidden, targets, weight_hv, reduction="none",
                                                             implementation=implementation).sum()
        return tokamax_loss

    from logitless.jax import BlockSizes, fused_linear_cross_entropy

    ops_impl = "auto" if impl == "logitless" else "reference"
    blocks = BlockSizes(vocab=vocab_block) if impl == "logitless" and vocab_block else None

    def loss(hidden, weight, targets):
        if reduction == "mean":
            return fused_linear_cross_entropy(hidden, weight, targets, block_sizes=blocks, impl=ops_impl)
        return fused_linear_cross_entropy(hidden, weight, targets, reduction="none", block_sizes=blocks,
                                          impl=ops_impl).sum()
    return loss


def compile_step(impl: str, reduction: str, comparison: Comparison, dtype: str):
    """The compiled ``value_and_grad`` of the loss with respect to hidden and weight; lowered from specs."""
    import jax

    step = jax.jit(jax.value_and_grad(loss_function(impl, reduction, comparison.vocab_block), argnums=(0, 1)))
    return step.lower(*_specs(impl, comparison, dtype)).compile()


def float64_cross_entropy(hidden, weight, targets, chunk: int = REFERENCE_CHUNK) -> tuple:
    """(the cross-entropy summed over the tokens, its gradients of hidden (N, H) and weight (V, H)), in float64 with
    numpy: hidden (N, H) and weight (V, H) are upcast as they are; the logits are made ``chunk`` tokens at a time."""
    import numpy as np

    hidden, weight = np.asarray(hidden).astype(np.float64), np.asarray(weight).astype(np.float64)
    targets = np.asarray(targets)
    loss, dhidden, dweight = 0.0, np.zeros_like(hidden), np.zeros_like(weight)
    for start in range(0, len(hidden), chunk):
        rows = slice(start, start + chunk)
        logits = hidden[rows] @ weight.T  # (n, V)
        top = logits.max(axis=1, keepdims=True)
        probs = np.exp(logits - top)
        total = probs.sum(axis=1, keepdims=True)
        picked = np.arange(len(logits)), targets[rows]
        loss += float((top[:, 0] + np.log(total[:, 0]) - logits[picked]).sum())
        probs /= total
        probs[picked] -= 1.0  # the logits' gradient
        dhidden[rows] = probs @ weight
        dweight += probs.T @ hidden[rows]
    return loss, dhidden, dweight


def relative_errors(loss, dhidden, dweight, reference) -> dict:
    """The loss's relative error and each gradient's ``max|g - g64| / max|g64|`` against ``reference`` (the loss
    and gradients of hidden (N, H) and weight (V, H), float64)."""
    import numpy as np

    reference_loss, reference_dhidden, reference_dweight = reference

    def gradient_error(value, exact) -> float:
        return float(np.abs(np.asarray(value).astype(np.float64) - exact).max() / np.abs(exact).max())

    return {"loss_rel_err": abs(float(loss) - reference_loss) / abs(reference_loss),
            "dhidden_rel_err": gradient_error(dhidden, reference_dhidden),
            "dweight_rel_err": gradient_error(dweight, reference_dweight)}


def _say(progress: bool, text: str) -> None:
    if progress:
        print(f"bench jax tokamax: {text}", file=sys.stderr, flush=True)


def _timed(compiled, arguments) -> tuple[float, tuple]:
    import jax

    started = time.perf_counter()
    result = jax.block_until_ready(compiled(*arguments))
    return time.perf_counter() - started, result


def _errors(impl: str, reduction: str, result, reference) -> dict:
    loss, (dhidden, dweight) = result
    if impl in TOKAMAX:
        dweight = dweight.T  # (H, V) -> (V, H)
    scale = 1.0 / len(dhidden) if reduction == "mean" else 1.0
    return {"loss": float(loss), "grad_dtype": str(dweight.dtype), **relative_errors(loss, dhidden, dweight,
                                                   tuple(value * scale for value in reference))}


def _one_dtype(comparison: Comparison, dtype: str, progress: bool) -> dict:
    """rows[reduction][impl] of one dtype."""
    rows = {reduction: {} for reduction in REDUCTIONS}
    compiled = {}
    for reduction in REDUCTIONS:
        for impl in IMPLEMENTATIONS:
            started = time.perf_counter()
            compiled[reduction, impl] = compile_step(impl, reduction, comparison, dtype)
            rows[reduction][impl] = {"compile_s": time.perf_counter() - started,
                                     **memory_of(compiled[reduction, impl])}
            _say(progress, f"{dtype} {reduction} {impl}: compiled, "
                           f"{rows[reduction][impl]['temp_size_in_bytes'] / 1e6:,.0f} MB of temporaries")
    if not comparison.compile_only:
        _time_rows(comparison, dtype, compiled, rows, progress)
    for results in rows.values():
        _ratios(results, timed=not comparison.compile_only)
    return rows


def _time_rows(comparison: Comparison, dtype: str, compiled: dict, rows: dict, progress: bool) -> None:
    """Each row's errors (from its warm-up step) and median times: the step, the loss alone (no gradient), and the
    step in units of one (N, H) x (H, V) matmul of the same inputs, all timed in the same rounds."""
    import jax
    import jax.numpy as jnp

    inputs = make_inputs(comparison, dtype)
    started = time.perf_counter()
    reference = float64_cross_entropy(inputs["hidden"], inputs["weight"], inputs["targets"])
    _say(progress, f"{dtype}: float64 reference in {time.perf_counter() - started:.1f} s")
    for (reduction, impl), step in compiled.items():  # the warm-up step, whose results are compared
        rows[reduction][impl].update(_errors(impl, reduction, _timed(step, _arguments(impl, inputs))[1], reference))
    programs = {("step", *key): step for key, step in compiled.items()}
    for reduction, impl in compiled:
        programs["loss", reduction, impl] = jax.jit(loss_function(impl, reduction, comparison.vocab_block)).lower(
            *_specs(impl, comparison, dtype)).compile()
    matmul = jax.jit(lambda hidden, weight: jnp.dot(hidden, weight.T, preferred_element_type=jnp.float32))
    programs["gemm", None, "plain"] = matmul.lower(inputs["hidden"], inputs["weight"]).compile()
    for key, program in programs.items():  # the other programs' warm-up
        if key[0] != "step":
            _timed(program, _arguments(key[2], inputs)[:2 if key[0] == "gemm" else 3])
    times = {key: [] for key in programs}
    for round_ in range(comparison.repeats):
        for key, program in programs.items():  # in turn, so all see the same load
            times[key].append(_timed(program, _arguments(key[2], inputs)[:2 if key[0] == "gemm" else 3])[0])
        _say(progress, f"{dtype}: timed round {round_ + 1} of {comparison.repeats}")
    gemm_s = statistics.median(times["gemm", None, "plain"])
    for reduction, impl in compiled:
        seconds = times["step", reduction, impl]
        rows[reduction][impl].update(time_s=statistics.median(seconds), times_s=seconds,
                                     loss_only_s=statistics.median(times["loss", reduction, impl]), gemm_s=gemm_s,
                                     gemms=statistics.median(seconds) / gemm_s)


def _ratios(results: dict, timed: bool) -> None:
    """Each row's time and temporaries over those of the fastest Tokamax implementation (compile only: the one with
    the fewest temporaries), which each row names."""
    key = "time_s" if timed else "temp_size_in_bytes"
    fastest = min(TOKAMAX, key=lambda impl: results[impl][key])
    for result in results.values():
        result["fastest_tokamax"] = fastest
        result["temp_x_tokamax"] = result["temp_size_in_bytes"] / max(results[fastest]["temp_size_in_bytes"], 1)
        if timed:
            result["time_x_tokamax"] = result["time_s"] / results[fastest]["time_s"]


def compare(comparison: Comparison, progress: bool = True) -> dict:
    """The Tokamax rows, in this interpreter: results[dtype][reduction][impl], with the versions that ran them."""
    import logging

    import jax
    import tokamax

    logging.getLogger("absl").setLevel(logging.ERROR)  # Tokamax warns of every autotuning cache miss
    report = {"ran_in": sys.executable, "python": platform.python_version(), "jax": jax.__version__,
              "tokamax": getattr(tokamax, "__version__", "?"), "backend": jax.default_backend(),
              "device": jax.devices()[0].device_kind, "comparison": asdict(comparison), "results": {}}
    for dtype in comparison.dtypes:
        report["results"][dtype] = _one_dtype(comparison, dtype, progress)
    return report


def peer_environment() -> dict:
    """The environment of the peer interpreter: this logitless's source first on PYTHONPATH, so the peer runs the
    same code (its own jax)."""
    source = str(Path(__file__).resolve().parents[2])  # the folder holding the logitless package
    paths = [source, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return os.environ | {"PYTHONPATH": os.pathsep.join(paths)}


def run_in_peer(peer_python: str, comparison: Comparison) -> dict:
    """The Tokamax rows run by ``peer_python`` (``python -m logitless.bench.tokamax --peer``), its progress passed
    through to stderr; RuntimeError when it fails or prints no report."""
    done = subprocess.run([peer_python, "-m", "logitless.bench.tokamax", "--peer", json.dumps(asdict(comparison))],
                          stdout=subprocess.PIPE, text=True, env=peer_environment())
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{peer_python} exited with status {done.returncode}; its error is above")
    try:
        return json.loads(lines[-1])
    except json.JSONDecodeError:
        raise RuntimeError(f"{peer_python} printed no report as its last line: {lines[-1][:200]!r}") from None


def tokamax_section(comparison: Comparison, peer_python: str = PEER_PYTHON, progress: bool = True) -> dict:
    """The Tokamax rows for `logitless bench jax`'s report: run here when this interpreter has Tokamax, else in
    ``peer_python`` (one line says so), else ``{"skipped": why}`` (one line says how to get it); a peer that fails
    gives ``{"failed": why}``."""
    why_not_here = tokamax_unavailable()
    if why_not_here is None:
        return compare(comparison, progress)
    if shutil.which(peer_python) is None:  # a path, or a name on PATH
        line = (f"bench jax: no Tokamax rows: {why_not_here}, and there is no peer interpreter at {peer_python} "
                f"(`{MAKE_TARGET}` makes one; or --peer-python PATH)")
        print(line, flush=True)
        return {"skipped": line}
    print(f"bench jax: {why_not_here}; the Tokamax comparison (logitless's and plain JAX's rows with it) runs in "
          f"{peer_python}", flush=True)
    try:
        return run_in_peer(peer_python, comparison)
    except (OSError, RuntimeError) as err:
        line = f"bench jax: the Tokamax rows failed in {peer_python}: {err}"
        print(line, flush=True)
        return {"failed": line}


SHORT_DTYPES = {"float32": "f32", "bfloat16": "bf16", "float64": "f64"}
COLUMNS = (column("dtype", "<10", "dtype"), column("reduction", "<11", "reduction"), column("impl", "<21", "impl"),
           column("temp MB", ">9,.0f", "temp_size_in_bytes", MB_PER_BYTE), column("x tkmx", ">8.3f", "temp_x_tokamax"))
TIMED_COLUMNS = (column("time s", ">9.3f", "time_s"), column("x tkmx", ">8.2f", "time_x_tokamax"),
                 column("loss s", ">8.3f", "loss_only_s"), column("GEMMs", ">7.2f", "gemms"),
                 Column("grads", ">6", lambda row: SHORT_DTYPES.get(row["grad_dtype"], row["grad_dtype"])),
                 column("loss err", ">10.1e", "loss_rel_err"), column("dh err", ">9.1e", "dhidden_rel_err"),
                 column("dW err", ">9.1e", "dweight_rel_err"))


def format_table(section: dict) -> str:
    """The Tokamax rows as text: temporaries and time, each over the fastest Tokamax implementation's, where the
    time goes, the gradients' dtype and the errors against float64."""
    if "results" not in section:  # skipped or failed: its one line was printed when it happened
        return ""
    comparison = Comparison(**section["comparison"])
    timed = not comparison.compile_only
    columns = COLUMNS + (TIMED_COLUMNS if timed else ())
    lines = [f"cross-entropy vs Tokamax, value_and_grad(hidden, weight), {comparison.label()}, on {section['backend']} "
             f"({section['device']}): Python {section['python']}, jax {section['jax']}, tokamax {section['tokamax']}",
             header_line(columns)]
    for dtype, by_reduction in section["results"].items():
        for reduction, results in by_reduction.items():
            for impl, r in results.items():
                lines.append(row_line(columns, {**r, "dtype": dtype, "reduction": reduction, "impl": impl}))
    lines.append("x tkmx: over the fastest Tokamax implementation's" + (
        "; loss s: the loss alone, no gradient; GEMMs: the step over one (N, H) x (H, V) matmul's time; grads: the "
        "gradients' dtype" if timed else " (compile only: the one with the fewest temporaries)"))
    return "\n".join(lines)


def _main() -> int:
    parser = argparse.ArgumentParser(description="The Tokamax rows of `logitless bench jax`, in this interpreter; "
                                                 "the report is printed as the last line, JSON.")
    parser.add_argument("--peer", required=True, metavar="SPEC",
                        help="the comparison, as JSON: the fields of Comparison")
    args = parser.parse_args()
    print(json.dumps(compare(Comparison(**json.loads(args.peer)))))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
