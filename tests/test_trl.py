"""GRPOTrainerWithLogits against stock TRL GRPOTrainer, and its logit-aware rewards, on the tiny Qwen2 (CPU)."""

import random

import pytest
import torch

trl = pytest.importorskip("trl")
from datasets import Dataset  # noqa: E402

from logitless.hf import final_hidden_states  # noqa: E402
from logitless.models import save_model_and_tokenizer, tiny_qwen2  # noqa: E402
from logitless.ops.lazy import CompletionLogits  # noqa: E402
from logitless.multichoice.reward import (choice_token_ids, extract_answer_probability_from_logits,  # noqa: E402
                                           find_answer_position)
from logitless.trl import GRPOTrainerWithLogits  # noqa: E402

PROMPTS = ["What is 2+2?", "Name a color.", "Say hi.", "Count to three:"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    return str(save_model_and_tokenizer(tiny_qwen2(seed=0), tokenizer, tmp_path_factory.mktemp("tiny")))


def _config(tmp_path, **overrides):
    settings = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, activation_checkpointing=False,
                    per_device_train_batch_size=4, num_generations=2, max_completion_length=8, max_steps=1,
                    logging_steps=1, report_to="none", save_strategy="no", seed=0, disable_dropout=True,
                    learning_rate=1e-3)
    return trl.GRPOConfig(**(settings | overrides))


def _length_reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


def _trainer(cls, model_dir, tokenizer, tmp_path, reward_funcs=_length_reward, **overrides):
    return cls(model=model_dir, reward_funcs=reward_funcs, args=_config(tmp_path, **overrides),
               train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tokenizer)


def _loss_and_grads(trainer, inputs):
    trainer.model.train()
    trainer.model.zero_grad(set_to_none=True)
    trainer.current_gradient_accumulation_steps = 2
    trainer._metrics["train"].clear()
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in trainer.model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, {name: values[-1] for name, values in trainer._metrics["train"].items()}


