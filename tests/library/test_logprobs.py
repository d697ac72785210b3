"""get_response_log_probs: fused (impl="auto", the default) against materialized (impl="reference"), on real HF
causal LMs built from configs."""

import pytest
import torch

from head_models import STRUCTURES, halved_logits_qwen2, with_structure

from logitless import fused_linear_logprobs, get_response_log_probs
from logitless.hf import final_hidden_states, head_structure, lm_head_of, vocabulary_rows
from logitless.hf_probe import UnreadableHead, check_head
from logitless.models import tiny_qwen2
from logitless.ops.head import LinearHead


def _batch(vocab=151936, batch=2, length=13):
    input_ids = torch.randint(0, vocab, (batch, length))
    return input_ids, torch.roll(input_ids, -1, dims=1)


def _both(model, input_ids, labels, **kwargs):
    out = {}
    for impl in ("auto", "reference"):
        model.zero_grad(set_to_none=True)
        result = get_response_log_probs(model, input_ids, labels, True, impl=impl, **kwargs)
        (result["log_probs"].sum() + 0.3 * result["token_entropy"].sum()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        out[impl] = (result, grads)
    return out["auto"], out["reference"]


def _assert_agree(fused, materialized, atol=1e-5):
    for key in ("log_probs", "token_entropy"):
        assert fused[0][key].shape == materialized[0][key].shape
        torch.testing.assert_close(fused[0][key], materialized[0][key], atol=atol, rtol=1e-5)
    assert fused[1].keys() == materialized[1].keys()
    for name in fused[1]:
        torch.testing.assert_close(fused[1][name], materialized[1][name], atol=atol, rtol=1e-4, msg=name)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_qwen2_fused_equals_materialized(tied, temperature):
    model = tiny_qwen2(seed=1, tie_word_embeddings=tied)
    input_ids, labels = _batch()
    _assert_agree(*_both(model, input_ids, labels, temperature=temperature))


def test_seed_semantics_are_log_softmax_gather(tiny_model):
    input_ids, labels = _batch(batch=1, length=5)
    with torch.no_grad():
        logits = tiny_model(input_ids).logits
        out = get_response_log_probs(tiny_model, input_ids, labels, return_token_entropy=True)
    expected = torch.log_softmax(logits, -1).gather(-1, labels[..., None]).squeeze(-1)
    torch.testing.assert_close(out["log_probs"], expected, atol=1e-5, rtol=0)
    assert "token_entropy" in out
    assert "token_entropy" not in get_response_log_probs(tiny_model, input_ids, labels)


@pytest.mark.parametrize("structure", STRUCTURES)
def test_each_head_structure_scores_as_its_own_forward(structure):
    """One tiny model per head structure logitless reads: it names the structure, and the fused log-probs, entropies
    and gradients equal those of the model's own forward (a BERT-style transform, a muP divisor and an unpadded
    vocabulary, a language model nested under another prefix, as well as plain, tied, scaled and soft-capped)."""
    model = with_structure(structure)
    assert structure in head_structure(model)
    input_ids, labels = _batch(vocab=vocabulary_rows(model))
    _assert_agree(*_both(model, input_ids, labels, temperature=0.8))


def test_a_head_logitless_cannot_read_is_refused_in_one_line_and_the_reference_impl_scores_it():
    """A model whose forward halves its logits, which no config says: the fused impls refuse it (the first call checks
    its head against its own forward), naming its class and impl='reference', which scores it."""
    model = halved_logits_qwen2(vocab_size=211, pad_token_id=0, eos_token_id=0)
    input_ids, labels = _batch(vocab=211)
    for impl in ("auto", "chunked"):
        with pytest.raises(UnreadableHead, match=r"^model: logitless cannot score HalvedLogitsQwen2 from its hidden "
                                                 r"states: its own forward's log-probs and entropies differ .*; "
                                                 r"impl='reference' scores it with its own forward") as refusal:
            get_response_log_probs(model, input_ids, labels, impl=impl)
        assert "\n" not in str(refusal.value)
    with torch.no_grad():
        own = torch.log_softmax(model(input_ids).logits, -1).gather(-1, labels[..., None])[..., 0]
        torch.testing.assert_close(get_response_log_probs(model, input_ids, labels, impl="reference")["log_probs"], own)


def test_the_head_check_runs_once_in_eval_mode_without_gradient_and_leaves_the_model_as_it_was():
    """The check before a model's first fused call: its own forward once, in eval mode (no dropout; a model in train
    mode with dropout would otherwise differ from its fused log-probs), without gradient, the random number
    generator untouched and every module's train/eval flag restored; later calls read the verdict kept on it."""
    model = tiny_qwen2(seed=1, vocab_size=211, pad_token_id=0, eos_token_id=0, attention_dropout=0.5).train()
    model.model.layers[0].eval()  # a module the caller keeps in eval mode stays so
    flags = {name: module.training for name, module in model.named_modules()}
    forwards = []
    model.get_output_embeddings().register_forward_hook(lambda *_: forwards.append(torch.is_grad_enabled()))
    random_state = torch.get_rng_state()
    check_head(model, "")
    assert forwards == [False]
    assert torch.equal(torch.get_rng_state(), random_state)
    assert {name: module.training for name, module in model.named_modules()} == flags
    assert all(p.grad is None for p in model.parameters())
    input_ids, labels = _batch(vocab=211, batch=1, length=4)
    check_head(model, "")
    get_response_log_probs(model, input_ids, labels)
    assert forwards == [False]  # the fused call ran the body alone, and no second check


def test_the_head_check_reads_a_forward_that_accelerate_wraps_in_bf16_autocast_as_built():
    """TRL's bf16=True has Accelerate wrap a prepared model's forward (a distillation teacher's) in bf16 autocast: the
    check compares the model's arithmetic in the dtype it was built in, so a right head is not refused for the
    autocast's rounding (0.0015 here), while the halved logits of a wrong one still are."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)  # the process's one state, maybe another test's
    try:
        accelerator = Accelerator(mixed_precision="bf16", cpu=True)
        model = accelerator.prepare_model(tiny_qwen2(seed=1, vocab_size=211, pad_token_id=0, eos_token_id=0),
                                          evaluation_mode=True)
        check_head(model, "")
        halved = accelerator.prepare_model(halved_logits_qwen2(vocab_size=211, pad_token_id=0, eos_token_id=0),
                                           evaluation_mode=True)
        with pytest.raises(UnreadableHead, match="differ"):
            check_head(halved, "")
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.parametrize("family, scaling", [("Granite", 4.0), ("HyperCLOVAX", 4.0)])
def test_head_with_logits_scaling(family, scaling):
    # Granite divides the logits by logits_scaling, HyperCLOVA X multiplies them by it
    import transformers

    config = getattr(transformers, f"{family}Config")(vocab_size=211, hidden_size=32, intermediate_size=64,
                                                      num_hidden_layers=1, num_attention_heads=4,
                                                      num_key_value_heads=2, logits_scaling=scaling, pad_token_id=0)
    model = getattr(transformers, f"{family}ForCausalLM")(config)
    input_ids, labels = _batch(vocab=211)
    _assert_agree(*_both(model, input_ids, labels, temperature=0.8))
    with torch.no_grad():  # the head's scale is the one the model's own forward applies
        logits = model(input_ids).logits
        raw = model.get_output_embeddings()(final_hidden_states(model, input_ids))
    torch.testing.assert_close(logits, raw * lm_head_of(model).logit_scale)


def test_head_with_bias_phi():
    from transformers import PhiConfig, PhiForCausalLM

    model = PhiForCausalLM(PhiConfig(vocab_size=401, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=4, pad_token_id=0))
    assert model.get_output_embeddings().bias is not None
    torch.nn.init.normal_(model.get_output_embeddings().bias, std=0.5)
    input_ids, labels = _batch(vocab=401)
    _assert_agree(*_both(model, input_ids, labels))


def test_softcapped_head_gemma2():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    model = Gemma2ForCausalLM(Gemma2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                           final_logit_softcapping=1.0, tie_word_embeddings=False))
    torch.nn.init.normal_(model.get_output_embeddings().weight, std=0.5)  # logits of std ~3: the cap bites
    input_ids, labels = _batch(vocab=97)
    fused, materialized = _both(model, input_ids, labels, temperature=0.7)
    _assert_agree(fused, materialized)
    assert lm_head_of(model).softcap == 1.0
    model.config.final_logit_softcapping = None
    uncapped = get_response_log_probs(model, input_ids, labels)["log_probs"]
    assert (uncapped - fused[0]["log_probs"]).abs().max() > 0.5


def test_one_head_definition_of_scale_softcap_and_temperature():
    # cap(s * x) / T: what LinearHead.logits computes, and what the fused op computes from the same keywords
    hidden, weight = torch.randn(2, 5, 8), torch.randn(53, 8)
    targets = torch.randint(0, 53, (2, 5))
    head = LinearHead(weight, temperature=0.9, softcap=0.6, logit_scale=0.25)
    logits = 0.6 * torch.tanh(0.25 * (hidden @ weight.T) / 0.6) / 0.9
    torch.testing.assert_close(head.logits(hidden.reshape(10, 8)), logits.reshape(10, 53))
    torch.testing.assert_close(head.logits(hidden.reshape(10, 8), torch.tensor([3, 50])),
                               logits.reshape(10, 53)[:, [3, 50]])
    got = fused_linear_logprobs(hidden, weight, targets, temperature=0.9, softcap=0.6, logit_scale=0.25)
    want = torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("impl", ["auto", "reference"])
def test_ignored_labels_score_zero_like_the_other_positions_are_untouched(tiny_model, impl):
    # labels of -100 (transformers' ignore index) are not scored, not refused as out-of-range token ids
    input_ids, labels = _batch(batch=2, length=6)
    ignored = labels.clone()
    ignored[0, :2] = -100
    with torch.no_grad():
        full = get_response_log_probs(tiny_model, input_ids, labels, True, impl=impl)
        got = get_response_log_probs(tiny_model, input_ids, ignored, True, impl=impl)
    assert (got["log_probs"][0, :2] == 0).all()
    torch.testing.assert_close(got["log_probs"][ignored != -100], full["log_probs"][ignored != -100])
    torch.testing.assert_close(got["token_entropy"], full["token_entropy"])


def test_empty_batch_is_a_clear_error(tiny_model):
    # a batch of size 0 is named, not a bare RuntimeError from inside the model
    empty = torch.zeros(0, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="input_ids: the batch is empty"):
        get_response_log_probs(tiny_model, empty, empty)


def test_bad_inputs(tiny_model):
    input_ids, labels = _batch(batch=1, length=4)
    with pytest.raises(ValueError, match="labels: shape"):
        get_response_log_probs(tiny_model, input_ids, labels[:, :3])
    with pytest.raises(ValueError, match="labels: token ids"):
        get_response_log_probs(tiny_model, input_ids, labels + 151936)
    with pytest.raises(TypeError, match="input_ids: expected token ids as an int64"):
        get_response_log_probs(tiny_model, input_ids.float(), labels)
    with pytest.raises(ValueError, match="impl"):
        get_response_log_probs(tiny_model, input_ids, labels, impl="fast")
    for other_spelling in ("fused", "materialized"):
        with pytest.raises(ValueError, match="impl: 'fused' is spelled 'auto' \\(or 'chunked'\\); 'materialized' is "
                                             "'reference'"):
            get_response_log_probs(tiny_model, input_ids, labels, impl=other_spelling)
    with pytest.raises(TypeError, match="get_response_log_probs: unknown keyword `temprature`; did you mean "
                                        "`temperature`?"):
        get_response_log_probs(tiny_model, input_ids, labels, temprature=0.5)
    with pytest.raises(ValueError, match="temperature"):
        get_response_log_probs(tiny_model, input_ids, labels, temperature=0)


@pytest.mark.parametrize("impl", ["auto", "reference"])
def test_left_padding_with_attention_mask_matches_unpadded_rows(impl):
    from transformers import GPT2Config, GPT2LMHeadModel  # absolute positions: padding must not shift them

    model = GPT2LMHeadModel(GPT2Config(vocab_size=211, n_embd=32, n_layer=1, n_head=2, n_positions=64)).eval()
    short, long = torch.randint(0, 211, (1, 5)), torch.randint(0, 211, (1, 8))
    padded = torch.cat([torch.cat([torch.zeros(1, 3, dtype=torch.long), short], 1), long])
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, :3] = 0
    with torch.no_grad():
        batch = get_response_log_probs(model, padded, padded.roll(-1, 1), impl=impl, attention_mask=mask)["log_probs"]
        alone = get_response_log_probs(model, short, padded.roll(-1, 1)[:1, 3:], impl=impl)["log_probs"]
    torch.testing.assert_close(batch[0, 3:], alone[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("impl", ["reference", "auto"])
def test_an_infinite_temperature_is_refused_by_every_impl(impl):
    model = tiny_qwen2(vocab_size=97, hidden_size=8, intermediate_size=16, num_hidden_layers=1, pad_token_id=0)
    input_ids = torch.randint(1, 97, (1, 5))
    with pytest.raises(ValueError, match="temperature: expected a finite number > 0, got inf"):
        get_response_log_probs(model, input_ids, input_ids, impl=impl, temperature=float("inf"))
