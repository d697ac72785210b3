"""Random cases of the fused ops on a head sharded on the vocabulary, for tests/helpers/sharded_ops.py: hypothesis
draws each case's options, a JSON-able dict, the same on every run (derandomized), and `case_inputs_of` and `case_op`
turn it into the op's inputs and the op.

A case draws the layout of the tokens ("tensor", "data", and on 4 ranks "2d"), each data rank's number of sequences
(uneven), the sequences' length, the mask (a fraction of the tokens kept, and maybe one rank with every token masked),
the vocabulary (some small enough that the data-parallel op gathers the head), the hidden size, a bias or none,
temperature, soft cap, logit scale, the block sizes, and the op's own options: the entropy (log-probs, JSD), label
smoothing and reduction (cross-entropy), the teacher's hidden size, bias and sharding (KL, JSD), the JSD's beta (0 and
1 among them), and for each GRPO loss type its KL term, old log-probs, importance-sampling level and entropy bonus.
"""

import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from fused_cases import case_inputs
from logitless import (GRPOSettings, fused_grpo_loss, fused_linear_cross_entropy, fused_linear_jsd, fused_linear_kl,
                       fused_linear_logprobs)
from logitless.ops import BlockSizes
from logitless.op_settings import GRPO_LOSS_TYPES

# every op, each GRPO loss type and the JSD's forward KL, reverse KL and mixture kinds of their own, in turn
KINDS = [dict(op="logprobs"), dict(op="cross_entropy"), dict(op="kl"), dict(op="jsd", beta=0.0),
         dict(op="jsd", beta=1.0), dict(op="jsd", beta=None),  # None: the beta drawn, in (0, 1)
         *(dict(op="grpo", loss_type=loss_type) for loss_type in GRPO_LOSS_TYPES)]
OP_OPTIONS = {"logprobs": ("entropy",), "cross_entropy": ("label_smoothing", "reduction"),
              "kl": ("teacher_size", "teacher_bias", "teacher_sharded"),
              "jsd": ("teacher_size", "teacher_bias", "teacher_sharded", "beta", "entropy"),
              "grpo": ("loss_type", "kl_beta", "old_log_probs", "importance_sampling_level", "entropy_coef")}


@st.composite
def sharded_cases(draw, world: int) -> dict:
    """A case's options, those of every op among them (`of_kind` keeps its op's)."""
    layout = draw(st.sampled_from(["tensor", "data"] + (["2d"] if world == 4 else [])))
    parts = {"tensor": 1, "data": world, "2d": 2}[layout]  # ranks with tokens of their own
    vocab_ranks = 2 if layout == "2d" else world
    return dict(layout=layout, sequences=draw(st.lists(st.integers(1, 3), min_size=parts, max_size=parts)),
                seq=draw(st.integers(1, 6)), kept=draw(st.sampled_from([1.0, 0.8, 0.3])),
                masked_part=draw(st.none() | st.integers(0, parts - 1)), hidden_size=draw(st.integers(1, 12)),
                vocab=vocab_ranks * draw(st.integers(1, 60)), bias=draw(st.booleans()),
                temperature=draw(st.floats(0.3, 3.0)), softcap=draw(st.none() | st.floats(0.5, 30.0)),
                logit_scale=draw(st.sampled_from([1.0, 0.5, 2.0])),
                block_sizes=draw(st.none() | st.tuples(st.integers(1, 9), st.integers(1, 40))),
                seed=draw(st.integers(0, 2**31 - 1)),
                # the ops' own
                entropy=draw(st.booleans()),
                label_smoothing=draw(st.sampled_from([0.0, 0.1]) | st.floats(0.0, 0.5)),
                reduction=draw(st.sampled_from(["none", "sum", "mean"])),
                teacher_size=draw(st.integers(1, 14)), teacher_bias=draw(st.booleans()),
                teacher_sharded=draw(st.booleans()), beta=draw(st.floats(0.01, 0.99)),
                kl_beta=draw(st.sampled_from([0.0, 0.04])), old_log_probs=draw(st.booleans()),
                importance_sampling_level=draw(st.sampled_from(["token", "sequence"])),
                entropy_coef=draw(st.sampled_from([0.0, 0.01])))


def of_kind(case: dict, kind: dict) -> dict:
    """``case`` made one of ``kind`` (a `KINDS` entry): the kind's op and settings, and of the ops' own options only
    that op's."""
    settled = {name: value for name, value in kind.items() if value is not None}
    foreign = {name for options in OP_OPTIONS.values() for name in options} - set(OP_OPTIONS[kind["op"]])
    return settled | {name: value for name, value in case.items() if name not in foreign and name not in settled}


