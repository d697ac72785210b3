"""The one seam between TRL and logitless: TRL's ``model(..., fused_lm_head=True)`` answered by our fused ops.

TRL 1.16 scores every policy, old and reference log-prob through ``model(..., labels=labels,
fused_lm_head=True)``, which returns a `FusedCausalLMOutput` of per-token log-probs and entropies;
its ``_compute_loss`` (every loss type, normalization, mask, entropy bonus and metric) is ordinary
PyTorch on those ``(B, T)`` tensors. `add_logitless_lm_head` installs that forward with logitless's
fused log-probs and differentiable entropy: the body's final hidden states and the head (temperature,
logit scale, soft cap, bias, via `LinearHead`) go to `linear_token_stats`, so no ``(B, T, V)`` logits
or logits gradient exist, and the ``lm_head`` module itself is never called.

Sharded heads: an FSDP2 or tensor-parallel head whose weight is a DTensor sharded on the vocabulary
goes to the fused ops as it is, and each rank scores with its own rows of the vocabulary, the head
never gathered (`logitless.ops.sharded`: each rank's gradient shard is the mean over the ranks, as FSDP2
reduces every other gradient). Generation runs the forward without labels: under FSDP2 its logits come
from the vocabulary shards too (`vocabulary_parallel_forward`), so the head's module never runs there either and
FSDP2 neither unshards nor prefetches it. The completion logits that reward functions read need whole rows, so
for them the head is gathered once per reward batch. A DeepSpeed ZeRO-3 head is gathered by TRL's own
context before the head is read (a partitioned weight holds no rows outside it), and again in backward,
where the weight is read a second time.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import types
from collections.abc import Callable
from contextlib import nullcontext

import torch
from torch.distributed.tensor import DTensor, Replicate
from transformers.integrations import is_deepspeed_zero3_enabled
from transformers.modeling_outputs import CausalLMOutputWithPast
from trl.trainer.utils import FusedCausalLMOutput, maybe_gather_lm_head_ctx

from logitless.hf import head_hidden_states, lm_head_of, model_body
from logitless.ops.fused import linear_token_stats
from logitless.ops.head import LinearHead
from logitless.ops.sharded_logits import sharded_logits
from logitless.trl.notices import head_gathered_by_fsdp

logger = logging.getLogger(__name__)
_INSTALLED = "_logitless_lm_head"  # set on a model whose forward `add_logitless_lm_head` replaced
_GATHER_NOTED = "_logitless_gathered_head_noted"  # set on a model once `head_gathered_by_fsdp` was asked
# the per-token fields of FusedCausalLMOutput, all computed here: log_probs always, the others when a trainer asks
# (entropy, differentiable; the rest without gradient, from the same pass over the blocks)
COMPUTED_OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")

# on_hidden(hidden (B, T', H) no grad, label_mask (B, T')): sees the hidden states each scoring call reads
HiddenObserver = Callable[[torch.Tensor, torch.Tensor], None]


def add_logitless_lm_head(model, temperature: float = 1.0, cast_lm_head_to_fp32: bool = False,
                          outputs: tuple[str, ...] = ("log_probs",), *,
                          on_hidden: HiddenObserver | None = None) -> None:
    """Make ``model(..., labels=labels, fused_lm_head=True)`` return TRL's `FusedCausalLMOutput` from logitless's
    fused ops; without ``fused_lm_head`` the forward (and so generation) is the model's own.

    The signature is TRL's ``add_fused_lm_head``'s, so the trainer can install it where TRL would install its own.
    ``on_hidden``, when given, is called with each scoring call's hidden states (detached) and label mask.
    """
    unsupported = sorted(set(outputs) - set(COMPUTED_OUTPUTS))
    if unsupported:
        raise NotImplementedError(f"outputs: logitless's fused LM head computes {COMPUTED_OUTPUTS}, not {unsupported}")
    original_forward = model.forward

    @functools.wraps(type(model).forward)  # generate validates its keyword arguments against this signature
    def forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs):
        if not fused_lm_head:
            passed = dict(labels=labels, shift_labels=shift_labels, num_items_in_batch=num_items_in_batch)
            if labels is None and shift_labels is None and not torch.is_grad_enabled() and head_sharded_by_fsdp2(self):
                return vocabulary_parallel_forward(self, *args, **kwargs)  # generation: the head's module never runs
            return original_forward(*args, **kwargs, **{k: v for k, v in passed.items() if v is not None})
        text_config = self.config.get_text_config()
        kwargs["use_cache"] = False
        if getattr(text_config, "output_router_logits", False):  # MoE: as the model's own forward asks for them
            kwargs.setdefault("output_router_logits", True)
        body_outputs = model_body(self)(*args, **kwargs)
        if shift_labels is None:  # position t scores token t + 1
            hidden, labels = head_hidden_states(self, body_outputs)[:, :-1], labels[:, 1:]
        else:
            hidden, labels = head_hidden_states(self, body_outputs), shift_labels
        precision = torch.autocast(hidden.device.type, enabled=False) if cast_lm_head_to_fp32 else nullcontext()
        with gathered_output_embedding(self), precision:
            head = scoring_head(self, temperature, cast_lm_head_to_fp32)
            hidden = hidden.to(head.weight.device, torch.float32 if cast_lm_head_to_fp32 else head.weight.dtype)
            labels = labels.to(head.weight.device)
            label_mask = labels != -100
            if on_hidden is not None:
                on_hidden(hidden.detach(), label_mask)
            fields = token_fields(head, hidden, labels, label_mask, outputs, tensor_parallel(self, head))
        log_probs = fields["log_probs"]
        loss = -log_probs.sum() / (label_mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch)
        aux_loss = None
        if kwargs.get("output_router_logits"):
            aux_loss = router_aux_loss(text_config, body_outputs.router_logits, kwargs.get("attention_mask"))
            loss = loss + getattr(text_config, "router_aux_loss_coef", 0.0) * aux_loss
        return FusedCausalLMOutput(loss=loss, **fields, label_mask=label_mask, aux_loss=aux_loss)

    model.forward = types.MethodType(forward, model)
    setattr(model, _INSTALLED, True)


def has_logitless_lm_head(model) -> bool:
    """Whether `add_logitless_lm_head` answers ``model``'s ``fused_lm_head=True`` calls."""
    return getattr(model, _INSTALLED, False)


