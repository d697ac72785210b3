"""Run by tests/trl/test_trl_fsdp.py under torchrun (2 CPU processes, gloo): logitless's fused LM head, installed as
GRPOTrainerWithLogits installs it, on a model sharded with FSDP2, and on one whose head alone is split by tensor
parallelism, against the same model in one process; `sharded_logits`, each rank's own rows' logits from a head
sharded on the vocabulary, against the whole head's; and the check of a sharded model's head, which does not run it.

Each rank scores its own batch; the single-process reference scores both batches and averages the two losses, as
FSDP2 averages gradients. Rank 0 saves the largest gradient difference of every parameter and the largest
difference between `completion_logits` rows and the reference model's own forward, and the warnings logitless
logged on rank 0 while the sharded model trained (a head FSDP2 gathered before logitless could read it)."""

import contextlib
import copy
import logging
import os
import sys

import torch
import torch.distributed as dist
from head_models import UncheckedQwen2
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

from logitless.hf_probe import UnreadableHead, check_head
from logitless.logprobs import get_response_log_probs
from logitless.models import tiny_qwen2, tiny_qwen2_config
from logitless.ops.head import LinearHead
from logitless.ops.sharded_logits import sharded_logits
from logitless.trl.lm_head import add_logitless_lm_head, detached_head
from logitless.trl.rewards import completion_views

TEMPERATURE = 0.7


def step_loss(model, input_ids, labels, advantages):
    """A GRPO-like loss that differentiates both fused outputs: -A * log p - 0.1 * entropy, mean over tokens."""
    output = model(input_ids=input_ids, labels=labels, fused_lm_head=True)
    mask = output.label_mask
    return -((advantages[:, None] * output.log_probs + 0.1 * output.entropy) * mask).sum() / mask.sum()


def compare(tied: bool, shard_head: bool, rank: int, world: int) -> dict:
    base = tiny_qwen2(seed=0, tie_word_embeddings=tied)
    add_logitless_lm_head(base, TEMPERATURE, outputs=("log_probs", "entropy"))
    generator = torch.Generator().manual_seed(1234)
    input_ids = torch.randint(0, 151646, (world, 2, 9), generator=generator)
    labels = input_ids.clone()
    labels[:, :, :4] = -100  # the prompt: not scored
    advantages = torch.randn(world, 2, generator=generator)

    reference = copy.deepcopy(base)
    sum(step_loss(reference, input_ids[r], labels[r], advantages[r]) for r in range(world)).div(world).backward()
    expected = {name: p.grad for name, p in reference.named_parameters() if p.grad is not None}

    notices = []
    logging.getLogger("logitless.trl.lm_head").addHandler(handler := logging.Handler())
    handler.emit = lambda record: notices.append(record.getMessage())
    model = copy.deepcopy(base)
    for layer in model.model.layers:
        fully_shard(layer)
    if shard_head:  # the head in a unit of its own: its weight is a DTensor when the fused head reads it
        fully_shard(model.lm_head)
    fully_shard(model)
    with counted_reduce_scatters() as reduce_scatters:
        step_loss(model, input_ids[rank], labels[rank], advantages[rank]).backward()
    logging.getLogger("logitless.trl.lm_head").removeHandler(handler)
    # get_response_log_probs on the sharded model: the same per-token log-probs and entropy as one process
    with torch.no_grad():
        mine = get_response_log_probs(model, input_ids[rank], labels[rank], return_token_entropy=True)
        whole = get_response_log_probs(reference, input_ids[rank], labels[rank], return_token_entropy=True)
    response_error = max((mine[key] - whole[key]).abs().max().item() for key in whole)
    try:  # with gradients, FSDP2's hooks would not reduce them: refused
        get_response_log_probs(model, input_ids[rank], labels[rank])
        refusal = None
    except NotImplementedError as error:
        refusal = str(error)
    differences = {}
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        differences[name] = ((grad - expected[name]).abs().max() / expected[name].abs().max()).item()

    # completion_logits under FSDP2: the scored hidden states, the head gathered once, against a plain forward
    kept = []
    viewer = copy.deepcopy(base)
    add_logitless_lm_head(viewer, TEMPERATURE, outputs=("log_probs",), on_hidden=lambda h, m: kept.append(h))
    for layer in viewer.model.layers:
        fully_shard(layer)
    if shard_head:
        fully_shard(viewer.lm_head)
    fully_shard(viewer)
    with torch.no_grad():
        viewer(input_ids=input_ids[rank], labels=labels[rank], fused_lm_head=True)
        completions = [ids[4:].tolist() for ids in input_ids[rank]]  # hidden position t scores token t + 1
        views, _ = completion_views(kept[0][:, 3:], completions, detached_head(viewer, TEMPERATURE))
        own = torch.stack([reference(input_ids=ids[None], fused_lm_head=False).logits[0, 3:-1] for ids in
                           input_ids[rank]]) / TEMPERATURE
    row_error = max((views[i][:] - own[i]).abs().max().item() for i in range(len(views)))
    return {"gradient_errors": differences, "row_error": row_error, "notices": notices,
            "response_error": response_error, "refusal_with_grad": refusal,
            "reduce_scatters": len(reduce_scatters),
            "head_was_dtensor": shard_head and isinstance(viewer.lm_head.weight, DTensor)}


