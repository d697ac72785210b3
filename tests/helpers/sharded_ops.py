"""Run by tests/ops/test_sharded.py under torchrun (2 or 4 CPU processes, gloo): every fused op with its weight (and
bias) a DTensor sharded on the vocabulary, against the same op in one process on the whole weight.

Layouts: "tensor" (the same tokens on every rank: tensor parallelism), "data" (each rank its own tokens: FSDP2),
"gather" (data-parallel, where the group's tokens outnumber the vocabulary's rows, so the head is gathered) and
with 4 ranks "2d" (a 2 x 2 mesh, tokens sharded over "data", the vocabulary over "tensor"). The one-process
reference sees every rank's tokens: its outputs are the rows each rank owns, its hidden-state gradient theirs, and
its weight gradient the mean over the ranks that hold different tokens of their losses' gradients (as FSDP2 and DDP
average every gradient). Every collective a sharded step calls is counted with the bytes it moves.

Then tests/helpers/sharded_random.py's cases, random over every option, fp32: rank 0 draws them with hypothesis and
hands them to the others, and every rank runs each case and reports its own errors.

Rank 0 writes a JSON report: per case (dtype/layout/op) the error of each output and gradient against the one-process
op in fp64 on the same values, the one-process op's own error in the case's dtype beside it, and the collectives; per
random case its options and each rank's errors (or what the case raised there)."""

import json
import math
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

from fused_cases import HEADS, OPS, TRAINED, case_inputs
from sharded_random import case_inputs_of, case_op, drawn_cases, part_rows
from logitless import fused_grpo_loss, fused_linear_logprobs
from logitless.op_settings import GRPO_LOSS_TYPES

SEQ, HIDDEN, VOCAB = 7, 12, 1004  # V divisible by 2 and 4; the teacher (hidden_q) is 10 wide
COLLECTIVES = ("all_gather_single", "reduce_scatter_single", "all_gather_into_tensor", "reduce_scatter_tensor",
               "all_reduce", "all_gather", "broadcast", "all_to_all")
LOG: list[dict] = []