def gathered_output_embedding(model):
    """TRL's ZeRO-3 gather context for the parameters of ``model``'s output embedding: whole while it lasts (a
    null context without ZeRO-3)."""
    module = model.get_output_embeddings()
    return zero3_gathered(getattr(module, "weight", None), getattr(module, "bias", None))


def zero3_gathered(*tensors: torch.Tensor | None):
    """TRL's ZeRO-3 gather context for those of ``tensors`` that are partitioned parameters."""
    return maybe_gather_lm_head_ctx(*(t for t in tensors if hasattr(t, "ds_status")))


def _say_once_if_gathered(model, weight: torch.Tensor) -> None:
    """On the main process, once per model: a warning when FSDP2 gathered the head before logitless could read its
    shards."""
    if getattr(model, _GATHER_NOTED, False):
        return
    setattr(model, _GATHER_NOTED, True)
    note = head_gathered_by_fsdp(model, weight)
    if note is not None and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0):
        logger.warning(note)


def scoring_head(model, temperature: float, in_fp32: bool = False) -> LinearHead:
    """The head the fused ops score with: the active copy of a PEFT ``modules_to_save`` head (the original one
    while adapters are disabled), a DTensor weight (FSDP2, tensor parallelism) as it is, which the ops run
    sharded, fp32 on request. Under ZeRO-3, call it inside `gathered_output_embedding`."""
    head = lm_head_of(model, temperature)
    _say_once_if_gathered(model, head.weight)
    if not in_fp32:
        return head
    return dataclasses.replace(head, weight=head.weight.float(), bias=None if head.bias is None else head.bias.float())


def detached_head(model, temperature: float, in_fp32: bool = False) -> LinearHead:
    """`scoring_head` without autograd, readable after this call returns and with whole rows (for a batch of reward
    functions): a sharded head is gathered once, a ZeRO-3 one copied out of TRL's gather context."""
    with torch.no_grad(), gathered_output_embedding(model):
        head = scoring_head(model, temperature, in_fp32)
        weight, bias = head.weight, head.bias
        if isinstance(weight, DTensor):
            weight, bias = weight.full_tensor(), None if bias is None else bias.full_tensor()
        if is_deepspeed_zero3_enabled():  # the gathered rows are released when the context exits
            weight, bias = weight.clone(), None if bias is None else bias.clone()
        return dataclasses.replace(head, weight=weight.detach(), bias=None if bias is None else bias.detach())


def head_sharded_by_fsdp2(model) -> bool:
    """Whether ``model``'s LM head weight is, as it will be read, a DTensor that FSDP2 shards on the vocabulary (the
    head an FSDP unit of its own, as docs/distributed.md loads it): each rank has its own tokens and V / P rows."""
    from torch.distributed.fsdp import FSDPModule

    weight = getattr(model.get_output_embeddings(), "weight", None)
    return isinstance(weight, DTensor) and any(isinstance(module, FSDPModule) for module in model.modules())


