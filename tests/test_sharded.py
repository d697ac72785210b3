"""Every fused op with a head sharded on the vocabulary (a DTensor, Shard(0)), never gathered, on 2 and 4 CPU
processes (torchrun, gloo): tests/sharded_ops.py runs each op and layout against the one-process op, and counts the
collectives each step calls.

The numbers are the one-process op's: each output and gradient's error against the op in fp64 on the same values is
within twice the one-process fp32 op's own (or 1e-6 of its size, whichever is larger), and in bf16 within 1.5 times
the one-process bf16 op's plus fp32's rounding, as tests/test_devices.py judges bf16. No collective moves as much as a
shard of the weight, except where the group's tokens outnumber the vocabulary and the head is gathered on purpose."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_trl_distributed import _free_port

SCRIPT = Path(__file__).with_name("sharded_ops.py")
HIDDEN, VOCAB = 12, 1004  # tests/sharded_ops.py's


@pytest.fixture(scope="module", params=[2, 4], ids=["2-ranks", "4-ranks"])
def report(request, tmp_path_factory) -> dict:
    output = tmp_path_factory.mktemp("sharded") / "report.json"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(request.param),
                           "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), str(SCRIPT), str(output)],
                          capture_output=True, text=True, timeout=900,
                          env=os.environ | {"OMP_NUM_THREADS": "1",
                                            "PYTHONPATH": os.pathsep.join([str(SCRIPT.parent),
                                                                           os.environ.get("PYTHONPATH", "")])})
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(output.read_text())


@pytest.mark.distributed
def test_every_op_and_layout_equals_the_one_process_op(report):
    layouts = {"tensor", "data", "gather"} | ({"2d"} if report["world"] == 4 else set())
    assert {case.split("/")[1] for case in report["cases"]} == layouts
    assert len({case.split("/")[2] for case in report["cases"]}) == 13  # five ops, and every GRPO loss type
    for case, result in report["cases"].items():
        fp32 = case.startswith("float32")
        for index, (error, own) in enumerate(zip(result["errors"], result["one_process_errors"])):
            bound = max(1e-6, 2 * own) if fp32 else 1.5 * own + 2e-6
            assert error <= bound, (case, index, error, own)


@pytest.mark.distributed
def test_no_rank_receives_the_weight_unless_gathering_moves_fewer_bytes(report):
    """Counted, not assumed: every collective a step calls (forward and backward), with the bytes of its output. The
    tensor-parallel, data-parallel and 2-D layouts never gather the DTensor weight and move O(tokens) numbers
    (`logitless bench distributed` measures both at realistic shapes); the gather layout, whose group's tokens
    outnumber the vocabulary, gathers the head."""
    for case, result in report["cases"].items():
        dtype, layout, _ = case.split("/")
        weight_bytes = VOCAB * HIDDEN * (4 if dtype == "float32" else 2)
        # DTensor's own collectives: its gathers (none, unless the head is gathered on purpose); a bias's NaN check
        # reduces a bool over the shards
        redistributions = [c["op"] for c in result["collectives"] if c["op"].startswith("dtensor")
                           and "all_gather" in c["op"]]
        moved = [c["bytes"] for c in result["collectives"] if not c["op"].startswith("dtensor")]
        assert moved and len(moved) <= 12, (case, result["collectives"])
        if layout == "gather":  # the head gathered (DTensor's all-gather), its gradient reduce-scattered back
            assert any("all_gather_into_tensor" in op for op in redistributions), (case, redistributions)
            continue
        assert redistributions == [], case  # the DTensor weight was never gathered: no rank held it whole
        if layout == "2d":  # a shard's gradient (fp32 until it is averaged) over its two replicas, as DDP would
            shard = VOCAB // 2 * HIDDEN * 4
            assert [c["op"] for c in result["collectives"] if (c["bytes"] or 0) >= shard / 2] == ["all_reduce"], case
            assert max(moved) <= shard, (case, result["collectives"])
        else:  # O(tokens) numbers each (this shape's few tokens move about as much as a shard's few rows would)
            assert max(moved) < weight_bytes, (case, result["collectives"])


@pytest.mark.distributed
def test_a_head_that_cannot_be_run_sharded_is_refused_in_one_line_naming_the_argument(report):
    refused = report["refused"]
    assert refused["hidden_dim"].startswith("ValueError: weight: expected a DTensor sharded on its rows (the "
                                            "vocabulary, Shard(0))")
    assert refused["hidden_dim"].endswith("a weight sharded on the hidden dimension would need every logit summed "
                                          "over the ranks")
    assert refused["replicated"] == ("ValueError: weight: a DTensor replicated on every rank (placements "
                                     "(Replicate(),)) holds the whole weight on each: pass weight.to_local(), or "
                                     "shard it on its rows (the vocabulary, Shard(0))")
    assert refused["uneven"].startswith(f"ValueError: weight: its {VOCAB - 1} vocabulary rows do not split evenly "
                                        f"over the {report['world']} ranks")
    assert refused["other_mesh"].startswith("ValueError: hidden: a DTensor on another mesh")
    assert refused["plain_bias"].startswith("ValueError: bias: expected a DTensor sharded as weight is")
    assert refused["no_process_group"].startswith("ValueError: weight: a DTensor needs the process group it was "
                                                  "made in, and none is initialized")
    assert all("\n" not in message for message in refused.values())
