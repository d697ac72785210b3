"""The fused ops on a mesh of CPU devices equal the one-device result: the vocabulary (the weight's rows) sharded over
2 and 4 devices, alone and with the tokens sharded too (explicit axes, per-device folds with nothing gathered), the
batch sharded over an `AxisType.Auto` mesh (XLA partitions the op), and a vocabulary sharded over an Auto mesh given
its layout by `jax.sharding.explicit_axes`.

The device count must be set before jax is imported, so the runs happen in a fresh process (tests/jax_sharded.py)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # every test reads one fresh process's report

N, H = 32, 16  # tests/jax_sharded.py's tokens and hidden size
ROW_STATISTICS = 32 * N * 4  # bytes: a few dozen fp32 numbers per token
DH_PARTIAL = N * H * 4  # bytes: dh's fp32 partial sum over a device's columns, before the vocabulary shards' sum
DW_BLOCK = 2048 // 2 * H * 4  # bytes: one device's fp32 dW block, the default 2048 columns over 2 vocabulary shards


@pytest.fixture(scope="module")
def report() -> dict:
    script = Path(__file__).with_name("jax_sharded.py")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_vocabulary_is_sharded_over_two_and_four_devices(report):
    assert report["devices"] == 4
    assert {result["shards"] for case in report["cases"].values() for result in case["meshes"].values()} == {2, 4}


@pytest.mark.parametrize("loss", ["cross_entropy", "grpo", "grpo_sequence", "jsd"])
def test_vocabulary_sharded_equals_one_device_and_gathers_no_weight(report, loss):
    case = report["cases"][loss]
    assert min(case["grad_scales"]) > 1e-5  # real gradients were compared
    for mesh, result in case["meshes"].items():
        assert result["loss_diff"] < 1e-5 and max(result["grad_diffs"]) < 1e-5, mesh
        hidden_spec = "('data', None, None)" if "tokens" in mesh else "(None, None, None)"
        assert result["grad_specs"] == [hidden_spec, "('model', None)", "('model',)"], mesh  # sharded as the inputs
        assert result["all-gather"] == 0 and result["largest_gather"] == 0, mesh  # nothing gathered
        assert result["all-reduce"] > 0, mesh  # the row statistics are combined across the vocabulary shards


@pytest.mark.parametrize("loss", ["cross_entropy", "grpo", "grpo_sequence", "jsd"])
def test_per_device_temporaries_are_the_unsharded_ones_divided_by_the_shards(report, loss):
    """Each device holds its share of a block: the temporaries (bf16 inputs, the two-pass schedule everywhere)
    divide by the shard count, plus the row statistics and dh's fp32 partial sum over the device's columns, which
    is as large as one device's dh (N x H). With the tokens sharded too, the dW block each device sums over its
    tokens before the data-parallel all-reduce divides only by the vocabulary shards, as the weight does."""
    case = report["cases"][loss]
    unsharded = case["unsharded_temp_bytes"]
    for mesh, result in case["meshes"].items():
        extra = DW_BLOCK if mesh.startswith("tokens") else DH_PARTIAL
        assert result["temp_bytes"] <= unsharded / result["shards"] + extra + ROW_STATISTICS, mesh


def test_batch_sharded_over_an_auto_mesh_equals_one_device(report):
    result = report["auto batch over 2"]
    assert result["grad_hidden_devices"] == 2
    assert result["loss_diff"] < 1e-6 and max(result["grad_diffs"]) < 1e-6


def test_an_auto_mesh_given_the_layout_by_explicit_axes_gathers_no_weight(report):
    result = report["auto vocab over 4, explicit_axes"]
    assert result["all-gather"] == 0 and result["largest_gather"] == 0
    assert result["loss_diff"] < 1e-5 and max(result["grad_diffs"]) < 1e-5
