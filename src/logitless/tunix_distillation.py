"""Tunix 0.1.7's logit distillation (``tunix.distillation.strategies.LogitStrategy``) on logitless's fused heads:
the student's and the teacher's outputs become their final hidden states and heads (`HeadOutputs`), and the
strategy's loss reads them through `logitless.jax.fused_linear_jsd` (the KL of the softened distributions, at the
strategy's temperature) and `fused_linear_logprobs` (the cross-entropy on the labels), without the (B, T, V) logits.

`logitless.tunix.use_fused_head` puts the four functions here in place of the strategy's methods of the same names.
A strategy with ``distill_top_k`` (a KL over the teacher's top k logits only) runs Tunix's own methods unchanged.
The forward functions a strategy is given run on the model with its head taken off, which returns its final hidden
states where it returned its logits: a forward function may slice the logits on their leading axes and cast them to
fp32 (what Tunix's forward functions do with them); one that does anything else to them is refused by name.

Needs the ``tunix`` extra (``pip install 'logitless[tunix]'``).
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from logitless.jax import Head, fused_linear_jsd, fused_linear_logprobs
from logitless.tunix_models import take_head

try:
    from flax import nnx
    from tunix.distillation.strategies import logit
except ImportError as err:  # say how to get it, not just that it is missing
    raise ImportError("logitless.tunix needs Tunix: pip install 'logitless[tunix]'") from err

_TUNIX = {name: getattr(logit.LogitStrategy, name)
          for name in ("get_student_outputs", "get_teacher_outputs", "compute_loss", "compute_eval_loss")}


class _LogitsModel:
    """Stands for a model whose output is ``logits`` (..., V), or zeros for the ids it is called on, recording their
    shape (B, L)."""

    def __init__(self, vocab_size: int, logits=None):
        self.vocab_size, self.logits, self.called_on = vocab_size, logits, None

    def __call__(self, input_tokens, *args, **kwargs):
        self.called_on = tuple(input_tokens.shape)
        logits = jnp.zeros((*input_tokens.shape, self.vocab_size)) if self.logits is None else self.logits
        return logits, None


_SLICING = frozenset({"slice", "squeeze", "convert_element_type", "copy"})  # what leaves the logits' values as they are


def _check_slices_logits(forward_fn, inputs: dict, vocab_size: int, name: str) -> None:
    """``forward_fn`` hands on the model's logits sliced on their leading axes (and cast to fp32) and nothing else:
    traced on a stand-in model, the logits (B, L, V) become its output through slices and casts to fp32 only, with
    the vocabulary axis whole. Anything else is refused by name: on the fused head there are no logits to change."""
    shapes = jax.tree.map(lambda value: jax.ShapeDtypeStruct(value.shape, value.dtype), inputs)
    recorder = _LogitsModel(vocab_size)
    jax.eval_shape(lambda inputs: forward_fn(recorder, **inputs), shapes)
    if recorder.called_on is None:
        raise TypeError(f"{name}: never calls the model; logitless.tunix's LogitStrategy takes the model's logits")
    logits = jax.ShapeDtypeStruct((*recorder.called_on, vocab_size), jnp.float32)
    program = jax.make_jaxpr(lambda logits, inputs: forward_fn(_LogitsModel(vocab_size, logits), **inputs))(
        logits, shapes)
    steps = {equation.primitive.name for equation in program.eqns}
    casts = {equation.params["new_dtype"] for equation in program.eqns if equation.primitive.name ==
             "convert_element_type"}
    outputs = program.out_avals
    if (not steps <= _SLICING or not casts <= {jnp.dtype(jnp.float32)} or len(outputs) != 1
            or outputs[0].shape[-1:] != (vocab_size,) or program.jaxpr.outvars[0] in program.jaxpr.constvars):
        raise TypeError(f"{name}: does more to the logits than slice their leading axes ({', '.join(sorted(steps))}); "
                        "logitless.tunix's LogitStrategy takes the model's logits sliced only: run it with "
                        "logitless.tunix.use_stock_head()")


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class HeadOutputs:
    """A model's output as the switched strategy hands it to its loss: the final hidden states (..., H) and the
    head, in the dtype the head computes in."""

    hidden: jax.Array  # (..., H)
    head: Head

    def cross_entropy(self, labels: jax.Array) -> jax.Array:
        """-sum_v labels_v log p_v per position (...), for ``labels`` (..., V) any weights (one-hot, masked, soft):
        with ``ids`` the largest label of each position, ``-sum_v labels_v (z_v - z_ids) - sum_v labels_v log
        p_ids``, where the first sum is ``hidden . (labels @ weight) - sum(labels) hidden . weight[ids]`` (0 for
        one-hot labels) and ``log p_ids`` the fused op's."""
        if self.head.softcap is not None:
            raise NotImplementedError(f"model: a final soft cap ({self.head.softcap}) bends every logit of "
                                      "LogitStrategy's cross-entropy; run it with logitless.tunix.use_stock_head()")
        labels = labels.astype(jnp.float32)
        ids = jnp.argmax(labels, axis=-1)  # (...)
        total = labels.sum(axis=-1)  # (...)
        log_probs = fused_linear_logprobs(self.hidden, targets=ids, head=self.head)  # (...)
        hidden = self.hidden.astype(jnp.float32)
        weight = self.head.weight.astype(jnp.float32)
        label_logits = jnp.einsum("...h,...h->...", hidden, labels @ weight)  # sum_v labels_v z_v
        id_logits = jnp.einsum("...h,...h->...", hidden, weight[ids])  # z_ids
        return -(label_logits - total * id_logits) - total * log_probs


