"""`logitless bench compile`: the Triton kernels compiled ahead of time for GPUs this machine does not have. The tiles
the ops launch compile for sm_90 and sm_80 (and gfx942 where this Triton targets it) without spilling and within
each target's shared memory; a tile known to spill and one that does not compile are reported as such; the
occupancy is CUDA's calculation (and CDNA3's); every kernel the ops launch has a tile on every target."""

import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from logitless.bench.compile import Compilers, fold, new_row, problems, run  # noqa: E402
from logitless.bench.compile_job import FLOAT_SCALARS, LIGHTER_WHEN_SET, Variant, catalogue  # noqa: E402
from logitless.bench.gpu_targets import TARGETS  # noqa: E402
from logitless.ops import triton as kernels  # noqa: E402

LAUNCHED = {kernel.__name__ for launched in kernels.TILED_KERNELS.values() for kernel in launched}


def test_occupancy_is_the_cuda_calculators_and_cdna3s():
    sm_90, sm_120, gfx942 = TARGETS["sm_90"], TARGETS["sm_120"], TARGETS["gfx942"]
    assert sm_90.occupancy(32, 0, 4) == 64  # 1024 registers a warp: the SM's 64 warps
    assert sm_90.occupancy(40, 0, 4) == 48  # 1280 a warp: 51 warps, 12 blocks of 4
    assert sm_90.occupancy(255, 0, 4) == 8  # 8160, allocated 8192 a warp
    assert sm_90.occupancy(256, 0, 4) == 0  # more than a thread may have
    assert sm_120.occupancy(32, 0, 4) == 48  # the 48 warps an sm_120 SM holds
    assert sm_90.occupancy(32, 100 * 1024, 4) == 8  # 100 KiB and the 1 KiB reserved a block: 2 blocks in 228 KiB
    assert sm_90.occupancy(32, 228 * 1024, 4) == 0  # more than a block's 227 KiB
    assert gfx942.occupancy(107, 0, 4, 90) == 16  # 112 VGPRs allocated: 4 waves a SIMD, 4 SIMDs
    assert gfx942.occupancy(56, 0, 4, 106) == 28  # over 100 SGPRs: 7 waves a SIMD
    assert gfx942.occupancy(18, 0, 4, 62) == 32
    assert gfx942.occupancy(18, 40 * 1024, 4, 62) == 4  # one workgroup's LDS a CU


def test_every_kernel_the_ops_launch_has_a_tile_on_every_target_and_is_described():
    jitted = {name for name in dir(kernels) if name.endswith("_kernel")}
    assert LAUNCHED == jitted
    assert set(kernels.STATS_TILES) == set(kernels.GRAD_TILES) == set(TARGETS)
    listed = catalogue()["kernels"]
    arguments = {name for kernel in kernels.TILED_KERNELS.values() for k in kernel for name in k.arg_names}
    assert set(FLOAT_SCALARS) <= arguments  # the scalars compiled as fp32 are the kernels' own
    assert set(LIGHTER_WHEN_SET) <= {flag for kernel in listed.values() for flag in kernel["flags"]}
    assert {name for name, kernel in listed.items() if kernel["reads_ids"]} == {"_update_stats_kernel",
                                                                             "_block_grad_kernel"}
    assert catalogue()["blocks"] == {"float32": "float32", "bfloat16": "float32", "float16": "float32"}


@pytest.mark.parametrize("hip, capability, target", [
    (None, (8, 0), "sm_80"), (None, (8, 6), "sm_80"), (None, (8, 9), "sm_80"), (None, (7, 5), "sm_80"),
    (None, (9, 0), "sm_90"), (None, (10, 3), "sm_100"), (None, (12, 1), "sm_120"), ("6.4", (9, 4), "gfx942")])
def test_a_gpu_runs_the_tiles_of_the_target_at_or_below_its_own(hip, capability, target, monkeypatch):
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert kernels.tile_target(torch.device("cuda")) == target
    assert kernels.device_tiles(torch.device("cuda")) == (kernels.STATS_TILES[target], kernels.GRAD_TILES[target])
    assert kernels.device_tiles(torch.device("cpu")) == kernels.INTERPRETER_TILES


@pytest.mark.slow
def test_the_tiles_the_ops_launch_compile_without_spilling_on_sm_90_sm_80_and_gfx942():
    """Each kernel at the tile the ops launch it with on each target, as aligned and unaligned launches specialize it
    (and with int64 and int32 token ids where it reads them): it compiles, spills nothing, and its shared memory
    fits a block of the target."""
    report = run(["sm_90", "sm_80", "gfx942"], progress=False)
    targets = ["sm_90", "sm_80"] + ([] if report["targets"]["gfx942"]["unusable"] else ["gfx942"])
    assert {(row["kernel"], row["target"]) for row in report["rows"]} == {
        (kernel, target) for kernel in LAUNCHED for target in targets}
    for row in report["rows"]:
        assert row["default"] and row["compiles"] == (4 if row["kernel"] in ("_update_stats_kernel",
                                                                            "_block_grad_kernel") else 2)
        assert row["problems"] == [], (row["kernel"], row["target"], row["tokens"], row["vocab"])
        assert row["occupancy"] >= TARGETS[row["target"]].max_warps // 2


@pytest.mark.slow
def test_a_tile_that_spills_and_one_that_does_not_compile_are_reported():
    """32 x 256 (the interpreter's gradient tile) spills the softmax's gradient kernel on sm_90; a tile 300 columns
    wide is not a power of two, which Triton refuses."""
    with Compilers() as compilers:
        heaviest = tuple(map(tuple, compilers.call(catalogue)["kernels"]["_block_grad_kernel"]["heaviest"]))
        variants = [Variant("_block_grad_kernel", "sm_90", 32, vocab, heaviest, False, "int64") for vocab in (256, 300)]
        results = dict(compilers.compile(variants))
    spilling, refused = (new_row(variant, (1, 1)) for variant in variants)
    fold(spilling, results[variants[0]])
    fold(refused, results[variants[1]])
    assert spilling["spill_bytes"] > 0 and spilling["registers"] == 255
    assert problems(spilling) == [f"spills {spilling['spill_bytes']} bytes"]
    assert len(problems(refused)) == 1 and problems(refused)[0].startswith("does not compile: ")
    assert "power of 2" in problems(refused)[0]


def test_shared_memory_over_a_blocks_is_reported():
    row = {**new_row(Variant("_update_stats_kernel", "sm_120", 1, 128, (), True, "int64"), (1, 128)), "compiles": 1,
           "registers": 40, "shared_bytes": 100 * 1024, "warps": 4, "occupancy": 0}
    assert problems(row) == [f"needs {100 * 1024} bytes of shared memory, over the {99 * 1024} a block may have"]
    assert problems({**row, "target": "sm_90", "occupancy": 8}) == []  # 227 KiB a block there


def test_the_docs_list_the_tiles_each_gpu_runs():
    page = (Path(__file__).parents[2] / "docs" / "fused_ops.md").read_text()
    listed = {target: (stats, grad) for target, stats, grad in
              re.findall(r"^\| (\w+) \| [^|]+ \| (\d+ x \d+) \| (\d+ x \d+) \|$", page, re.MULTILINE)}
    assert listed == {target: tuple(f"{tile.tokens} x {tile.vocab}" for tile in (kernels.STATS_TILES[target],
                                                                                   kernels.GRAD_TILES[target]))
                      for target in TARGETS}
