"""GRPOTrainerWithLogits under DDP: 2 CPU processes with the gloo backend (torchrun), against stock TRL."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")

from ports import free_port  # noqa: E402


@pytest.mark.distributed
def test_two_processes_sync_and_match_stock_trl(tmp_path, tiny_model_dir):
    model_dir = tiny_model_dir
    script = (Path(__file__).parents[1] / "helpers" / "distributed_grpo.py")
    output = str(tmp_path / "rank{rank}.pt")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(script),
                           str(model_dir), output], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = [torch.load(output.format(rank=r)) for r in (0, 1)]
    for saved in ranks:
        assert saved["GRPOTrainerWithLogits"]["world_size"] == 2
        ours, stock = saved["GRPOTrainerWithLogits"], saved["GRPOTrainer"]
        # the first step sees the same weights and completions: same gradient, all-reduced over both ranks
        assert ours["grad_norm"][0].item() == pytest.approx(stock["grad_norm"][0].item(), rel=1e-4)
        torch.testing.assert_close(ours["loss"], stock["loss"], atol=1e-6, rtol=0)
    # DDP kept the replicas identical through GRPOTrainerWithLogits' own forward
    assert torch.equal(ranks[0]["GRPOTrainerWithLogits"]["parameters"], ranks[1]["GRPOTrainerWithLogits"]["parameters"])
