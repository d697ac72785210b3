"""GRPOTrainerWithLogits against stock TRL GRPOTrainer, and its logit-aware rewards, on the tiny Qwen2 (CPU)."""

import contextlib
import random

import pytest
import torch

trl = pytest.importorskip("trl")
from datasets import Dataset  # noqa: E402

from logitless.hf import final_hidden_states, lm_head_of  # noqa: E402
from logitless.models import load_model_and_tokenizer, save_model_and_tokenizer, tiny_qwen2  # noqa: E402
from logitless.ops.lazy import CompletionLogits  # noqa: E402
from logitless.multichoice.answer import extract_answer_probability_from_logits, find_answer_position  # noqa: E402
from logitless.multichoice.letters import choice_token_ids  # noqa: E402
from logitless.trl import GRPOTrainerWithLogits  # noqa: E402
from logitless.trl import lm_head as lm_head_module  # noqa: E402
from logitless.trl.rewards import completion_views  # noqa: E402
from logitless.trl.version import check_trl_version  # noqa: E402

PROMPTS = ["What is 2+2?", "Name a color.", "Say hi.", "Count to three:"]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return str(tiny_model_dir)


def _config(tmp_path, **overrides):
    settings = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, activation_checkpointing=False,
                    per_device_train_batch_size=4, num_generations=2, max_completion_length=8, max_steps=1,
                    logging_steps=1, report_to="none", save_strategy="no", seed=0, disable_dropout=True,
                    learning_rate=1e-3)
    return trl.GRPOConfig(**(settings | overrides))


def _length_reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


def _trainer(cls, model_dir, tokenizer, tmp_path, reward_funcs=_length_reward, trainer_kwargs=None, **overrides):
    return cls(model=model_dir, reward_funcs=reward_funcs, args=_config(tmp_path, **overrides),
               train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tokenizer,
               **(trainer_kwargs or {}))


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
    _assert_one_step_equals_stock_trl(model_dir, tokenizer, tmp_path, dict(loss_type=loss_type, beta=beta))


@pytest.mark.slow
def test_softcapped_model_equals_stock_trl(softcapped_model_dir, tokenizer, tmp_path):
    _assert_one_step_equals_stock_trl(softcapped_model_dir, tokenizer, tmp_path, dict(loss_type="dapo", beta=0.04))


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
def test_bf16_mixed_precision_equals_stock_trl(model_dir, tokenizer, tmp_path, model_dtype):
    # GRPOConfig's default bf16=True: autocast around the body, whose output accelerate hands back in fp32.
    # The head must run under the same autocast as TRL's old/reference log-probs: on policy, KL exactly 0.
    options = dict(bf16=True, beta=0.04, num_iterations=2, model_init_kwargs={"dtype": model_dtype})
    stock = _trainer(trl.GRPOTrainer, model_dir, tokenizer, tmp_path / "stock", **options)
    ours = _trainer(GRPOTrainerWithLogits, model_dir, tokenizer, tmp_path / "ours", **options)
    assert ours.lm_head_path == "logitless" and ours.model.dtype == model_dtype
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


def _with_tool_mask(inputs):
    mask = torch.ones_like(inputs["completion_mask"])
    mask[:, 1:3] = 0  # two tool-result tokens per completion: attended to, not trained on
    return inputs | {"tool_mask": mask}


def _with_vllm_ratios(inputs):
    ratio = torch.rand(inputs["completion_ids"].shape, generator=torch.Generator().manual_seed(3)) + 0.5
    return inputs | {"importance_sampling_ratio": ratio}


def _vllm_correction(trainer):  # as TRL sets it for vLLM generation (no vLLM server on this machine)
    trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True


def _no_vllm_correction(trainer):
    trainer.use_vllm, trainer.vllm_importance_sampling_correction = False, False


def _lora(**extra):
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False, **extra)


