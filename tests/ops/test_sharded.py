"""Every fused op with a head sharded on the vocabulary (a DTensor, Shard(0)), never gathered, on 2 and 4 CPU
processes (torchrun, gloo): tests/helpers/sharded_ops.py runs each op and layout against the one-process op, and
counts the collectives each step calls; then random cases over every option (tests/helpers/sharded_random.py), on
every rank.

The numbers are the one-process op's: each output and gradient's error against the op in fp64 on the same values is
within twice the one-process fp32 op's own (or 1e-6 of its size, whichever is larger), and in bf16 within 1.5 times
the one-process bf16 op's plus fp32's rounding, as tests/ops/test_devices.py judges bf16. No collective moves as much
as a shard of the weight, except where the group's tokens outnumber the vocabulary and the head is gathered on
purpose."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from logitless.op_settings import GRPO_LOSS_TYPES
from sharded_random import KINDS
from ports import free_port

SCRIPT = (Path(__file__).parents[1] / "helpers" / "sharded_ops.py")
HIDDEN, VOCAB = 12, 1004  # tests/helpers/sharded_ops.py's


@pytest.fixture(scope="module", params=[2, 4], ids=["2-ranks", "4-ranks"])
def report(request, tmp_path_factory) -> dict:
    output = tmp_path_factory.mktemp("sharded") / "report.json"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(request.param),
                           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(SCRIPT), str(output)],
                          capture_output=True, text=True, timeout=900,
                          env=os.environ | {"OMP_NUM_THREADS": "1",
                                            "PYTHONPATH": os.pathsep.join([str(SCRIPT.parent),
                                                                           os.environ.get("PYTHONPATH", "")])})
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(output.read_text())


def fp32_bound(own: float) -> float:
    return max(1e-6, 2 * own)


def bf16_bound(own: float) -> float:
    return 1.5 * own + 2e-6


def random_bound(own: float) -> float:
    """The random cases reach the tails of fp32's rounding (small KLs of two near-uniform heads, vespo's exponential
    weight of a sequence's ratio: sums that cancel), where the order of the sums, the shards' merged in turn, can make
    the error several times the one-process op's; a wrong merge is off by far more."""
    return max(1e-5, 4 * own)


def beyond(result: dict, bound) -> list[tuple[int, float, float]]:
    """(index, error, the one-process op's) of each output and gradient of a case whose error exceeds ``bound(the
    one-process op's)``."""
    pairs = enumerate(zip(result["errors"], result["one_process_errors"]))
    return [(index, error, own) for index, (error, own) in pairs if not error <= bound(own)]


@pytest.mark.distributed
def test_every_op_and_layout_equals_the_one_process_op(report):
    layouts = {"tensor", "data", "gather"} | ({"2d"} if report["world"] == 4 else set())
    assert {case.split("/")[1] for case in report["cases"]} == layouts
    assert len({case.split("/")[2] for case in report["cases"]}) == 13  # five ops, and every GRPO loss type
    for case, result in report["cases"].items():
        assert beyond(result, fp32_bound if case.startswith("float32") else bf16_bound) == [], case


@pytest.mark.distributed
def test_random_cases_equal_the_one_process_op_on_every_rank(report):
    """tests/helpers/sharded_random.py's cases in fp32, drawn by hypothesis over every option:
    LOGITLESS_SHARDED_EXAMPLES draws (4 unless set), each a case of every op, GRPO loss type and kind of JSD. On every
    rank (its tokens, its shard of the head) none raises, and each output and gradient is within `random_bound`."""
    drawn = [result["case"] for result in report["random"]]
    assert len(drawn) == len(KINDS) * int(os.environ.get("LOGITLESS_SHARDED_EXAMPLES", 4))
    # what the draw must hold, checked as hypothesis draws it
    assert {case["layout"] for case in drawn} == {"tensor", "data"} | ({"2d"} if report["world"] == 4 else set())
    assert {(case["op"], case.get("loss_type")) for case in drawn} == {
        ("logprobs", None), ("cross_entropy", None), ("kl", None), ("jsd", None),
        *(("grpo", loss_type) for loss_type in GRPO_LOSS_TYPES)}
    betas = {case["beta"] for case in drawn if case["op"] == "jsd"}
    assert {0.0, 1.0} < betas, betas  # the forward and the reverse KL, and mixtures
    assert any(len(set(case["sequences"])) > 1 for case in drawn)  # uneven tokens per rank
    assert any(case["masked_part"] is not None and len(case["sequences"]) > 1 for case in drawn)
    assert any(case["layout"] == "data" and sum(case["sequences"]) * case["seq"] > case["vocab"]
               for case in drawn)  # data-parallel with more tokens than the vocabulary: the head gathered
    options = ("bias", "entropy", "teacher_bias", "teacher_sharded", "old_log_probs", "importance_sampling_level",
               "softcap", "block_sizes", "label_smoothing", "kl_beta", "kept")
    for name in options:  # each option on and off, or two of its values
        assert len({str(case[name]) if name in ("kept", "importance_sampling_level") else bool(case[name])
                    for case in drawn if name in case}) > 1, name
    failures = []
    for result in report["random"]:
        ranks_of = {}  # what went wrong -> the ranks where it did
        for rank, outcome in enumerate(result["ranks"]):
            wrong = (f"raised {outcome['raised']}" if "raised" in outcome else
                     "(output or gradient, error, one process's) " + str(beyond(outcome, random_bound)))
            if "raised" in outcome or beyond(outcome, random_bound):
                ranks_of.setdefault(wrong, []).append(rank)
        failures += [f"{result['case']}\n  ranks {ranks} {wrong}" for wrong, ranks in ranks_of.items()]
    assert failures == [], f"{len(failures)} failures in {len(drawn)} cases:\n" + "\n".join(failures)


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
