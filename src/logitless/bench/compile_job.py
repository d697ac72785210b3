"""One compile of `logitless bench compile`, in a worker process: a Triton kernel of `logitless.ops.triton` compiled
ahead of time for a GPU target this machine need not have, and what the compiler reports of it.

A `Variant` is one kernel at one tile with one set of its flags, specialized as a launch specializes it:
``aligned`` is what Triton makes of a launch on 16-byte aligned tensors whose sizes and strides are multiples of
16 (every pointer and integer argument marked divisible by 16, so loads may be vectorized), unaligned the
opposite; the token ids are int64 or int32 (both are accepted). `compile_variant` returns registers per thread,
bytes spilled and bytes of shared memory: for NVIDIA from ptxas's own report (``-v``, which Triton passes it),
for AMD from the code object's metadata (VGPRs, SGPRs, scratch bytes per lane, which only spilled registers fill
in these kernels).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import warnings
from dataclasses import dataclass

from logitless.bench.gpu_targets import TARGETS

# the kernels' scalar arguments the launches pass as Python floats (Triton's fp32); every other one is an int
FLOAT_SCALARS = ("temperature_over_softcap", "log_student_weight", "log_teacher_weight")
TOKEN_IDS = "targets_ptr"  # the pointer to the token ids; every other pointer is to the fp32 blocks or row vectors
TILE_CONSTANTS = ("BLOCK_TOKENS", "BLOCK_VOCAB")
LIGHTER_WHEN_SET = ("FORWARD_KL",)  # flags whose True value takes the lighter code (every HAS_* adds code)
ID_DTYPES = ("int64", "int32")
TRITON_TYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "int64": "i64", "int32": "i32"}


@dataclass(frozen=True)
class Variant:
    kernel: str  # a @triton.jit kernel of logitless.ops.triton
    target: str  # a name of gpu_targets.TARGETS
    tokens: int  # the tile: BLOCK_TOKENS
    vocab: int  # BLOCK_VOCAB
    flags: tuple[tuple[str, bool], ...]  # the kernel's other constexpr arguments
    aligned: bool
    ids: str | None  # the token ids' dtype, for a kernel that reads them
    blocks: str = "float32"  # the dtype of the blocks of logits and the row vectors


def kernel_flags(kernel) -> tuple[str, ...]:
    """The constexpr arguments of a @triton.jit kernel other than its tile."""
    return tuple(p.name for p in kernel.params if p.is_constexpr and p.name not in TILE_CONSTANTS)


def heaviest_flags(kernel) -> tuple[tuple[str, bool], ...]:
    """Every optional sum kept and every branch the longer one: the flags under which a kernel has the most code."""
    return tuple((name, name not in LIGHTER_WHEN_SET) for name in kernel_flags(kernel))


def reads_token_ids(kernel) -> bool:
    return TOKEN_IDS in kernel.arg_names


def _signature(kernel, variant: Variant) -> tuple[dict, dict, dict]:
    """Triton's (signature, constexprs, attrs) of ``variant``."""
    signature, attrs = {}, {}
    for index, param in enumerate(kernel.params):
        if param.is_constexpr:
            kind = "constexpr"
        elif param.name == TOKEN_IDS:
            kind = "*" + TRITON_TYPES[variant.ids]
        elif param.name.endswith("_ptr"):
            kind = "*" + TRITON_TYPES[variant.blocks]
        else:
            kind = "fp32" if param.name in FLOAT_SCALARS else "i32"
        signature[param.name] = kind
        if variant.aligned and kind not in ("constexpr", "fp32"):
            attrs[(index,)] = [["tt.divisibility", 16]]
    constexprs = dict(variant.flags, BLOCK_TOKENS=variant.tokens, BLOCK_VOCAB=variant.vocab)
    return signature, constexprs, attrs


def start_worker(cache_dir: str) -> None:
    """A worker process's setup: Triton compiles (never interprets: TRITON_INTERPRET is dropped before it is
    imported), always runs its compilers (a cached kernel would have no ptxas report), and caches in ``cache_dir``."""
    os.environ.pop("TRITON_INTERPRET", None)
    warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")
    from triton import knobs

    knobs.cache.dir = cache_dir
    knobs.compilation.always_compile = True
    knobs.nvidia.dump_ptxas_log = True  # printed to stdout, which `compile_variant` reads