def drawn_cases(world: int, examples: int) -> list[dict]:
    """Hypothesis's first ``examples`` draws, derandomized (the same on every run), each a round of cases: one of each
    of the `KINDS`. Its first draw is the simplest case of each kind."""
    rounds = []

    @settings(max_examples=examples, derandomize=True, database=None, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(st.lists(sharded_cases(world), min_size=len(KINDS), max_size=len(KINDS)))
    def collect(cases):
        rounds.append([of_kind(case, kind) for case, kind in zip(cases, KINDS)])

    collect()
    return [case for cases in rounds for case in cases]


def part_rows(case: dict) -> list[slice]:
    """Each data rank's sequences: slices of the batch."""
    starts = [sum(case["sequences"][:index]) for index in range(len(case["sequences"]))]
    return [slice(start, start + count) for start, count in zip(starts, case["sequences"])]


def case_inputs_of(case: dict) -> dict[str, torch.Tensor]:
    """The case's fp64 inputs (`fused_cases.case_inputs`), every data rank's sequences one batch, with its mask, and
    without the biases it does not draw."""
    inputs = case_inputs(sum(case["sequences"]), case["seq"], case["hidden_size"], case["vocab"], seed=case["seed"],
                         teacher_hidden=case.get("teacher_size", 1))
    generator = torch.Generator().manual_seed(case["seed"] + 1)
    inputs["mask"] = torch.rand(inputs["mask"].shape, generator=generator) < case["kept"]
    if case["masked_part"] is not None:
        inputs["mask"][part_rows(case)[case["masked_part"]]] = False
    if case.get("teacher_bias"):
        inputs["bias_q"] = torch.randn(case["vocab"], generator=generator, dtype=torch.float64) * 0.1
    if not case["bias"]:
        del inputs["bias"]
    return inputs


def case_op(case: dict):
    """The case's op as tests/helpers/sharded_ops.py runs one: (inputs, **options) -> (outputs, a scalar loss of
    them)."""
    head = dict(temperature=case["temperature"], softcap=case["softcap"], logit_scale=case["logit_scale"],
                block_sizes=None if case["block_sizes"] is None else BlockSizes(*case["block_sizes"]))
    return lambda x, **options: OP_CALLS[case["op"]](case, x, head | options)


def _mask(case: dict, x: dict):
    """The mask, where it masks anything."""
    return x["mask"] if case["kept"] < 1.0 or case["masked_part"] is not None else None


def _logprobs(case, x, options):
    got = fused_linear_logprobs(x["hidden"], x["weight"], x["targets"], bias=x.get("bias"), mask=_mask(case, x),
                                return_token_entropy=case["entropy"], **options)
    outputs = list(got) if case["entropy"] else [got]
    return outputs, sum((output * upstream).sum() for output, upstream in zip(outputs, x["upstream"]))


def _cross_entropy(case, x, options):
    loss = fused_linear_cross_entropy(x["hidden"], x["weight"], x["targets"].masked_fill(~x["mask"], -100),
                                      bias=x.get("bias"), label_smoothing=case["label_smoothing"],
                                      reduction=case["reduction"], **options)
    return [loss], (loss * x["upstream"][0].reshape(loss.shape) if loss.dim() else loss).sum()


def _kl(case, x, options):
    divergence = fused_linear_kl(x["hidden"], x["weight"], x["hidden_q"], x["weight_q"], bias_p=x.get("bias"),
                                 bias_q=x.get("bias_q"), mask=_mask(case, x), **options)
    return [divergence], (divergence * x["upstream"][0]).sum()


def _jsd(case, x, options):
    got = fused_linear_jsd(x["hidden"], x["weight"], x["hidden_q"], x["weight_q"], bias_s=x.get("bias"),
                           bias_t=x.get("bias_q"), beta=case["beta"], mask=_mask(case, x),
                           return_token_entropy=case["entropy"], **options)
    outputs = list(got) if case["entropy"] else [got]
    return outputs, (outputs[0] * x["upstream"][0]).sum()


def _grpo(case, x, options):
    settings = GRPOSettings(loss_type=case["loss_type"], beta=case["kl_beta"], max_completion_length=case["seq"],
                            importance_sampling_level=case["importance_sampling_level"],
                            entropy_coef=case["entropy_coef"])
    loss, _ = fused_grpo_loss(x["hidden"], x["weight"], x["targets"], x["mask"], x["advantages"], bias=x.get("bias"),
                              old_log_probs=x["old_log_probs"] if case["old_log_probs"] else None,
                              ref_log_probs=x["ref_log_probs"] if case["kl_beta"] else None, settings=settings,
                              **options)
    return [loss], loss


OP_CALLS = {"logprobs": _logprobs, "cross_entropy": _cross_entropy, "kl": _kl, "jsd": _jsd, "grpo": _grpo}