def vocabulary_parallel_forward(model, *args, logits_to_keep: int | torch.Tensor = 0, return_dict=None, **kwargs
                                ) -> CausalLMOutputWithPast:
    """The model's forward without labels or gradients (what ``generate`` calls at each decode step) for a head that
    FSDP2 shards on the vocabulary: the body's last hidden states at the positions ``logits_to_keep`` selects (as
    transformers' models read it: the last N positions, or these indices) scored by `sharded_logits`, so the head's
    module never runs and its weight is never gathered; the group's hidden states and each rank's rows' logits move
    instead. The logits come back in the head's dtype, as the model's own head returns them."""
    body_outputs = model_body(model)(*args, **kwargs)
    hidden = head_hidden_states(model, body_outputs)  # (B, T, H): what the head reads
    kept = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    hidden = hidden[:, kept]  # (B, T', H)
    head = lm_head_of(model)
    rows = sharded_logits(head, hidden.reshape(-1, hidden.shape[-1]).to(head.weight.dtype))
    logits = rows.to(head.weight.dtype).view(*hidden.shape[:2], -1)  # (B, T', V)
    return CausalLMOutputWithPast(logits=logits, past_key_values=body_outputs.past_key_values,
                                  hidden_states=getattr(body_outputs, "hidden_states", None),
                                  attentions=getattr(body_outputs, "attentions", None))


def tensor_parallel(model, head: LinearHead) -> bool:
    """Whether ``head`` is sharded by tensor parallelism (a DTensor weight in a model no FSDP2 unit holds): every rank
    of its mesh then has the same tokens."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(head.weight, DTensor) and not any(isinstance(module, FSDPModule) for module in model.modules())


def token_fields(head: LinearHead, hidden: torch.Tensor, labels: torch.Tensor, label_mask: torch.Tensor,
                 outputs: tuple[str, ...], tokens_replicated: bool = False) -> dict[str, torch.Tensor | None]:
    """hidden (B, T, H), labels and label_mask (B, T) -> each field of `COMPUTED_OUTPUTS`, (B, T) for those in
    ``outputs`` (and log_probs always), None for the others; 0 (False) where the label is masked. Only the
    unmasked positions reach the matmuls. log_probs and entropy are differentiable. ``tokens_replicated``: the head
    is a DTensor and every rank of its mesh has these same tokens (tensor parallelism), so each scores its shard
    of the vocabulary for them alone, rather than for every rank's tokens.

    Under ZeRO-3 the caller holds the head's parameters gathered (`gathered_output_embedding`); backward, which
    reads them once more, gathers them again.
    """
    flat_mask = label_mask.reshape(-1)
    kept_hidden = hidden.reshape(-1, hidden.shape[-1])[flat_mask]  # (K, H): only the scored positions
    kept_labels = labels.reshape(-1)[flat_mask]
    if tokens_replicated:
        mesh = head.weight.device_mesh
        kept_hidden = DTensor.from_local(kept_hidden, mesh, [Replicate()] * mesh.ndim, run_check=False)
    extras = tuple(name for name in COMPUTED_OUTPUTS[2:] if name in outputs)
    log_probs, entropy, _, *asked = linear_token_stats(kept_hidden, targets=kept_labels, head=head,
                                                       need_entropy="entropy" in outputs, extras=extras)
    if log_probs.grad_fn is not None:
        gather_head_in_backward(log_probs.grad_fn, head)
    kept = {"log_probs": log_probs, "entropy": entropy if "entropy" in outputs else None, **(asked[0] if asked else {})}

    def scatter(values: torch.Tensor | None) -> torch.Tensor | None:
        # masked_scatter keeps an all-masked batch connected to the model: a zero loss whose backward runs
        return None if values is None else values.new_zeros(label_mask.shape).masked_scatter(label_mask, values)

    return {name: scatter(kept.get(name)) for name in COMPUTED_OUTPUTS}


def gather_head_in_backward(node: torch.autograd.graph.Node, head: LinearHead) -> None:
    """Enter TRL's ZeRO-3 gather context for the duration of ``node``'s backward (a null context otherwise)."""
    entered = []

    def enter(_grad_outputs):
        context = zero3_gathered(head.weight, head.bias)  # a copy of the head (fp32 on request) needs none
        context.__enter__()
        entered.append(context)

    def leave(_grad_inputs, _grad_outputs):
        entered.pop().__exit__(None, None, None)

    node.register_prehook(enter)
    node.register_hook(leave)


def router_aux_loss(text_config, router_logits, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """The MoE load-balancing loss a Mixtral-family model adds to its own loss (unweighted)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    num_experts = getattr(text_config, "num_experts", None) or getattr(text_config, "num_local_experts", None)
    return load_balancing_loss_func(router_logits, num_experts, text_config.num_experts_per_tok, attention_mask)