def compile_variant(variant: Variant) -> dict:
    """{"registers", "spill_bytes", "shared_bytes", "warps"} of ``variant`` compiled (AMD also "sgprs"), or
    {"error": the compiler's error in one line}."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from logitless.ops import triton as kernels

    kernel = getattr(kernels, variant.kernel)
    target = TARGETS[variant.target]
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            compiled = triton.compile(ASTSource(kernel, *_signature(kernel, variant)),
                                      target=GPUTarget(target.backend, target.arch, target.warp_size))
        usage = _ptxas_usage(printed.getvalue()) if target.backend == "cuda" else _amdgcn_usage(compiled.asm["amdgcn"])
    except Exception as err:  # the compiler's own error, whatever its type
        return {"error": one_line(err)}
    return {**usage, "shared_bytes": compiled.metadata.shared, "warps": compiled.metadata.num_warps}


def one_line(err: Exception) -> str:
    """A compiler error in one line: for an error in the kernel's code, the message of the innermost error Triton
    chained to it; otherwise the first line that says error or fatal (ptxas's own), else the first line."""
    while getattr(err, "error_message", 1) is None and (err.__cause__ or err.__context__) is not None:
        err = err.__cause__ or err.__context__  # Triton's error at a call site, caused by one inside the callee
    message = getattr(err, "error_message", None) or str(err)
    lines = [line.strip() for line in str(message).splitlines() if line.strip()] or [type(err).__name__]
    said = next((line for line in lines if re.search(r"error|fatal", line, re.IGNORECASE)), lines[0])
    return f"{type(err).__name__}: {said}"[:300]


def _number(pattern: str, text: str, source: str) -> int:
    found = re.search(pattern, text)
    if found is None:
        raise RuntimeError(f"{source} did not say {pattern!r}")
    return int(found.group(1))


def _ptxas_usage(log: str) -> dict:
    return {"registers": _number(r"Used (\d+) registers", log, "ptxas -v"),
            "spill_bytes": _number(r"(\d+) bytes spill stores", log, "ptxas -v")}


def _amdgcn_usage(assembly: str) -> dict:
    return {"registers": _number(r"\.vgpr_count:\s+(\d+)", assembly, "the code object"),
            "sgprs": _number(r"\.sgpr_count:\s+(\d+)", assembly, "the code object"),
            "spill_bytes": _number(r"\.private_segment_fixed_size:\s+(\d+)", assembly, "the code object")}


def catalogue() -> dict:
    """What `logitless bench compile` compiles, read from `logitless.ops.triton` in a worker: for each launched
    kernel, its tile table (``STATS_TILES`` or ``GRAD_TILES``) and that table's tile on each target, its flags, the
    flags under which it has the most code, whether it reads token ids; and the dtype of the blocks each input
    dtype's ops hand the kernels."""
    import torch

    from logitless.ops import triton as kernels
    from logitless.ops.head import stat_dtype

    listed = {}
    for table, launched in kernels.TILED_KERNELS.items():
        tiles = getattr(kernels, table)
        for kernel in launched:
            listed[kernel.__name__] = {
                "table": table, "defaults": {target: [tile.tokens, tile.vocab] for target, tile in tiles.items()},
                "flags": list(kernel_flags(kernel)), "heaviest": [list(flag) for flag in heaviest_flags(kernel)],
                "reads_ids": reads_token_ids(kernel)}
    inputs = (torch.float32, torch.bfloat16, torch.float16)
    return {"kernels": listed, "blocks": {str(dtype)[6:]: str(stat_dtype(dtype))[6:] for dtype in inputs}}


def target_unusable(name: str) -> str | None:
    """Why this Triton cannot compile for the target ``name`` (None: it can)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    target = TARGETS[name]
    try:
        make_backend(GPUTarget(target.backend, target.arch, target.warp_size))
    except Exception as err:  # no backend of this Triton takes it
        return one_line(err)
    return None


def triton_version() -> str:
    import triton

    return triton.__version__