def _count_collectives():
    """Wrap torch.distributed's collectives so that each call is logged with the bytes of its output."""
    for name in COLLECTIVES:
        real = getattr(dist, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            output = args[0]
            tensors = output if isinstance(output, list) else [output]
            LOG.append({"op": _name, "bytes": sum(t.numel() * t.element_size() for t in tensors)})
            return _real(*args, **kwargs)

        setattr(dist, name, counted)


def grpo_case(loss_type):
    def grpo(x, **options):
        loss, _ = fused_grpo_loss(x["hidden"], x["weight"], x["targets"], x["mask"], x["advantages"], bias=x["bias"],
                                  old_log_probs=x["old_log_probs"], ref_log_probs=x["ref_log_probs"], beta=0.04,
                                  loss_type=loss_type, max_completion_length=SEQ, **options)
        return [loss], loss
    return grpo


CASES = {**OPS, **{f"grpo_{loss_type}": grpo_case(loss_type) for loss_type in GRPO_LOSS_TYPES}}


def _leaf(tensor, requires_grad):
    return tensor.detach().clone().requires_grad_(requires_grad)


WHOLE = ("weight", "bias", "weight_q", "bias_q")  # the heads' tensors; the others have a row per sequence


def _rows(inputs: dict, rows: slice) -> dict:
    """The inputs of the sequences ``rows``: their rows of the per-sequence tensors, the heads whole."""
    part = {name: value if name in WHOLE else value[rows] for name, value in inputs.items()}
    part["upstream"] = inputs["upstream"][:, rows]
    return part


def _grads(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's gradient, 0 where none reached it (a loss over no tokens)."""
    return [torch.zeros_like(tensor) if tensor.grad is None else tensor.grad for tensor in tensors]


def reference(case, inputs: dict, parts: list[slice]) -> tuple[list[list[torch.Tensor]], list[torch.Tensor]]:
    """The op in one process on the whole weight, each part of the tokens (a rank's, or all) a call of its own: (each
    part's outputs, [the hidden states' gradient of each part's own loss, the weight's and the bias's (where there is
    one) gradients of the parts' mean loss])."""
    x = {name: _leaf(value, name in TRAINED) if value.is_floating_point() else value for name, value in inputs.items()}
    outputs, losses = [], []
    for rows in parts:
        got, loss = case(_rows(x, rows), impl="chunked")
        outputs.append([output.detach() for output in got])
        losses.append(loss)
    mean_loss = torch.stack(losses).mean()
    if mean_loss.requires_grad:
        mean_loss.backward()
    grad_hidden, *grad_head = _grads([x[name] for name in TRAINED if name in x])
    return outputs, [grad_hidden * len(parts), *grad_head]


def sharded(case, inputs: dict, mesh, vocab_dim: int, own_rows: slice, tokens: str,
            sharded_heads: tuple[str, ...] = ("weight", "bias")) -> tuple[list[torch.Tensor], list[dict]]:
    """The op with the tensors ``sharded_heads`` (those of them the inputs hold) sharded on the vocabulary over
    ``mesh`` dimension ``vocab_dim``; the hidden states this rank's rows (``own_rows``), a DTensor where ``tokens``
    says how they are laid out. Returns (the outputs and the gradients of hidden, weight and bias, the collectives)."""
    placements = [Replicate()] * mesh.ndim
    placements[vocab_dim] = Shard(0)
    x = _rows(inputs, own_rows)
    for name in sharded_heads:
        if name in x:
            x[name] = distribute_tensor(inputs[name], mesh, placements).requires_grad_(name in TRAINED)
    local_hidden = _leaf(x["hidden"], True)
    if tokens == "tensor":
        x["hidden"] = DTensor.from_local(local_hidden, mesh, [Replicate()] * mesh.ndim)
    elif tokens == "2d":
        x["hidden"] = DTensor.from_local(local_hidden, mesh, [Shard(0), Replicate()])
    else:
        x["hidden"] = local_hidden
    LOG.clear()
    with CommDebugMode() as dtensor_collectives:  # what a DTensor redistribution (a gather of the head) calls
        outputs, loss = case(x)
        loss.backward()
    LOG.extend({"op": f"dtensor {op}", "bytes": None} for op, count in dtensor_collectives.get_comm_counts().items()
               for _ in range(count) if "c10d_functional" in str(op))  # a redistribution's, not the op's own
    outputs = [output.to_local() if isinstance(output, DTensor) else output for output in outputs]
    grad_hidden, *grad_head = _grads([local_hidden, *(x[name] for name in TRAINED[1:] if name in x)])
    return [*outputs, grad_hidden, *(grad.to_local() for grad in grad_head)], list(LOG)


def errors(got: list[torch.Tensor], want: list[torch.Tensor]) -> list[float]:
    """Each tensor's error relative to the reference's size, ||got - want|| / ||want||; a NaN (a mean over no tokens)
    where the reference has one counts as equal, anywhere else as an infinite error, and so does another shape."""
    if len(got) != len(want):
        raise ValueError(f"{len(got)} outputs and gradients, the one-process op {len(want)}")
    result = []
    for g, w in zip(got, want):
        g, w = g.detach().double(), w.detach().double()
        if g.shape != w.shape or not torch.equal(g.isnan(), w.isnan()):
            result.append(math.inf)
            continue
        g, w = g.nan_to_num(0.0), w.nan_to_num(0.0)
        result.append(((g - w).norm() / w.norm().clamp_min(1e-30)).item() if w.numel() else 0.0)
    return result


def compare(case, inputs: dict, dtype: torch.dtype, parts: list[slice], mesh, layout: str,
            sharded_heads: tuple[str, ...] = ("weight", "bias")) -> dict:
    """The op on a sharded head against the one-process op, on this rank's share: the error of each output and
    gradient against the one-process op in fp64 on the same values, the one-process op's own error in ``dtype``
    beside it, and the collectives the sharded step called. ``inputs`` in fp64, each part of the tokens (``parts``,
    rows of the batch) a data rank's."""
    inputs = {name: value.to(dtype if name in HEADS else torch.float32) if value.is_floating_point() else value
              for name, value in inputs.items()}
    exact_inputs = {name: value.double() if value.is_floating_point() else value  # the same values, in fp64
                    for name, value in inputs.items()}
    vocab_dim = mesh.ndim - 1
    data_rank = mesh.get_local_rank(0) if layout == "2d" else (dist.get_rank() if len(parts) > 1 else 0)
    local = inputs["weight"].shape[0] // mesh.size(vocab_dim)
    vocab_rows = slice(mesh.get_local_rank(vocab_dim) * local, (mesh.get_local_rank(vocab_dim) + 1) * local)

    def this_ranks(reference_run):
        """A one-process run's share of this rank: its tokens' outputs and rows, its rows of the vocabulary."""
        outputs, (grad_hidden, *grad_head) = reference_run
        return [*outputs[data_rank], grad_hidden[parts[data_rank]], *(grad[vocab_rows] for grad in grad_head)]

    exact = this_ranks(reference(case, exact_inputs, parts))
    one_process = this_ranks(reference(case, inputs, parts))
    got, log = sharded(case, inputs, mesh, vocab_dim, parts[data_rank], layout, sharded_heads)
    return {"errors": errors(got, exact), "one_process_errors": errors(one_process, exact), "collectives": log}


def random_cases(world: int, meshes: dict) -> list[dict]:
    """tests/helpers/sharded_random.py's cases (LOGITLESS_SHARDED_EXAMPLES draws of hypothesis, default 4, each a case
    of every op, GRPO loss type and kind of JSD), drawn by rank 0 and run by every rank: per case its options, and
    each rank's errors as `compare` gives them, or what the case raised there."""
    drawn = [drawn_cases(world, int(os.environ.get("LOGITLESS_SHARDED_EXAMPLES", 4))) if dist.get_rank() == 0
             else None]
    dist.broadcast_object_list(drawn, src=0)
    results = []
    for case in drawn[0]:
        heads = WHOLE if case.get("teacher_sharded") else ("weight", "bias")
        try:
            result = compare(case_op(case), case_inputs_of(case), torch.float32, part_rows(case),
                             meshes[case["layout"]], case["layout"], heads)
            result = {"errors": result["errors"], "one_process_errors": result["one_process_errors"]}
        except Exception as error:  # reported with the case that raised it, on every rank
            frame = traceback.extract_tb(error.__traceback__)[-1]
            result = {"raised": f"{type(error).__name__}: {error} ({Path(frame.filename).name}:{frame.lineno})"}
        ranks = [None] * world
        dist.all_gather_object(ranks, result)
        results.append({"case": case, "ranks": ranks})
    return results


def main(output_path: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    _count_collectives()
    report = {"world": world, "cases": {}}
    whole = init_device_mesh("cpu", (world,), mesh_dim_names=("vocab",))
    meshes = {"tensor": whole, "data": whole, "gather": whole}
    if world == 4:
        meshes["2d"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data", "tensor"))
    for dtype, layout in [(dtype, layout) for dtype in (torch.float32, torch.bfloat16) for layout in meshes]:
        data_ranks = 2 if layout == "2d" else (1 if layout == "tensor" else world)
        seq = 400 if layout == "gather" else SEQ  # 2 x 400 x world tokens, 4 in 5 kept, > V: gathering moves less
        inputs = case_inputs(2 * data_ranks, seq, HIDDEN, VOCAB, seed=7)
        parts = [slice(2 * r, 2 * (r + 1)) for r in range(data_ranks)]  # each part: 2 sequences
        for name, case in CASES.items():
            report["cases"][f"{str(dtype)[6:]}/{layout}/{name}"] = compare(case, inputs, dtype, parts, meshes[layout],
                                                                          layout)
    report["random"] = random_cases(world, meshes)
    report["refused"] = refusals(world)
    dist.barrier()
    dist.destroy_process_group()
    report["refused"]["no_process_group"] = refused(lambda: fused_linear_logprobs(*LATE))  # after the group is gone
    if rank == 0:
        with open(output_path, "w") as handle:
            json.dump(report, handle)
    os._exit(0)  # gloo can abort at interpreter exit after a clean run


LATE = []  # a call's arguments made while the process group lived, tried after it is destroyed


def refused(call) -> str:
    """The error ``call()`` raises, as "TypeName: message"."""
    try:
        call()
    except (TypeError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    return "nothing raised"


def refusals(world: int) -> dict[str, str]:
    """What the ops say of a weight sharded on the hidden dimension, replicated, unevenly, or on another mesh than
    the hidden states'."""
    mesh = init_device_mesh("cpu", (world,))
    other_mesh = init_device_mesh("cpu", (1, world))
    hidden, targets = torch.randn(2, 3, HIDDEN), torch.randint(0, VOCAB, (2, 3))
    weight = torch.randn(VOCAB, HIDDEN)
    LATE.extend([hidden, distribute_tensor(weight, mesh, [Shard(0)]), targets])
    return {
        "hidden_dim": refused(lambda: fused_linear_logprobs(hidden, distribute_tensor(weight, mesh, [Shard(1)]),
                                                            targets)),
        "replicated": refused(lambda: fused_linear_logprobs(hidden, distribute_tensor(weight, mesh, [Replicate()]),
                                                            targets)),
        "uneven": refused(lambda: fused_linear_logprobs(hidden, distribute_tensor(weight[:VOCAB - 1], mesh,
                                                                                  [Shard(0)]), targets)),
        "other_mesh": refused(lambda: fused_linear_logprobs(
            DTensor.from_local(hidden, other_mesh, [Replicate(), Replicate()]),
            distribute_tensor(weight, mesh, [Shard(0)]), targets)),
        "plain_bias": refused(lambda: fused_linear_logprobs(hidden, distribute_tensor(weight, mesh, [Shard(0)]),
                                                            targets, bias=torch.zeros(VOCAB))),
    }


if __name__ == "__main__":
    main(sys.argv[1])