def _head_outputs(forward_fn, model, inputs: dict, name: str) -> HeadOutputs:
    """``forward_fn`` (the strategy's, which Tunix jitted) run on ``model`` without its head: its final states and
    head."""
    return _headless_forward(model, inputs, inspect.unwrap(forward_fn), name)


@nnx.jit(static_argnames=("forward_fn", "name"))
def _headless_forward(model, inputs: dict, forward_fn, name: str) -> HeadOutputs:
    headless = nnx.merge(*nnx.split(model))
    head = take_head(headless)
    _check_slices_logits(forward_fn, inputs, head.weight.shape[0], name)
    return HeadOutputs(*head.applied(forward_fn(headless, **inputs)))  # the states in place of the logits


def get_student_outputs(self, student_model, inputs: dict):
    """``LogitStrategy.get_student_outputs``: the student's `HeadOutputs` (Tunix's logits with ``distill_top_k``)."""
    if self.distill_top_k > 0:
        return _TUNIX["get_student_outputs"](self, student_model, inputs)
    return _head_outputs(self._student_forward_fn, student_model, inputs, "student_forward_fn")


def get_teacher_outputs(self, teacher_model, inputs: dict):
    """``LogitStrategy.get_teacher_outputs``: the teacher's `HeadOutputs`, without gradient (Tunix's logits with
    ``distill_top_k``)."""
    if self.distill_top_k > 0:
        return _TUNIX["get_teacher_outputs"](self, teacher_model, inputs)
    return jax.lax.stop_gradient(_head_outputs(self._teacher_forward_fn, teacher_model, inputs,
                                               "teacher_forward_fn"))


def compute_loss(self, student_output, teacher_output, labels: jax.Array) -> tuple[jax.Array, dict]:
    """``LogitStrategy.compute_loss`` on `HeadOutputs` (Tunix's own on logits): ``alpha`` times the KL of the
    student's distribution from the teacher's, both at the strategy's temperature T, times T^2, plus ``1 - alpha``
    times the student's cross-entropy on ``labels`` (B, T', V), each the mean over the positions (B, T'); the
    metrics Tunix logs, by its names."""
    if not isinstance(student_output, HeadOutputs):
        return _TUNIX["compute_loss"](self, student_output, teacher_output, labels)
    student_head, teacher_head = (dataclasses.replace(output.head, temperature=self.temperature)
                                  for output in (student_output, teacher_output))
    kl = fused_linear_jsd(student_output.hidden, hidden_t=teacher_output.hidden, head_s=student_head,
                          head_t=teacher_head, beta=0.0)  # (B, T'): KL(p_teacher || p_student)
    distillation_loss = jnp.mean(kl * self.temperature**2)
    task_loss = jnp.mean(student_output.cross_entropy(labels))
    metrics = {"distill/soft_loss": distillation_loss, "distill/hard_loss": task_loss,
               "distill/kl_div": jnp.mean(kl),
               "distill/teacher_loss": jnp.mean(teacher_output.cross_entropy(labels))}
    return self.alpha * distillation_loss + (1.0 - self.alpha) * task_loss, metrics


def compute_eval_loss(self, student_output, labels: jax.Array) -> tuple[jax.Array, dict]:
    """``LogitStrategy.compute_eval_loss`` on `HeadOutputs` (Tunix's own on logits): the student's cross-entropy on
    ``labels``, the mean over the positions."""
    if not isinstance(student_output, HeadOutputs):
        return _TUNIX["compute_eval_loss"](self, student_output, labels)
    return jnp.mean(student_output.cross_entropy(labels)), {}


SEAMS = tuple((logit.LogitStrategy, name, ours) for name, ours in (
    ("get_student_outputs", get_student_outputs), ("get_teacher_outputs", get_teacher_outputs),
    ("compute_loss", compute_loss), ("compute_eval_loss", compute_eval_loss)))  # (owner, name, ours)

__all__ = ["HeadOutputs", "SEAMS", "compute_eval_loss", "compute_loss", "get_student_outputs",
           "get_teacher_outputs"]