# setup: (GRPOConfig options, trainer keyword arguments, inputs edit, trainer edit, and a way to undo the option
# on ours (trainer edit, inputs edit) that must change the loss, or None where the setup is no option of the loss)
SETUPS = {
    "grpo": (dict(loss_type="grpo"), {}, None, None, (lambda t: setattr(t, "epsilon_high", 10.0), None)),
    "dapo_beta": (dict(loss_type="dapo", beta=0.04), {}, None, None, (lambda t: setattr(t, "beta", 0.0), None)),
    "cispo": (dict(loss_type="cispo", epsilon_high=1.1), {}, None, None,
              (lambda t: setattr(t, "loss_type", "dapo"), None)),
    "sapo": (dict(loss_type="sapo"), {}, None, None, (lambda t: setattr(t, "loss_type", "grpo"), None)),
    "vespo": (dict(loss_type="vespo"), {}, None, None, (lambda t: setattr(t, "loss_type", "dapo"), None)),
    "luspo": (dict(loss_type="luspo", importance_sampling_level="sequence"), {}, None, None,
              (lambda t: setattr(t, "loss_type", "grpo"), None)),
    "sequence_level": (dict(importance_sampling_level="sequence"), {}, None, None,
                       (lambda t: setattr(t, "importance_sampling_level", "token"), None)),
    "top_entropy_quantile": (dict(top_entropy_quantile=0.5), {}, None, None,
                             (lambda t: setattr(t, "top_entropy_quantile", 1.0), None)),
    "off_policy_mask": (dict(off_policy_mask_threshold=0.01), {}, None, None,
                        (lambda t: setattr(t, "off_policy_mask_threshold", None), None)),
    "entropy_bonus": (dict(entropy_coef=0.5), {}, None, None,
                      (lambda t: setattr(t, "_entropy_bonus_enabled", False), None)),
    "vllm_is_correction": (dict(loss_type="bnpo"), {}, _with_vllm_ratios, _vllm_correction,
                           (_no_vllm_correction, None)),
    "tool_mask": (dict(loss_type="bnpo"), {}, _with_tool_mask, None,
                  (None, lambda inputs: {k: v for k, v in inputs.items() if k != "tool_mask"})),
    "lora": (dict(beta=0.04), dict(peft_config=_lora), None, None, None),
}


@pytest.mark.slow
@pytest.mark.parametrize("setup", SETUPS)
def test_every_loss_option_runs_fused_and_equals_stock_trl(model_dir, tokenizer, tmp_path, setup):
    options, trainer_kwargs, edit_inputs, edit_trainer, undo = SETUPS[setup]
    _assert_one_step_equals_stock_trl(model_dir, tokenizer, tmp_path, options, trainer_kwargs, edit_inputs,
                                      edit_trainer, undo)


def test_lora_with_a_trained_head_copy_equals_stock_trl(untied_model_dir, tokenizer, tmp_path):
    grads = _assert_one_step_equals_stock_trl(untied_model_dir, tokenizer, tmp_path, dict(beta=0.04),
                                              dict(peft_config=lambda: _lora(modules_to_save=["lm_head"])))
    head_grads = [name for name in grads if "lm_head.modules_to_save" in name]
    assert head_grads and not any("original_module" in name for name in grads)  # the active copy trains


def test_moe_router_aux_loss_equals_stock_trl(moe_model_dir, tokenizer, tmp_path):
    _assert_one_step_equals_stock_trl(moe_model_dir, tokenizer, tmp_path, dict(router_aux_loss_coef=0.5), {}, None,
                                      None, (lambda t: setattr(t, "aux_loss_enabled", False), None))


@pytest.fixture(scope="module")
def untied_model_dir(tmp_path_factory, tokenizer):
    return str(save_model_and_tokenizer(tiny_qwen2(seed=0, tie_word_embeddings=False), tokenizer,
                                        tmp_path_factory.mktemp("untied")))