def compare_tensor_parallel(world: int) -> dict:
    """The head alone split on the vocabulary by ``parallelize_module`` (ColwiseParallel), the rest of the model
    replicated, every rank the same batch: the one loss's gradients, the head's gathered from its shards."""
    base = tiny_qwen2(seed=0, tie_word_embeddings=False)
    add_logitless_lm_head(base, TEMPERATURE, outputs=("log_probs", "entropy"))
    generator = torch.Generator().manual_seed(99)
    input_ids = torch.randint(0, 151646, (2, 9), generator=generator)
    labels = input_ids.clone()
    labels[:, :4] = -100
    advantages = torch.randn(2, generator=generator)
    reference = copy.deepcopy(base)
    step_loss(reference, input_ids, labels, advantages).backward()
    model = parallelize_module(copy.deepcopy(base), init_device_mesh("cpu", (world,)), {"lm_head": ColwiseParallel()})
    with counted_reduce_scatters() as reduce_scatters:  # data-parallel tokens send dh rows back to their owners
        step_loss(model, input_ids, labels, advantages).backward()
    differences = {}
    for (name, p), expected in zip(model.named_parameters(), reference.parameters()):
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        differences[name] = ((grad - expected.grad).abs().max() / expected.grad.abs().max()).item()
    return {"gradient_errors": differences, "head_was_dtensor": isinstance(model.lm_head.weight, DTensor),
            "head_grad_is_shard": isinstance(model.lm_head.weight.grad, DTensor),
            "reduce_scatters": len(reduce_scatters)}


def compare_sharded_logits(rank: int, world: int) -> dict:
    """`sharded_logits` of a head (bias, soft cap, logit scale) sharded on the vocabulary, each rank with rows of its
    own, 3 fewer than the rank before (the last none), against the whole head's logits of the same rows; and its
    refusals."""
    torch.manual_seed(5)  # the same whole head on every rank
    weight, bias = torch.randn(6, 16) * 0.5, torch.randn(6)
    whole = LinearHead(weight, bias=bias, softcap=3.0, logit_scale=0.8)
    mesh = init_device_mesh("cpu", (world,))
    sharded = LinearHead(distribute_tensor(weight, mesh, [Shard(0)]), bias=distribute_tensor(bias, mesh, [Shard(0)]),
                         softcap=3.0, logit_scale=0.8)
    hidden = torch.randn(3 * (world - 1 - rank), 16, generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        rows = sharded_logits(sharded, hidden)
    refusals = []
    for head, needs_grad in ((whole, False), (sharded, True)):
        try:
            sharded_logits(head, hidden.detach().requires_grad_(needs_grad))
        except (ValueError, NotImplementedError) as error:
            refusals.append(str(error))
    error = (rows - whole.logits(hidden)).abs().max().item() if len(hidden) else 0.0
    return {"shape": tuple(rows.shape), "error": error, "refusals": refusals}


def sharded_head_checks() -> dict:
    """`check_head` of models sharded by FSDP2 (their head a DTensor): name -> (the refusal or None, how many times the
    model's own forward ran). A class the sweep checked is read without running it; another is refused, unless it was
    checked before it was sharded."""
    results = {}
    for name, model, checked_first in (
            ("checked class", tiny_qwen2(seed=0, tie_word_embeddings=False), False),
            ("unchecked class", UncheckedQwen2(tiny_qwen2_config(tie_word_embeddings=False)), False),
            ("unchecked class, checked unsharded", UncheckedQwen2(tiny_qwen2_config(tie_word_embeddings=False)), True)):
        if checked_first:
            check_head(model, "")
        fully_shard(model.lm_head)
        fully_shard(model)
        forwards = []
        model.register_forward_pre_hook(lambda *_: forwards.append(1))
        try:
            check_head(model, "the way around")
            results[name] = (None, len(forwards))
        except UnreadableHead as refusal:
            results[name] = (str(refusal), len(forwards))
    return results


@contextlib.contextmanager
def counted_reduce_scatters():
    """A list that holds one entry per reduce-scatter run while the context lasts."""
    calls, names = [], [name for name in ("reduce_scatter_single", "reduce_scatter_tensor") if hasattr(dist, name)]
    real = {name: getattr(dist, name) for name in names}
    for name in names:
        setattr(dist, name, lambda *args, _real=real[name], **kwargs: calls.append(1) or _real(*args, **kwargs))
    try:
        yield calls
    finally:
        for name in names:
            setattr(dist, name, real[name])


def main(output_path: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {f"tied={tied},shard_head={shard}": compare(tied, shard, rank, world)
               for tied, shard in ((False, True), (False, False), (True, False))}
    results["tensor_parallel"] = compare_tensor_parallel(world)
    results["sharded_logits"] = compare_sharded_logits(rank, world)
    results["sharded_head_checks"] = sharded_head_checks()
    if rank == 0:
        torch.save(results, output_path)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # gloo can abort at interpreter exit after a clean run


if __name__ == "__main__":
    main(sys.argv[1])
