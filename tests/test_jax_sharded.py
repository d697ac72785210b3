"""fused_grpo_loss with the batch sharded over two CPU devices (jax.sharding, Auto and Explicit mesh axes)
equals the one-device result.

The device count must be set before jax is imported, so the check runs in a fresh process."""

import json
import subprocess
import sys
from pathlib import Path


def test_batch_sharded_over_two_devices_matches_one_device():
    script = Path(__file__).with_name("jax_sharded.py")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["devices"] == 2 and report["loss"] != 0.0
    assert min(report["grad_scales"]) > 1e-3  # real gradients were compared
    for mode in ("AxisType.Auto", "AxisType.Explicit"):
        result = report[mode]
        assert result["hidden_shards"] == 2 and result["grad_hidden_devices"] == 2, mode
        assert result["loss_diff"] < 1e-6, mode
        assert max(result["grad_diffs"]) < 1e-6, mode  # the weight's gradient is summed over both devices
        assert max(result["metric_diffs"].values()) < 1e-6, mode