@pytest.fixture(scope="module")
def moe_model_dir(tmp_path_factory, tokenizer):
    """A one-layer Qwen2-MoE (4 experts, 2 per token). Its router logits are asked for by TRL when it scores (with
    output_router_logits in the config, transformers 5.24 fails to generate from a left-padded batch)."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen2MoeForCausalLM(Qwen2MoeConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        num_experts=4, num_experts_per_tok=2, output_router_logits=False, router_aux_loss_coef=0.01,
        tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None))
    return str(save_model_and_tokenizer(model, tokenizer, tmp_path_factory.mktemp("moe")))


def _assert_one_step_equals_stock_trl(model_dir, tokenizer, tmp_path, options, trainer_kwargs=None, edit_inputs=None,
                                      edit_trainer=None, undo=None):
    """One step of ours equals stock TRL's (loss, every gradient, every metric) on the same off-policy batch, through
    logitless's op and never the policy's lm_head; ``undo`` (trainer edit, inputs edit) must change our loss."""
    options = dict(epsilon_high=0.28, temperature=0.9) | options
    trainers = {}
    for name, cls in (("stock", trl.GRPOTrainer), ("ours", GRPOTrainerWithLogits)):
        built = {key: value() if callable(value) else value for key, value in (trainer_kwargs or {}).items()}
        torch.manual_seed(0)  # the same LoRA initialization for both
        trainers[name] = _trainer(cls, model_dir, tokenizer, tmp_path / name, trainer_kwargs=built, **options)
    stock, ours = trainers["stock"], trainers["ours"]
    assert ours.lm_head_path == "logitless"

    torch.manual_seed(0)
    inputs = stock._generate_and_score_completions([{"prompt": p} for p in PROMPTS[:2] for _ in range(2)])
    generator = torch.Generator().manual_seed(1)
    shape = inputs["completion_ids"].shape
    advantages = torch.randn(shape[0], generator=generator)
    inputs["advantages"] = advantages - advantages.mean()  # both signs
    with torch.no_grad():  # off-policy old log-probs so that clipping happens
        base = stock._get_per_token_logps_and_entropies(
            stock.model, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1), shape[1])[0]
    inputs["old_per_token_logps"] = base + 0.3 * torch.randn(shape, generator=generator)
    inputs["sampling_per_token_logps"] = base + 0.3 + 0.1 * torch.randn(shape, generator=generator)
    if options.get("beta"):
        inputs["ref_per_token_logps"] = base + 0.2 * torch.randn(shape, generator=generator)
    if edit_inputs:
        inputs = edit_inputs(inputs)
    for trainer in trainers.values():
        if edit_trainer:
            edit_trainer(trainer)

    stock_loss, stock_grads, stock_metrics = _loss_and_grads(stock, inputs)
    with _fused_op_calls() as calls, _lm_head_forbidden(ours):
        our_loss, our_grads, our_metrics = _loss_and_grads(ours, inputs)
    assert calls and all(count > 0 for count in calls)  # logitless's op scored every token of the batch
    torch.testing.assert_close(our_loss, stock_loss, atol=1e-6, rtol=1e-5)
    assert our_grads.keys() == stock_grads.keys()
    for name in stock_grads:
        scale = stock_grads[name].abs().max().item()
        torch.testing.assert_close(our_grads[name], stock_grads[name], atol=1e-5 * max(scale, 1e-3), rtol=1e-5,
                                   msg=name)
    assert our_metrics.keys() == stock_metrics.keys()
    for name in stock_metrics:
        assert our_metrics[name] == pytest.approx(stock_metrics[name], rel=1e-5, abs=1e-7, nan_ok=True), name
    if undo is not None:
        undo_trainer, undo_inputs = undo
        if undo_trainer:
            undo_trainer(ours)
        without_option = _loss_and_grads(ours, undo_inputs(inputs) if undo_inputs else inputs)[0]
        assert abs(without_option.item() - our_loss.item()) > 1e-4 * max(1.0, abs(our_loss.item()))
    return our_grads


@contextlib.contextmanager
def _fused_op_calls():
    """Counts the tokens each call of logitless's fused op scores inside the LM-head seam."""
    calls = []
    real = lm_head_module.linear_token_stats

    def counted(hidden, *args, **kwargs):
        calls.append(hidden.shape[0])
        return real(hidden, *args, **kwargs)

    lm_head_module.linear_token_stats = counted
    try:
        yield calls
    finally:
        lm_head_module.linear_token_stats = real


