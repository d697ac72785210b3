"""One rank of `logitless bench distributed`, run by torchrun: one step (forward and backward) of
`fused_linear_logprobs` on a head sharded on the vocabulary, by each of the ways a sharded model gets it done.

``python -m logitless.bench.distributed_rank OUTPUT.json REPEATS TOKENS HIDDEN VOCAB DTYPE WAY [WAY ...]``

The ways (`WAYS`):

* ``gather``: what TRL and FSDP2 do with a sharded head: the weight is all-gathered whole on every rank, the op runs
  on it, and its gradient is reduce-scattered back to the shards (averaged over the ranks).
* ``vocab_parallel``: logitless on the same DTensor, each rank with its own ``TOKENS`` tokens (FSDP2's layout):
  the hidden states travel, the weight stays a shard.
* ``tensor_parallel``: logitless with the same ``TOKENS`` tokens on every rank (tensor parallelism's layout).

For each way, after a step that warms up, every rank counts the collectives of one step (their kind and the bytes of
their whole tensor: the gathered output, the reduce-scattered input, the all-reduced tensor) and the most bytes of
the tensors the step allocated that it held at once (`bench.allocated.AllocatedPeak`, a count that is the same on
every run), then times ``REPEATS`` steps, each from a barrier; rank 0 writes every rank's numbers to OUTPUT.json.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist

WAYS = ("gather", "vocab_parallel", "tensor_parallel")
KINDS = {"all_gather_into_tensor": "all_gather", "all_gather_single": "all_gather",
         "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_single": "reduce_scatter",
         "all_reduce": "all_reduce"}


@contextlib.contextmanager
def counted_collectives():
    """A list of (kind, bytes of the whole tensor) with one entry per collective run while the context lasts."""
    calls = []
    real = {name: getattr(dist, name) for name in KINDS if hasattr(dist, name)}

    def counting(name):
        def collective(*args, **kwargs):
            tensor = args[1] if KINDS[name] == "reduce_scatter" else args[0]  # the larger of output and input
            calls.append((KINDS[name], tensor.numel() * tensor.element_size()))
            return real[name](*args, **kwargs)
        return collective

    for name in real:
        setattr(dist, name, counting(name))
    try:
        yield calls
    finally:
        for name, function in real.items():
            setattr(dist, name, function)


class GatheredWeight(torch.autograd.Function):
    """A shard (V/P, H) -> the whole weight (V, H), all-gathered; backward reduce-scatters its gradient, averaged
    over the ranks: what ``DTensor.full_tensor(grad_placements=[Partial("avg")])`` and FSDP2's unshard do, through
    the collectives counted here."""

    @staticmethod
    def forward(ctx, shard):
        whole = shard.new_empty((shard.shape[0] * dist.get_world_size(), *shard.shape[1:]))
        dist.all_gather_into_tensor(whole, shard.contiguous())
        return whole

    @staticmethod
    def backward(ctx, grad_whole):
        grad_shard = grad_whole.new_empty((grad_whole.shape[0] // dist.get_world_size(), *grad_whole.shape[1:]))
        dist.reduce_scatter_tensor(grad_shard, grad_whole.contiguous())
        return grad_shard / dist.get_world_size()


def inputs(way: str, tokens: int, hidden_size: int, vocab: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Fresh (this rank's shard of the weight (V/P, H), its hidden states (tokens, H), their target ids (tokens,)):
    each rank's own tokens, or under tensor parallelism the same tokens on every rank."""
    ranks, rank = dist.get_world_size(), dist.get_rank()
    generator = torch.Generator().manual_seed(rank if way != "tensor_parallel" else 0)
    shard = (torch.randn(vocab // ranks, hidden_size, generator=generator) * 0.02).to(dtype).requires_grad_()
    hidden = torch.randn(tokens, hidden_size, generator=generator).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), generator=generator)
    return shard, hidden, targets


def forward_backward(way: str, shard: torch.Tensor, hidden: torch.Tensor, targets: torch.Tensor) -> None:
    """One forward and backward of ``way``: the gradients land in ``shard.grad`` and ``hidden.grad``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from logitless.ops import fused_linear_logprobs

    if way == "gather":
        log_probs = fused_linear_logprobs(hidden, GatheredWeight.apply(shard), targets)
    else:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        weight = DTensor.from_local(shard, mesh, [Shard(0)], run_check=False)
        tokens_in = hidden if way == "vocab_parallel" else DTensor.from_local(hidden, mesh, [Replicate()],
                                                                               run_check=False)
        log_probs = fused_linear_logprobs(tokens_in, weight, targets)
    log_probs.float().sum().backward()
    assert shard.grad is not None and hidden.grad is not None


def measured_step(way: str, *shape) -> dict:
    """One step of ``way`` on fresh inputs -> {collectives, peak_bytes}: its collectives, and the most bytes of the
    tensors it allocated (`AllocatedPeak`: the gradients included, the inputs not) held at once."""
    from logitless.bench.allocated import AllocatedPeak

    step_inputs = inputs(way, *shape)
    with counted_collectives() as calls, AllocatedPeak() as allocated:
        forward_backward(way, *step_inputs)
    return {"collectives": calls, "peak_bytes": allocated.peak_bytes}


def step_seconds(way: str, *shape) -> float:
    """Wall time of one step of ``way`` on fresh inputs, from a barrier that every rank leaves together."""
    step_inputs = inputs(way, *shape)
    dist.barrier()
    started = time.perf_counter()
    forward_backward(way, *step_inputs)
    return time.perf_counter() - started


def main(output: str, repeats: int, tokens: int, hidden_size: int, vocab: int, dtype_name: str,
         ways: list[str]) -> None:
    dist.init_process_group("gloo")
    shape = (tokens, hidden_size, vocab, getattr(torch, dtype_name))
    results = {}
    for way in ways:
        step_seconds(way, *shape)  # warm-up: the first step also loads the code
        dist.barrier()
        mine = {**measured_step(way, *shape), "seconds": [step_seconds(way, *shape) for _ in range(repeats)]}
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        results[way] = everyone
    if dist.get_rank() == 0:
        with open(output, "w") as file:
            json.dump(results, file)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    main(sys.argv[1], *map(int, sys.argv[2:6]), sys.argv[6], sys.argv[7:])
    os._exit(0)  # gloo can abort at interpreter exit after a clean run
