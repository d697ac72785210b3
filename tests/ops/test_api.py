"""The public ops' surface: one signature table (docs/fused_ops.md) true to the code, one spelling of each argument,
keywords checked by name, the head given in parts or whole, one ``impl`` vocabulary."""

import inspect
import re
from pathlib import Path

import pytest
import torch

from logitless import (LinearHead, fused_grpo_loss, fused_linear_cross_entropy, fused_linear_jsd, fused_linear_kl,
                       fused_linear_logprobs, get_response_log_probs)
from logitless._checks import SPELLINGS
from logitless.ops import BlockSizes, reference
from logitless.ops.fused import linear_token_stats

ROOT = Path(__file__).resolve().parents[2]
OPS = {op.__name__: op for op in (fused_linear_logprobs, fused_linear_cross_entropy, fused_grpo_loss, fused_linear_kl,
                                  fused_linear_jsd, linear_token_stats, get_response_log_probs)}


def _signature_text(op) -> str:
    """``op``'s parameters as the table writes them: ``(a, b=None, *, c="auto", **options)``."""
    parts, keyword_only = [], False
    for parameter in inspect.signature(op).parameters.values():
        if parameter.kind is parameter.KEYWORD_ONLY and not keyword_only:
            parts.append("*")
            keyword_only = True
        if parameter.kind is parameter.VAR_KEYWORD:
            parts.append(f"**{parameter.name}")
        elif parameter.default is parameter.empty:
            parts.append(parameter.name)
        else:
            default = parameter.default
            shown = f'"{default}"' if isinstance(default, str) else repr(default)
            parts.append(f"{parameter.name}={shown}")
    return f"({', '.join(parts)})"


def _table_rows() -> dict[str, list[str]]:
    """docs/fused_ops.md's signature table: op -> its cells after the first."""
    text = (ROOT / "docs" / "fused_ops.md").read_text()
    table = text[text.index("| op | PyTorch"):].split("\n\n")[0].splitlines()[2:]
    rows = {}
    for line in table:
        cells = [cell.strip() for cell in line.strip("|").split(" | ")]
        rows[re.match(r"`(\w+)`", cells[0]).group(1)] = [cell.strip("`") for cell in cells[1:]]
    return rows


def test_the_signature_table_is_the_codes():
    rows = _table_rows()
    assert set(rows) == set(OPS)
    for name, op in OPS.items():
        assert rows[name][0] == _signature_text(op), name


def _parameters(op) -> dict[str, object]:
    """An op's parameters by name with their defaults (the keyword-only ones in any order)."""
    return {name: parameter.default for name, parameter in inspect.signature(op).parameters.items()}


def test_the_tables_jax_column_is_what_logitless_jax_has():
    """A row says "the same" exactly where `logitless.jax` has the op with the PyTorch op's parameters and
    defaults, and "not in JAX" where it has none (the column said "not in JAX" of three ops that were in JAX)."""
    jax_ops = pytest.importorskip("logitless.jax")
    rows = _table_rows()
    for name, op in OPS.items():
        twin = getattr(jax_ops, name, None)
        if twin is None:
            assert rows[name][1].startswith("not in JAX"), name
        else:
            assert _parameters(twin) == _parameters(op), name
            assert rows[name][1] == "the same, `impl` one of auto, reference, chunked", name