@contextlib.contextmanager
def _lm_head_forbidden(trainer):
    def refuse(*_):
        raise AssertionError("the policy's lm_head was called during training")

    handle = trainer.model.get_output_embeddings().register_forward_pre_hook(refuse)
    try:
        yield
    finally:
        handle.remove()


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
    passes = [e["logitless/reward_body_passes"] for e in trainer.state.log_history
              if "logitless/reward_body_passes" in e]
    assert passes == [0.0, 0.0]  # the rows came from the hidden states generate computed
    logged = [entry for entry in trainer.state.log_history if "entropy" in entry]
    assert logged and all(entry["entropy"] > 0 for entry in logged)


@pytest.mark.parametrize("model_fixture", ["model_dir", "softcapped_model_dir"])
def test_completion_views_match_the_models_logits(model_fixture, request, tokenizer):
    """In fp64, so that the two forwards of the body (one for the hidden states, one for the model's own logits)
    agree to far below the tolerance whatever thread count the BLAS picks (in fp32 a loaded machine changed it
    between the two, and the soft-capped rows differed by 1.7e-5)."""
    model = load_model_and_tokenizer(request.getfixturevalue(model_fixture))[0].double()
    ids = tokenizer(["Say hi.", "Count to three:"], return_tensors="pt", padding=True)["input_ids"]
    hidden = final_hidden_states(model, ids)  # (2, L, H): row t scores token t + 1
    completions = [ids[0, 1:4].tolist(), ids[1, 1:].tolist() + [0]]
    views, log_probs = completion_views(hidden, completions, lm_head_of(model, 0.7))
    assert [len(v) for v in views] == [3, hidden.shape[1]]
    with torch.no_grad():
        expected = model(ids).logits[1] / 0.7  # the model's own head (soft cap included)
    assert views[1][:].dtype == torch.float64
    torch.testing.assert_close(views[1][:], expected, atol=1e-10, rtol=0)
    torch.testing.assert_close(log_probs[1], torch.log_softmax(expected, -1)[torch.arange(len(views[1])),
                                                                             completions[1]], atol=1e-10, rtol=0)


ROLLOUT_PROMPT = [9707, 11, 1879]  # "Hello, world"


def _random_rollout(prompts, trainer):
    """A rollout_func standing in for an external generator: fixed prompt tokens, random completion tokens."""
    generator = torch.Generator().manual_seed(trainer.state.global_step)
    completion_ids = [torch.randint(0, 151000, (int(torch.randint(2, 7, (1,), generator=generator)),),
                                    generator=generator).tolist() for _ in prompts]
    return {"prompt_ids": [ROLLOUT_PROMPT] * len(prompts), "completion_ids": completion_ids,
            "logprobs": [[-1.0] * len(ids) for ids in completion_ids]}


@pytest.mark.parametrize("old_pass", [False, True])
@pytest.mark.parametrize("peft, beta", [(False, 0.0), (True, 0.0), (True, 0.04)])
def test_completion_logits_with_a_rollout_func(model_dir, tokenizer, tmp_path, old_pass, peft, beta):
    """No transformers generate: the rows come from TRL's old-log-prob pass when it runs before the rewards (no extra
    work), else from one no-grad body pass, counted in logitless/reward_body_passes. With PEFT and beta > 0, TRL
    scores the reference through the same model with its adapters off: those rows are not the policy's."""
    seen = []

    def reward(completions, completion_ids, completion_logits, completion_logprobs, **kwargs):
        policy = trainer.accelerator.unwrap_model(trainer.model)  # the PEFT model, adapters on, when peft
        for i, ids in enumerate(completion_ids):
            t = random.Random(i).randrange(len(ids))
            with torch.no_grad():
                logits = policy(input_ids=torch.tensor([ROLLOUT_PROMPT + list(ids)])).logits[0]
            row = logits[len(ROLLOUT_PROMPT) - 1 + t] / trainer.temperature
            torch.testing.assert_close(completion_logits[i][t], row, atol=1e-4, rtol=0)
            torch.testing.assert_close(completion_logprobs[i][t], torch.log_softmax(row, -1)[ids[t]], atol=1e-4, rtol=0)
            seen.append(t)
        return [float(len(ids)) for ids in completion_ids]

    options = (dict(num_iterations=2) if old_pass else {}) | dict(beta=beta)
    trainer_kwargs = dict(rollout_func=_random_rollout) | (dict(peft_config=_lora()) if peft else {})
    trainer = _trainer(GRPOTrainerWithLogits, model_dir, tokenizer, tmp_path, reward_funcs=reward,
                       trainer_kwargs=trainer_kwargs, max_steps=2, temperature=0.8, **options)
    assert trainer.old_pass_before_rewards == old_pass
    trainer.train()
    assert len(seen) == (4 if old_pass else 8)  # with num_iterations=2, one generation serves both steps
    passes = [entry["logitless/reward_body_passes"] for entry in trainer.state.log_history
              if "logitless/reward_body_passes" in entry]
    assert passes and set(passes) == {0.0 if old_pass else 1.0}


