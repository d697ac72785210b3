"""The fused ops on a mesh of CPU devices equal the one-device result: the vocabulary (the weight's rows) sharded over
2 and 4 devices, alone and with the tokens sharded too, with nothing gathered and each device holding its share of
the temporaries, on meshes whose axes are `AxisType.Explicit` (the op reads the layout from the arrays' types and
runs under `jax.shard_map`) and `AxisType.Auto` (the layout given to `jax.jit`, which XLA hands the op when it
partitions the program, with Shardy or GSPMD); and the batch alone sharded over an Auto mesh.

The device count must be set before jax is imported, so the runs happen in a fresh process
(tests/helpers/jax_sharded.py)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.slow,  # every test reads one fresh process's report
              pytest.mark.jax_alone]  # `make test` runs this file's tests in its JAX-only environment

N, H, V = 32, 16, 16384  # tests/helpers/jax_sharded.py's tokens, hidden size and vocabulary
ROW_STATISTICS = 32 * N * 4  # bytes: a few dozen fp32 numbers per token
DH_PARTIAL = N * H * 4  # bytes: dh's fp32 partial sum over a device's columns, before the vocabulary shards' sum
DW_BLOCK = 2048 // 2 * H * 4  # bytes: one device's fp32 dW block, the default 2048 columns over 2 vocabulary shards
LOSSES = ["cross_entropy", "grpo", "grpo_sequence", "jsd"]
KINDS = ["explicit", "auto"]  # the mesh's axis types


def fp32_tolerance(scale: float) -> float:
    """How far two fp32 runs of a sum over the vocabulary may differ when they add its V terms in another order
    (the devices' shards, then across them): V roundings of an fp32 ulp of ``scale`` (the value's magnitude),
    random in sign, which grow as sqrt(V) ulps."""
    return float(np.finfo(np.float32).eps) * math.sqrt(V) * scale


@pytest.fixture(scope="module")
def report() -> dict:
    script = (Path(__file__).parents[1] / "helpers" / "jax_sharded.py")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_vocabulary_is_sharded_over_two_and_four_devices_with_both_axis_types(report):
    assert report["devices"] == 4
    for kind in KINDS:
        assert {result["shards"] for case in report["cases"].values() for result in case[kind].values()} == {2, 4}
    assert "tokens over 2, vocab over 2" in report["cases"]["cross_entropy"]["auto"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("loss", LOSSES)
def test_vocabulary_sharded_equals_one_device_and_gathers_no_weight(report, loss, kind):
    case = report["cases"][loss]
    assert min(case["grad_scales"]) > 1e-5  # real gradients were compared
    for mesh, result in case[kind].items():
        assert result["loss_diff"] <= fp32_tolerance(abs(case["loss"])), mesh
        assert all(diff <= fp32_tolerance(scale) for diff, scale in zip(result["grad_diffs"], case["grad_scales"])), \
            (mesh, result["grad_diffs"])
        hidden_spec = "('data', None, None)" if "tokens" in mesh else "(None, None, None)"
        assert result["grad_specs"] == [hidden_spec, "('model', None)", "('model',)"], mesh  # sharded as the inputs
        assert result["all-gather"] == 0 and result["largest_gather"] == 0, mesh  # nothing gathered
        assert result["all-reduce"] > 0, mesh  # the row statistics are combined across the vocabulary shards


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("loss", LOSSES)
def test_per_device_temporaries_are_the_unsharded_ones_divided_by_the_shards(report, loss, kind):
    """Each device holds its share of a block: the temporaries (bf16 inputs, the two-pass schedule everywhere)
    divide by the shard count, plus the row statistics and dh's fp32 partial sum over the device's columns, which
    is as large as one device's dh (N x H). With the tokens sharded too, the dW block each device sums over its
    tokens before the data-parallel all-reduce divides only by the vocabulary shards, as the weight does."""
    case = report["cases"][loss]
    unsharded = case["unsharded_temp_bytes"]
    for mesh, result in case[kind].items():
        extra = DW_BLOCK if mesh.startswith("tokens") else DH_PARTIAL
        assert result["temp_bytes"] <= unsharded / result["shards"] + extra + ROW_STATISTICS, mesh


def test_batch_sharded_over_an_auto_mesh_equals_one_device(report):
    result, case = report["auto batch over 2"], report["cases"]["grpo"]
    assert result["grad_hidden_devices"] == 2
    assert result["loss_diff"] <= fp32_tolerance(abs(case["loss"]))
    assert all(diff <= fp32_tolerance(scale) for diff, scale in zip(result["grad_diffs"], case["grad_scales"]))


def test_gspmd_partitions_an_auto_mesh_as_shardy_does(report):
    result, case = report["auto vocab over 4, GSPMD"], report["cases"]["cross_entropy"]
    assert result["all-gather"] == 0 and result["largest_gather"] == 0 and result["all-reduce"] > 0
    assert result["loss_diff"] <= fp32_tolerance(abs(case["loss"]))
    assert all(diff <= fp32_tolerance(scale) for diff, scale in zip(result["grad_diffs"], case["grad_scales"]))
