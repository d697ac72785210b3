"""logitless's fused LM head under FSDP2 (fully_shard), 2 CPU processes with gloo, against one process.

The head alone, as GRPOTrainerWithLogits installs it, on tied and untied models, with the head in an FSDP unit of
its own or in the root's, and split on the vocabulary by tensor parallelism (``parallelize_module``, the way to
tensor-parallelize on CPU: transformers' own ``DistributedConfig(tp_size=...)`` loads there, but its Trainer refuses
it, accelerate's ParallelismConfig accepting only GPU launches); tests/trl/test_trl_launch.py trains the trainers
themselves on a model sharded with FSDP2."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")

from ports import free_port  # noqa: E402


@pytest.mark.distributed
def test_fsdp2_gradients_and_completion_rows_equal_one_process(tmp_path):
    output = tmp_path / "fsdp.pt"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
                           str((Path(__file__).parents[1] / "helpers" / "fsdp_lm_head.py")), str(output)],
                          capture_output=True, text=True, timeout=600, env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    results = torch.load(output)
    assert results["tied=False,shard_head=True"]["head_was_dtensor"]  # the sharded-head case did shard the head
    # a head logitless reads as shards says nothing; a head FSDP2 gathered first says why, once, with the remedy
    assert results["tied=False,shard_head=True"]["notices"] == []
    [in_root] = results["tied=False,shard_head=False"]["notices"]
    assert "FSDP2 gathered the LM head" in in_root and "fsdp_plan={'lm_head': 'free_full_weight'}" in in_root
    [tied] = results["tied=True,shard_head=False"]["notices"]
    assert "tied to the input embeddings" in tied
    logits_rows = results.pop("sharded_logits")  # rank 0's: 3 rows, while rank 1 had none
    assert logits_rows["shape"] == (3, 6) and logits_rows["error"] < 1e-6
    whole_head, with_grad = logits_rows["refusals"]
    assert whole_head.startswith("head: sharded_logits needs a weight that is a DTensor")
    assert with_grad.startswith("hidden: sharded_logits computes no gradient")
    checks = results.pop("sharded_head_checks")  # a sharded head is checked without running the model's forward
    assert checks["checked class"] == (None, 0) and checks["unchecked class, checked unsharded"] == (None, 0)
    refusal, forwards = checks["unchecked class"]
    assert forwards == 0 and refusal == (
        "model: logitless cannot score UncheckedQwen2 from its hidden states: its head is sharded as a DTensor (FSDP2 "
        "or tensor parallelism), so its own forward, which would gather it, is not run to check the head, and "
        "UncheckedQwen2 is not a class logitless has checked (call logitless.hf_probe.check_head on the model before "
        "it is sharded); the way around")
    tensor_parallel = results.pop("tensor_parallel")
    assert tensor_parallel["head_was_dtensor"] and tensor_parallel["head_grad_is_shard"]
    # tensor parallelism: every rank scores the same tokens, summing dh over the shards; no rows sent to an owner,
    # as FSDP2's sharded head, whose ranks each own their tokens, does (and FSDP2's own gradient reduction)
    assert tensor_parallel["reduce_scatters"] == 0 and results["tied=False,shard_head=True"]["reduce_scatters"] > 0
    worst = max(tensor_parallel["gradient_errors"].items(), key=lambda item: item[1])
    assert worst[1] < 1e-5 and len(tensor_parallel["gradient_errors"]) > 10, worst
    for layout, result in results.items():
        worst = max(result["gradient_errors"].items(), key=lambda item: item[1])
        assert worst[1] < 1e-5, (layout, worst)
        assert "lm_head.weight" in result["gradient_errors"] or "model.embed_tokens.weight" in result["gradient_errors"]
        assert result["row_error"] < 1e-4, layout
        assert result["response_error"] < 1e-4, layout  # get_response_log_probs of the sharded model
        assert result["refusal_with_grad"].startswith("model: an FSDP2 model's log-probs with gradients"), layout