def test_a_zero3_partitioned_head_is_gathered_before_it_is_read_in_forward_and_in_backward(monkeypatch):
    """Under ZeRO-3 the output embedding's weight holds no rows outside TRL's gather context (here: emptied when the
    forward's context exits, as ZeRO-3 does): the fused forward, its backward and the rewards' head read it inside."""
    model = tiny_qwen2(seed=0, tie_word_embeddings=False)  # the body never reads the head's weight
    lm_head_module.add_logitless_lm_head(model, outputs=("log_probs", "entropy"))
    weight = model.lm_head.weight
    rows = weight.data
    weight.ds_status = "partitioned"  # what marks a ZeRO-3 parameter
    weight.data = torch.empty(0)
    entered = []

    @contextlib.contextmanager
    def partitioned_gather(*params):
        in_backward = torch._C._current_graph_task_id() != -1
        entered.append(("backward" if in_backward else "forward", params == (weight,)))
        weight.data = rows
        yield
        if not in_backward:
            weight.data = torch.empty(0)

    monkeypatch.setattr(lm_head_module, "maybe_gather_lm_head_ctx", partitioned_gather)
    input_ids = torch.randint(0, 1000, (2, 6))
    output = model(input_ids=input_ids, labels=input_ids, fused_lm_head=True)
    assert entered == [("forward", True)] and weight.numel() == 0
    (output.log_probs.sum() + output.entropy.sum()).backward()
    assert entered == [("forward", True), ("backward", True)] and weight.grad.shape == rows.shape
    weight.data = torch.empty(0)
    assert lm_head_module.detached_head(model, 1.0).weight.shape == rows.shape and weight.numel() == 0


def test_an_all_masked_batch_gives_zero_gradients(tiny_model):
    head = lm_head_of(tiny_model)
    hidden = torch.randn(2, 3, head.hidden_size, requires_grad=True)
    labels = torch.full((2, 3), -100)
    fields = lm_head_module.token_fields(head, hidden, labels, labels != -100, ("log_probs", "is_top1"))
    assert fields["entropy"] is None and not fields["is_top1"].any()
    fields["log_probs"].sum().backward()
    assert torch.equal(hidden.grad, torch.zeros_like(hidden))


def test_what_the_seam_cannot_compute_is_refused(tiny_model):
    with pytest.raises(NotImplementedError, match="outputs: .*'logits'"):
        lm_head_module.add_logitless_lm_head(tiny_model, outputs=("log_probs", "logits"))
    with pytest.raises(ImportError, match=r"TRL >=1.16,<1.17, found 1.17.0"):
        check_trl_version("1.17.0")
    check_trl_version("1.16.2")


def test_lora_on_the_lm_head_is_refused_and_a_frozen_head_gets_no_gradient(model_dir, tokenizer, tmp_path):
    from peft import LoraConfig

    with pytest.raises(ValueError, match="lm_head"):
        _trainer(GRPOTrainerWithLogits, model_dir, tokenizer, tmp_path,
                 trainer_kwargs=dict(peft_config=LoraConfig(r=4, target_modules=["lm_head", "q_proj"])))
    trainer = _trainer(GRPOTrainerWithLogits, model_dir, tokenizer, tmp_path / "lora",
                       trainer_kwargs=dict(peft_config=_lora()))
    lora = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}
    trainer.train()
    head = trainer.model.get_output_embeddings().weight
    assert not head.requires_grad and head.grad is None  # no dW was computed for the frozen head
    assert any(not torch.equal(p, lora[n]) for n, p in trainer.model.named_parameters() if n in lora)


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
