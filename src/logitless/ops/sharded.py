"""A head whose weight is a DTensor sharded on the vocabulary (``Shard(0)`` over a mesh dimension: tensor parallelism,
FSDP2's ``fully_shard``), run without ever gathering the weight.

Each rank runs the block engine over its own rows of the vocabulary, and the statistics of the softmax (and of the
KL and the JSD) combine exactly across the shards: every sweep's running sums over its columns (the max, the sums
of exponentials, the target's logit, the entropy's and the divergences' sums) are gathered, O(tokens) numbers per
rank, and merged in rank order (`base.Sweep.across`), so every rank holds the statistics over the whole
vocabulary. The weight's gradient is computed where it lives, one shard per rank; the hidden states' gradient is
summed over the shards. Two layouts of the tokens, told by the hidden states:

* tensor-parallel: the same hidden states on every rank of the vocabulary's mesh dimension (a DTensor
  ``Replicate()`` there). Each rank sweeps its shard for those tokens; dh is all-reduced. The weight's gradient is
  the shard of the one loss every rank computes.
* data-parallel (FSDP2): each rank has its own tokens (a plain tensor, or a DTensor ``Shard(0)`` there). The hidden
  states of the group are all-gathered (tokens x H, far less than V x H at any realistic length), each rank
  computes its shard's statistics for every rank's tokens, and keeps its own tokens' results; in backward the
  per-token gradients are gathered, each rank's dh rows are reduce-scattered back to it, and the weight's gradient,
  already the local shard, is the mean over the ranks of their losses' gradients, as FSDP2 averages every other
  gradient. Where gathering the head would move fewer bytes (`moved_bytes`: in fp32, where the group's tokens
  outnumber the vocabulary's rows, tokens x P > V), the head is gathered instead, once per call, with the gradient
  averaged back to the shards.

On a 2-D mesh (data x tensor) the weight is sharded on one dimension and replicated on the other: the vocabulary
shards combine over the first, and the weight's gradient is averaged over the second, whose ranks each computed it
for their own tokens.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from logitless.ops.head import LinearHead
from logitless.ops.vocab_shard import VocabShard


def is_sharded(tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def vocab_shard(head: LinearHead, hidden: torch.Tensor, name: str = "weight") -> VocabShard | None:
    """The shard of ``head``'s vocabulary this rank holds (None when the weight is a plain tensor); errors name
    ``name`` (the op's argument for the weight) or ``hidden``. Checks: the weight is sharded on its rows, evenly, and
    replicated on any other mesh dimension; the bias is sharded as it is; the hidden states, when a DTensor, live on
    the weight's mesh."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    weight = head.weight
    if not isinstance(weight, DTensor):
        return None
    if not dist.is_initialized():
        raise ValueError(f"{name}: a DTensor needs the process group it was made in, and none is initialized "
                         "(torch.distributed.init_process_group)")
    mesh, placements = weight.device_mesh, weight.placements
    vocab_dims = [dim for dim, placement in enumerate(placements) if placement == Shard(0)]
    others = [placement for dim, placement in enumerate(placements) if dim not in vocab_dims]
    if all(isinstance(placement, Replicate) for placement in placements):
        raise ValueError(f"{name}: a DTensor replicated on every rank (placements {tuple(placements)}) holds the whole "
                         f"weight on each: pass {name}.to_local(), or shard it on its rows (the vocabulary, Shard(0))")
    if len(vocab_dims) != 1 or any(not isinstance(placement, Replicate) for placement in others):
        on_hidden = "; a weight sharded on the hidden dimension would need every logit summed over the ranks"
        raise ValueError(f"{name}: expected a DTensor sharded on its rows (the vocabulary, Shard(0)) over one mesh "
                         f"dimension and replicated on any other, got placements {tuple(placements)}"
                         f"{on_hidden if Shard(1) in placements else ''}")
    vocab_dim = vocab_dims[0]
    size = mesh.size(vocab_dim)
    if weight.shape[0] % size:
        raise ValueError(f"{name}: its {weight.shape[0]} vocabulary rows do not split evenly over the {size} ranks of "
                         "its mesh dimension; pad the vocabulary to a multiple of the ranks (padded rows with a -inf "
                         "bias are never sampled)")
    if head.bias is not None and (not isinstance(head.bias, DTensor) or head.bias.placements != placements):
        raise ValueError(f"bias: expected a DTensor sharded as {name} is ({tuple(placements)}), got "
                         f"{type(head.bias).__name__}{getattr(head.bias, 'placements', '')}")
    tokens_local = True
    if isinstance(hidden, DTensor):
        if hidden.device_mesh != mesh:
            raise ValueError(f"hidden: a DTensor on another mesh ({hidden.device_mesh}) than {name}'s ({mesh})")
        tokens_local = not isinstance(hidden.placements[vocab_dim], Replicate)
    rank = mesh.get_local_rank(vocab_dim)
    local = weight.shape[0] // size
    replicas = mesh.get_group(1 - vocab_dim) if mesh.ndim == 2 else None
    return VocabShard(mesh.get_group(vocab_dim), rank, size, rank * local, weight.shape[0], tokens_local, replicas)


def local_head(head: LinearHead, shard: VocabShard) -> LinearHead:
    """``head`` over this rank's rows of the vocabulary: its weight's (and bias's) local shard, through which the
    gradient reaches the DTensor."""
    bias = None if head.bias is None else head.bias.to_local()
    return dataclasses.replace(head, weight=head.weight.to_local(), bias=bias, shard=shard)


def fixed_local_head(head: LinearHead, shard: VocabShard) -> LinearHead:
    """A fixed head (a teacher, a reference) over the vocabulary rows of ``shard``: its own shard when it is sharded
    the same way, else those rows of its whole weight."""
    if is_sharded(head.weight):
        return local_head(head, shard)
    rows = slice(shard.offset, shard.offset + shard.vocab_size // shard.size)
    bias = None if head.bias is None else head.bias[rows]
    return dataclasses.replace(head, weight=head.weight[rows], bias=bias, shard=shard)


def gathered_head(head: LinearHead) -> LinearHead:
    """``head`` with its whole weight (and bias) gathered on every rank, once; the gradient goes back to the shards
    averaged over the ranks, as FSDP2 averages every gradient."""
    from torch.distributed.tensor.placement_types import Partial

    def whole(tensor):
        if tensor is None or not is_sharded(tensor):
            return tensor
        return tensor.full_tensor(grad_placements=[Partial("avg")] * tensor.device_mesh.ndim)

    return dataclasses.replace(head, weight=whole(head.weight), bias=whole(head.bias))


def moved_bytes(tokens: int, hidden_size: int, vocab_size: int, hidden_bytes: int, weight_bytes: int) -> dict[str, int]:
    """What the two ways of a data-parallel step move, in bytes of the whole tensors of their large collectives
    (``tokens``: the group's; the others move O(tokens) numbers; on a ring each rank sends (P - 1) / P of each):

    * ``gather``: the weight all-gathered and its gradient reduce-scattered, 2 V H in the weight's dtype;
    * ``vocab_parallel``: the hidden states all-gathered in their dtype and their gradient, fp32 partial sums over
      each rank's rows, reduce-scattered: tokens H (hidden_bytes + 4).

    The same numbers are what each way holds at once beyond the local shard: the whole weight and its gradient, or
    every rank's hidden states and their gradient."""
    return {"gather": 2 * vocab_size * hidden_size * weight_bytes,
            "vocab_parallel": tokens * hidden_size * (hidden_bytes + 4)}


def gathering_is_cheaper(shard: VocabShard, hidden: torch.Tensor, weight_dtype: torch.dtype) -> bool:
    """Data-parallel: whether gathering the weight moves fewer bytes than moving the group's hidden states
    (`moved_bytes`: in fp32, where the group's tokens outnumber the vocabulary's rows, tokens x P > V; in bf16,
    beyond 2V/3). The same answer on every rank."""
    if not shard.tokens_local:
        return False
    hidden_size = hidden.shape[-1]
    tokens = sum(shard.counts(hidden.numel() // max(hidden_size, 1), hidden.device))
    moved = moved_bytes(tokens, hidden_size, shard.vocab_size, hidden.element_size(),
                        torch.empty((), dtype=weight_dtype).element_size())
    return moved["gather"] < moved["vocab_parallel"]


def on_this_rank(head: LinearHead, hidden: torch.Tensor, *, materialize: bool = False,
                 name: str = "weight") -> tuple[LinearHead, torch.Tensor]:
    """(the head an op runs on this rank, this rank's hidden states) for a head whose weight is sharded on the
    vocabulary: its local shard (``head.shard`` says which), or the whole head gathered once for the materialized
    oracle (``materialize``) and where gathering moves fewer bytes. Hidden states given as a DTensor become their
    local tensor, through which their gradient goes back. A plain head comes back as it is."""
    shard = vocab_shard(head, hidden, name)
    hidden = hidden.to_local() if is_sharded(hidden) else hidden
    if shard is None:
        return head, hidden
    if materialize or gathering_is_cheaper(shard, hidden, head.weight.dtype):
        return gathered_head(head), hidden
    return local_head(head, shard), hidden