@pytest.fixture(scope="module")
def softcapped_model_dir(tmp_path_factory, tokenizer):
    """A one-layer Gemma 2 whose logits are soft-capped at 1.0 (std ~3 before the cap, so the cap bites)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    model = Gemma2ForCausalLM(Gemma2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                           num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                           head_dim=16, final_logit_softcapping=1.0, tie_word_embeddings=False,
                                           pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                                           bos_token_id=None))
    torch.nn.init.normal_(model.get_output_embeddings().weight, std=0.5)
    return str(save_model_and_tokenizer(model, tokenizer, tmp_path_factory.mktemp("gemma2")))


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_one_step_equals_stock_trl(model_dir, tokenizer, tmp_path, loss_type, beta):
    _assert_one_step_equals_stock_trl(model_dir, tokenizer, tmp_path, loss_type=loss_type, beta=beta)


def test_softcapped_model_equals_stock_trl(softcapped_model_dir, tokenizer, tmp_path):
    _assert_one_step_equals_stock_trl(softcapped_model_dir, tokenizer, tmp_path, loss_type="dapo", beta=0.04)


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
def test_bf16_mixed_precision_equals_stock_trl(model_dir, tokenizer, tmp_path, model_dtype):
    # GRPOConfig's default bf16=True: autocast around the body, whose output accelerate hands back in fp32.
    # The head must run under the same autocast as TRL's old/reference log-probs: on policy, KL exactly 0.
    options = dict(bf16=True, beta=0.04, num_iterations=2, model_init_kwargs={"dtype": model_dtype})
    stock = _trainer(trl.GRPOTrainer, model_dir, tokenizer, tmp_path / "stock", **options)
    ours = _trainer(GRPOTrainerWithLogits, model_dir, tokenizer, tmp_path / "ours", **options)
    assert ours._fallback_reason is None and ours.model.dtype == model_dtype
    torch.manual_seed(0)
    inputs = stock._generate_and_score_completions([{"prompt": p} for p in PROMPTS[:2] for _ in range(2)])
    assert inputs["old_per_token_logps"] is not None and inputs["ref_per_token_logps"] is not None
    inputs["advantages"] = torch.randn(inputs["advantages"].shape, generator=torch.Generator().manual_seed(1))
    stock_loss, stock_grads, stock_metrics = _loss_and_grads(stock, inputs)
    our_loss, our_grads, our_metrics = _loss_and_grads(ours, inputs)
    # with the head outside autocast: KL 1e-7 and the loss off by 1.6e-5; with it, 0 and 1.5e-8 here
    assert stock_metrics["kl"] == 0.0 and abs(our_metrics["kl"]) < 3e-8
    assert our_metrics["entropy"] == pytest.approx(stock_metrics["entropy"], rel=1e-6)
    torch.testing.assert_close(our_loss, stock_loss, atol=3e-6, rtol=0)
    for name in stock_grads:  # bf16 matmuls either way; ours accumulate the head's gradients in fp32
        scale = stock_grads[name].abs().max().item()
        torch.testing.assert_close(our_grads[name].float(), stock_grads[name].float(), atol=2e-2 * scale, rtol=0,
                                   msg=name)


def _assert_one_step_equals_stock_trl(model_dir, tokenizer, tmp_path, loss_type, beta):
    options = dict(loss_type=loss_type, beta=beta, epsilon_high=0.28, temperature=0.9)
    stock = _trainer(trl.GRPOTrainer, model_dir, tokenizer, tmp_path / "stock", **options)
    ours = _trainer(GRPOTrainerWithLogits, model_dir, tokenizer, tmp_path / "ours", **options)
    assert ours._fallback_reason is None

    torch.manual_seed(0)
    inputs = stock._generate_and_score_completions([{"prompt": p} for p in PROMPTS[:2] for _ in range(2)])
    generator = torch.Generator().manual_seed(1)
    shape = inputs["completion_ids"].shape
    inputs["advantages"] = torch.randn(shape[0], generator=generator)
    with torch.no_grad():  # off-policy old log-probs so that clipping happens
        base = stock._get_per_token_logps_and_entropies(
            stock.model, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1), shape[1])[0]
    inputs["old_per_token_logps"] = base + 0.3 * torch.randn(shape, generator=generator)
    if beta:
        inputs["ref_per_token_logps"] = base + 0.2 * torch.randn(shape, generator=generator)

    stock_loss, stock_grads, stock_metrics = _loss_and_grads(stock, inputs)
    our_loss, our_grads, our_metrics = _loss_and_grads(ours, inputs)
    torch.testing.assert_close(our_loss, stock_loss, atol=1e-5, rtol=1e-5)
    assert our_grads.keys() == stock_grads.keys()
    for name in stock_grads:
        torch.testing.assert_close(our_grads[name], stock_grads[name], atol=1e-5, rtol=1e-4, msg=name)
    assert our_metrics.keys() == stock_metrics.keys()
    for name in stock_metrics:
        assert our_metrics[name] == pytest.approx(stock_metrics[name], abs=1e-5, nan_ok=True), name
    assert stock_metrics["clip_ratio/region_mean"] > 0  # the batch does exercise clipping


def test_logit_aware_rewards_during_training(model_dir, tokenizer, tmp_path):
    checks = {"rows": 0, "calls": 0, "forwards_during_reward": []}
    forward_count = [0]

    def reward_with_logits(completions, completion_ids, completion_logits, completion_logprobs, prompts, **kwargs):
        start = forward_count[0]
        body = trainer.accelerator.unwrap_model(trainer.model)
        rows = []
        for i, ids in enumerate(completion_ids):
            assert isinstance(completion_logits[i], CompletionLogits) and len(completion_logits[i]) == len(ids)
            t = random.Random(i).randrange(len(ids))
            row = completion_logits[i][t]  # (V,)
            rows.append((i, t, row))
            # the sampled token's log-prob, and the answer-probability path: a softmax of that one row
            torch.testing.assert_close(completion_logprobs[i][t], torch.log_softmax(row, -1)[ids[t]],
                                       atol=1e-5, rtol=0)

        checks["forwards_during_reward"].append(forward_count[0] - start)  # none: all from captured states

        for i, t, row in rows:  # an independent full forward of the policy over prompt + completion
            prompt_ids = tokenizer(prompts[i])["input_ids"]
            full = torch.tensor([prompt_ids + list(completion_ids[i])])
            with torch.no_grad():
                logits = body(full).logits[0, len(prompt_ids) - 1 + t]
            torch.testing.assert_close(row, logits / 1.0, atol=1e-4, rtol=0)
            # the answer probability, with the answer letter placed at t, against a direct softmax of that row
            letters = choice_token_ids(tokenizer)
            letter_ids = [j for ids_of_letter in letters.values() for j in ids_of_letter]
            forced = [0 if token in letter_ids else token for token in completion_ids[i]]
            forced[t] = letters["B"][1]  # " B"
            assert find_answer_position(forced, tokenizer) == t
            probs = torch.softmax(logits, -1)
            direct = probs[letters["B"]].sum() / probs[letter_ids].sum()
            answer_probability = extract_answer_probability_from_logits(completion_logits[i], forced, tokenizer, "B")
            assert answer_probability == pytest.approx(direct.item(), rel=1e-4)
            checks["rows"] += 1
        checks["calls"] += 1
        return [0.0] * len(completions)

    trainer = _trainer(GRPOTrainerWithLogits, model_dir, tokenizer, tmp_path,
                       reward_funcs=[reward_with_logits, _length_reward], max_steps=2)
    body = getattr(trainer.model, trainer.model.base_model_prefix)
    hook = body.register_forward_hook(lambda *_: forward_count.__setitem__(0, forward_count[0] + 1))
    try:
        trainer.train()
    finally:
        hook.remove()
    assert checks["calls"] == 2 and checks["rows"] == 8
    assert checks["forwards_during_reward"] == [0, 0]
    logged = [entry for entry in trainer.state.log_history if "entropy" in entry]
    assert logged and all(entry["entropy"] > 0 for entry in logged)


@pytest.mark.parametrize("model_fixture", ["model_dir", "softcapped_model_dir"])
def test_completion_views_match_hidden_states(model_fixture, request, tokenizer, tmp_path):
    trainer = _trainer(GRPOTrainerWithLogits, request.getfixturevalue(model_fixture), tokenizer, tmp_path,
                       reward_funcs=[lambda completions, completion_logprobs, **kw: [0.0] * len(completions)],
                       temperature=0.7)
    model = trainer.accelerator.unwrap_model(trainer.model)
    ids = tokenizer(["Say hi.", "Count to three:"], return_tensors="pt", padding=True)["input_ids"]
    hidden = final_hidden_states(model, ids)  # (2, L, H): as if captured step by step
    trainer._completion_hidden = [hidden[:, k] for k in range(hidden.shape[1])]
    lengths = [3, hidden.shape[1]]
    views, log_probs = trainer.completion_views([ids[0, 1:4].tolist(), ids[1, 1:].tolist() + [0]])
    assert [len(v) for v in views] == lengths
    with torch.no_grad():
        expected = model(ids).logits[1] / 0.7  # the model's own head (soft cap included)
    torch.testing.assert_close(views[1][: lengths[1]], expected, atol=1e-5, rtol=0)
    targets = ids[1, 1:].tolist() + [0]
    torch.testing.assert_close(log_probs[1], torch.log_softmax(expected, -1)[torch.arange(lengths[1]), targets],
                               atol=1e-5, rtol=0)


def test_logit_rewards_refuse_generation_paths_without_capture(model_dir, tokenizer, tmp_path):
    def wants_logits(completions, completion_logits, **kwargs):
        return [0.0] * len(completions)

    with pytest.raises(NotImplementedError, match="continuous batching"):
        _trainer(GRPOTrainerWithLogits, model_dir, tokenizer, tmp_path, reward_funcs=wants_logits,
                 use_transformers_continuous_batching=True)


def test_unsupported_options_fall_back_to_trl(model_dir, tokenizer, tmp_path):
    trainer = _trainer(GRPOTrainerWithLogits, model_dir, tokenizer, tmp_path, loss_type="cispo")
    assert "cispo" in trainer._fallback_reason
    trainer = _trainer(GRPOTrainerWithLogits, model_dir, tokenizer, tmp_path, top_entropy_quantile=0.5)
    assert "top_entropy_quantile" in trainer._fallback_reason
    trainer = _trainer(GRPOTrainerWithLogits, model_dir, tokenizer, tmp_path)
    assert trainer._why_not_fused() is None
    trainer.is_fsdp_enabled = True  # what accelerate sets under FSDP: the head's weight is a shard
    assert trainer._why_not_fused() == "FSDP shards the LM head"


def test_cast_lm_head_to_fp32_with_bf16_model_and_logit_rewards(model_dir, tokenizer, tmp_path):
    # hidden states captured from a bf16 body meet the head TRL cast to fp32: one dtype for views and log-probs
    seen = []

    def reward(completions, completion_ids, completion_logits, completion_logprobs, **kwargs):
        for i, ids in enumerate(completion_ids):
            row = completion_logits[i][0]
            seen.append(abs(torch.log_softmax(row, -1)[ids[0]].item() - completion_logprobs[i][0].item()))
        return [0.0] * len(completions)

    trainer = _trainer(GRPOTrainerWithLogits, model_dir, tokenizer, tmp_path, reward_funcs=reward, bf16=True,
                       cast_lm_head_to_fp32=True, model_init_kwargs={"dtype": torch.bfloat16})
    trainer.train()
    assert len(seen) == 4 and max(seen) < 1e-5