def _every_op_call(vocab=37, hidden_size=8):
    """name -> (a call of the op taking extra keywords, the head-part keyword names) on tiny inputs."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 5, hidden_size, generator=generator)
    weight = torch.randn(vocab, hidden_size, generator=generator)
    ids = torch.randint(0, vocab, (2, 5), generator=generator)
    mask, advantages = torch.ones(2, 5), torch.tensor([1.0, -1.0])
    return {
        "fused_linear_logprobs": lambda **k: fused_linear_logprobs(hidden, weight, ids, **k),
        "fused_linear_cross_entropy": lambda **k: fused_linear_cross_entropy(hidden, weight, ids, **k),
        "fused_grpo_loss": lambda **k: fused_grpo_loss(hidden, weight, ids, mask, advantages, **k),
        "fused_linear_kl": lambda **k: fused_linear_kl(hidden, weight, hidden, weight, **k),
        "fused_linear_jsd": lambda **k: fused_linear_jsd(hidden, weight, hidden, weight, **k),
        "linear_token_stats": lambda **k: linear_token_stats(hidden[0], weight, ids[0], **k),
    }


@pytest.mark.parametrize("name", list(_every_op_call()))
def test_a_misspelled_keyword_names_the_op_and_the_nearest_one(name):
    call = _every_op_call()[name]
    with pytest.raises(TypeError, match=rf"^{name}: unknown keyword `softcapp`; did you mean `softcap`\?$"):
        call(softcapp=30.0)
    with pytest.raises(TypeError, match=rf"^{name}: unknown keyword `block_size`; did you mean `block_sizes`\?$"):
        call(block_size=BlockSizes(tokens=2))
    with pytest.raises(TypeError, match=rf"^{name}: unknown keyword `zzz`; the keywords are "):
        call(zzz=1)


@pytest.mark.parametrize("name, keyword", [(name, keyword) for name in _every_op_call() for keyword in sorted(SPELLINGS)
                                            if keyword not in inspect.signature(OPS[name]).parameters])
def test_a_keyword_of_another_spelling_names_this_one(name, keyword):
    """A keyword of another spelling, on an op that does not take that keyword (one that does takes it as its own)."""
    call = _every_op_call()[name]
    with pytest.raises(TypeError, match=rf"^{name}: keyword `{keyword}` is spelled `{re.escape(SPELLINGS[keyword])}`$"):
        call(**{keyword: None})


def test_the_grpo_options_are_checked_by_name_too():
    call = _every_op_call()["fused_grpo_loss"]
    with pytest.raises(TypeError, match=r"^fused_grpo_loss: unknown keyword `epsilon_hgh`; "
                                        r"did you mean `epsilon_high`"):
        call(epsilon_hgh=0.28)
    loss, _ = call(epsilon_high=0.28, loss_type="dapo")
    assert loss.dim() == 0


@pytest.mark.parametrize("name", list(_every_op_call()))
@pytest.mark.parametrize("impl", ["fused", "materialized"])
def test_the_impl_of_another_vocabulary_names_its_spelling(name, impl):
    with pytest.raises(ValueError, match=r"^impl: 'fused' is spelled 'auto' \(or 'chunked'\); 'materialized' is "
                                         r"'reference'$"):
        _every_op_call()[name](impl=impl)


def test_every_impl_of_get_response_log_probs_agrees_and_only_reference_runs_the_models_head(tiny_model):
    """"reference" is the model's own forward (its lm_head makes the (B, T, V) logits), the others the fused head
    from hidden states: the same log-probs, and the model's head runs for "reference" alone (once the model's first
    fused call has checked its head against its own forward, `check_head`)."""
    from logitless.hf_probe import check_head

    check_head(tiny_model, "")
    input_ids = torch.randint(0, 151936, (1, 6), generator=torch.Generator().manual_seed(0))
    head_calls = []
    hook = tiny_model.get_output_embeddings().register_forward_hook(lambda *_: head_calls.append(1))
    try:
        results = {}
        for impl in ("auto", "chunked", "reference"):
            head_calls.clear()
            with torch.no_grad():
                results[impl] = get_response_log_probs(tiny_model, input_ids, input_ids.roll(-1, 1),
                                                       impl=impl)["log_probs"]
            assert len(head_calls) == (impl == "reference"), impl
    finally:
        hook.remove()
    rounding = 64 * torch.finfo(torch.float32).eps * results["reference"].abs().max().item()
    for impl in ("auto", "chunked"):
        torch.testing.assert_close(results[impl], results["reference"], atol=rounding, rtol=0)


def test_the_head_is_given_in_parts_or_whole_never_both():
    generator = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(6, 8, generator=generator), torch.randn(37, 8, generator=generator)
    bias, ids = torch.randn(37, generator=generator), torch.randint(0, 37, (6,), generator=generator)
    options = dict(bias=bias, temperature=0.7, softcap=3.0, logit_scale=1.3)
    head = LinearHead(weight, **options)
    assert torch.equal(fused_linear_logprobs(hidden, weight, ids, **options),
                       fused_linear_logprobs(hidden, targets=ids, head=head))
    torch.testing.assert_close(fused_linear_cross_entropy(hidden, targets=ids, head=head),
                               fused_linear_cross_entropy(hidden, weight, ids, **options), rtol=0, atol=0)
    other = LinearHead(torch.randn(37, 5, generator=generator), logit_scale=0.5)
    hidden_other = torch.randn(6, 5, generator=generator)
    kl = fused_linear_kl(hidden, hidden_q=hidden_other, head_p=head, head_q=other)
    want = reference.kl_from_log_probs(torch.log_softmax(reference.head_logits(hidden, head), -1),
                                       torch.log_softmax(reference.head_logits(hidden_other, other), -1))
    torch.testing.assert_close(kl, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(TypeError, match=r"^fused_linear_logprobs: `head` is given with `weight`, `temperature`; "):
        fused_linear_logprobs(hidden, weight, ids, head=head, temperature=0.7)
    with pytest.raises(TypeError, match=r"^fused_linear_kl: `head_p` is given with `weight_p`"):
        fused_linear_kl(hidden, weight, hidden_other, head_p=head, head_q=other)
    with pytest.raises(TypeError, match=r"^head_q: required with head_p"):
        fused_linear_kl(hidden, hidden_q=hidden_other, weight_q=other.weight, head_p=head)
    with pytest.raises(TypeError, match=r"^weight: required \(or the whole head as head=LinearHead\(\.\.\.\)\)"):
        fused_linear_logprobs(hidden, targets=ids)
    with pytest.raises(TypeError, match="^head: expected a LinearHead, got Tensor"):
        fused_linear_logprobs(hidden, targets=ids, head=weight)


def test_linear_head_fields_after_the_weight_are_keywords_named_as_the_ops_name_them():
    weight = torch.randn(5, 3)
    with pytest.raises(TypeError):
        LinearHead(weight, None, 0.7)  # positional: which is the temperature?
    head = LinearHead(weight, logit_scale=2.0)
    assert head.logit_scale == 2.0 and not hasattr(head, "scale")
    with pytest.raises(ValueError, match="logit_scale: expected a finite number > 0"):
        LinearHead(weight, logit_scale=0.0)


def test_one_loss_type_vocabulary_for_the_grpo_op_the_settings_and_the_recipe():
    """`logitless grpo` offers GRPOSettings' loss types by their names (all but luspo, which needs a sequence-level
    ratio); `logitless.losses` keeps its own policy-gradient family, documented as such."""
    from logitless.losses import LOSS_TYPES as POLICY_GRADIENT_LOSS_TYPES
    from logitless.op_settings import GRPO_LOSS_TYPES
    from logitless.recipes.grpo_options import LOSS_TYPES

    assert LOSS_TYPES + ("luspo",) == GRPO_LOSS_TYPES
    assert not set(POLICY_GRADIENT_LOSS_TYPES) & set(LOSS_TYPES)
    losses_doc = (ROOT / "docs" / "losses.md").read_text()
    assert "a different family from the\n  `loss_type` of `fused_grpo_loss`" in losses_doc
