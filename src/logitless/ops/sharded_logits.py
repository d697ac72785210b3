"""Whole logits rows for this rank's tokens from a head sharded on the vocabulary, the weight never gathered.

Generation needs each next token's whole distribution: samplers, top-k and top-p, repetition penalties and stop
criteria all read a (rows, V) logits matrix. Under FSDP2 each rank decodes its own prompts while holding V / P of the
head's rows, so the usual way is to gather the whole (V, H) weight at every decode step. `sharded_logits` moves the
tokens instead: the group's hidden states are all-gathered (rows x H), each rank computes its own vocabulary columns
for every rank's rows, and one all-to-all hands each rank its rows' columns from every shard. Per decode step that is
rows x (H + V) numbers per rank against V x H for the gathered weight: at a 151,936-token vocabulary and H = 4,096,
a batch of 8 rows moves 1.2 M numbers where the weight is 622 M.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from logitless.ops.head import LinearHead
from logitless.ops.sharded import local_head, vocab_shard


def sharded_logits(head: LinearHead, hidden: torch.Tensor) -> torch.Tensor:
    """hidden (n, H), this rank's own rows -> their logits (n, V) over the whole vocabulary, in the head's stat dtype,
    from ``head`` whose weight is a DTensor sharded on the vocabulary (`logitless.ops.sharded.vocab_shard`'s layouts;
    each rank its own rows, as under FSDP2). Every rank of the weight's mesh must call it, each with its own ``n``.
    No gradient: this is for sampling."""
    if torch.is_grad_enabled() and (hidden.requires_grad or head.weight.requires_grad):
        raise NotImplementedError("hidden: sharded_logits computes no gradient; call it under torch.no_grad() (the "
                                  "fused ops train on a sharded head without logits)")
    shard = vocab_shard(head, hidden)
    if shard is None:
        raise ValueError("head: sharded_logits needs a weight that is a DTensor sharded on the vocabulary; a whole "
                         "weight's logits are head.logits(hidden)")
    if not shard.tokens_local:
        raise ValueError("hidden: sharded_logits is for each rank's own rows (a plain tensor), not rows every rank "
                         "shares")
    own = local_head(head, shard)
    counts = shard.counts(hidden.shape[0], hidden.device)
    longest = max(counts)
    every_rows = shard.gather_rows(hidden, counts)  # (sum(counts), H): every rank's rows, in rank order
    columns = own.logits(every_rows)  # (sum(counts), V / P): this shard's columns for every rank's rows
    outgoing = columns.new_zeros(shard.size, longest, own.vocab_size)  # rank r's rows, padded to the longest
    start = 0
    for rank, count in enumerate(counts):
        outgoing[rank, :count] = columns[start:start + count]
        start += count
    incoming = torch.empty_like(outgoing)  # incoming[r]: shard r's columns for this rank's rows
    dist.all_to_all_single(incoming, outgoing, group=shard.group)
    return incoming[:, :hidden.shape[0]].permute(1, 0, 2).reshape(hidden.shape[0], shard.vocab_size)
