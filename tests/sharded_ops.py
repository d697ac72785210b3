"""Run by tests/test_sharded.py under torchrun (2 or 4 CPU processes, gloo): every fused op with its weight (and bias) a
DTensor sharded on the vocabulary, against the same op in one process on the whole weight.

Layouts: "tensor" (the same tokens on every rank: tensor parallelism), "data" (each rank its own tokens: FSDP2),
"gather" (data-parallel, where the group's tokens outnumber the vocabulary's rows, so the head is gathered) and
with 4 ranks "2d" (a 2 x 2 mesh, tokens sharded over "data", the vocabulary over "tensor"). The one-process
reference sees every rank's tokens: its outputs are the rows each rank owns, its hidden-state gradient theirs, and
its weight gradient the mean over the ranks that hold different tokens of their losses' gradients (as FSDP2 and DDP
average every gradient). Every collective a sharded step calls is counted with the bytes it moves.

Rank 0 writes a JSON report: per case (dtype/layout/op) the error of each output and gradient against the one-process
op in fp64 on the same values, the one-process op's own error in the case's dtype beside it, and the collectives."""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

from fused_cases import HEADS, OPS, TRAINED, case_inputs
from logitless import fused_grpo_loss, fused_linear_logprobs
from logitless.ops.settings import GRPO_LOSS_TYPES

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


def reference(case, inputs: dict, parts: list[slice]) -> tuple[list[list[torch.Tensor]], list[torch.Tensor]]:
    """The op in one process on the whole weight, each part of the tokens (a rank's, or all) a call of its own: (each
    part's outputs, [the hidden states' gradient of each part's own loss, the weight's and the bias's gradients of
    the parts' mean loss])."""
    x = {name: _leaf(value, name in TRAINED) if value.is_floating_point() else value for name, value in inputs.items()}
    outputs, losses = [], []
    for rows in parts:
        part = {name: value[rows] if name not in ("weight", "bias", "weight_q") else value
                for name, value in x.items()}
        part["upstream"] = x["upstream"][:, rows]
        got, loss = case(part, impl="chunked")
        outputs.append([output.detach() for output in got])
        losses.append(loss)
    torch.stack(losses).mean().backward()
    return outputs, [x["hidden"].grad * len(parts), x["weight"].grad, x["bias"].grad]


def sharded(case, inputs: dict, mesh, vocab_dim: int, own_rows: slice, tokens: str) -> list[torch.Tensor]:
    """The op with the weight and bias sharded on the vocabulary over ``mesh`` dimension ``vocab_dim``; the hidden
    states this rank's rows (``own_rows``), a DTensor where ``tokens`` says how they are laid out."""
    placements = [Replicate()] * mesh.ndim
    placements[vocab_dim] = Shard(0)
    weight = distribute_tensor(inputs["weight"], mesh, placements).requires_grad_()
    bias = distribute_tensor(inputs["bias"], mesh, placements).requires_grad_()
    x = {name: value[own_rows] if name not in ("weight", "bias", "weight_q") else value
         for name, value in inputs.items()}
    x["upstream"] = inputs["upstream"][:, own_rows]
    local_hidden = _leaf(x["hidden"], True)
    if tokens == "tensor":
        hidden = DTensor.from_local(local_hidden, mesh, [Replicate()] * mesh.ndim)
    elif tokens == "2d":
        hidden = DTensor.from_local(local_hidden, mesh, [Shard(0), Replicate()])
    else:
        hidden = local_hidden
    x.update(hidden=hidden, weight=weight, bias=bias)
    LOG.clear()
    with CommDebugMode() as dtensor_collectives:  # what a DTensor redistribution (a gather of the head) calls
        outputs, loss = case(x)
        loss.backward()
    LOG.extend({"op": f"dtensor {op}", "bytes": None} for op, count in dtensor_collectives.get_comm_counts().items()
               for _ in range(count) if "c10d_functional" in str(op))  # a redistribution's, not the op's own
    outputs = [output.to_local() if isinstance(output, DTensor) else output for output in outputs]
    return [*outputs, local_hidden.grad, weight.grad.to_local(), bias.grad.to_local()], list(LOG)


def errors(got: list[torch.Tensor], want: list[torch.Tensor]) -> list[float]:
    """Each tensor's error relative to the reference's size: ||got - want|| / ||want||."""
    return [((g.detach().double() - w.detach().double()).norm() / w.detach().double().norm().clamp_min(1e-30)).item()
            if w.numel() else 0.0 for g, w in zip(got, want)]


def main(output_path: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    _count_collectives()
    report = {"world": world, "cases": {}}
    layouts = ["tensor", "data", "gather"] + (["2d"] if world == 4 else [])
    for dtype, layout in [(dtype, layout) for dtype in (torch.float32, torch.bfloat16) for layout in layouts]:
        data_ranks = {"tensor": 1, "data": world, "gather": world, "2d": 2}[layout]
        mesh = (init_device_mesh("cpu", (2, 2), mesh_dim_names=("data", "tensor")) if layout == "2d"
                else init_device_mesh("cpu", (world,), mesh_dim_names=("vocab",)))
        vocab_dim = mesh.ndim - 1
        seq = 400 if layout == "gather" else SEQ  # 2 x 400 x world tokens, 4 in 5 kept, > V: gathering moves less
        inputs = {name: value.to(dtype if name in HEADS else torch.float32) if value.is_floating_point() else value
                  for name, value in case_inputs(2 * data_ranks, seq, HIDDEN, VOCAB, seed=7).items()}
        exact_inputs = {name: value.double() if value.is_floating_point() else value  # the same values, in fp64
                        for name, value in inputs.items()}
        data_rank = mesh.get_local_rank(0) if layout == "2d" else (rank if data_ranks > 1 else 0)
        parts = [slice(2 * r, 2 * (r + 1)) for r in range(data_ranks)]  # each part: 2 sequences
        local = VOCAB // mesh.size(vocab_dim)
        vocab_rows = slice(mesh.get_local_rank(vocab_dim) * local, (mesh.get_local_rank(vocab_dim) + 1) * local)

        def this_ranks(reference_run):
            """A one-process run's share of this rank: its tokens' outputs and rows, its rows of the vocabulary."""
            outputs, (grad_hidden, grad_weight, grad_bias) = reference_run
            return [*outputs[data_rank], grad_hidden[parts[data_rank]], grad_weight[vocab_rows], grad_bias[vocab_rows]]

        for name, case in CASES.items():
            exact = this_ranks(reference(case, exact_inputs, parts))
            one_process = this_ranks(reference(case, inputs, parts))
            got, log = sharded(case, inputs, mesh, vocab_dim, parts[data_rank], layout)
            report["cases"][f"{str(dtype)[6:]}/{layout}/{name}"] = {
                "errors": errors(got, exact), "one_process_errors": errors(one_process, exact), "collectives": log}
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
