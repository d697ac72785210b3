"""GradeConfig, rewards scored from soft embeddings, the GRPO baseline, and bad input."""

import math

import pytest
import torch
from transformers import Qwen2ForSequenceClassification

from logitless.grade import (GradeConfig, GRPOBaseline, GumbelTrainer, GumbelTrainerMemoryEfficient,
                             MultichoiceJudgeReward, RewardInputs, SequenceClassifierReward, SoftTokens,
                             TokenLogProbReward, TokenSetReward, METRIC_NAMES)
from logitless.grade.soft_tokens import PromptBatch, as_records
from logitless.models import tiny_qwen2, tiny_qwen2_config
from logitless.nonfinite import NonFiniteError
from logitless.multichoice.judge import MultichoiceJudge

from grade_helpers import BYTE_VOCAB, ByteTokenizer, SMALL, byte_model

BYTES = ByteTokenizer()
PROMPTS = ["Hi there", "Why?", "A", "Count: 1 2"]


def _prompt(tokenizer=BYTES, prompts=PROMPTS):
    return PromptBatch.from_records(as_records(prompts), tokenizer)


def _random_sparse(batch, steps, k, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    indices = torch.stack([torch.randperm(vocab, generator=g)[:k] for _ in range(batch * steps)]).view(batch, steps, k)
    weights = torch.softmax(torch.randn(batch, steps, k, generator=g), dim=-1).requires_grad_(True)
    return SoftTokens(weights, indices)


def _dense_of(sparse, vocab):
    dense = torch.zeros(*sparse.indices.shape[:-1], vocab).scatter(-1, sparse.indices, sparse.weights.detach())
    return SoftTokens(dense.requires_grad_(True))


def test_tau_anneals_geometrically_and_config_errors_name_the_field():
    config = GradeConfig(tau_start=1.0, tau_end=0.25, tau_anneal_steps=4)
    assert [config.tau_at(s) for s in (0, 2, 4, 9)] == pytest.approx([1.0, 0.5, 0.25, 0.25])
    assert GradeConfig(tau_anneal_steps=0, tau_end=0.3).tau_at(0) == pytest.approx(0.3)
    for field, value in [("gumbel_topk", 0), ("tau_start", 0.0), ("tau_end", -1.0), ("max_new_tokens", 0),
                         ("straight_through", "yes"), ("kl_coef", -0.1), ("batch_size", 0), ("learning_rate", 0),
                         ("learning_rate", math.inf), ("tau_start", math.nan), ("on_nonfinite", "ignore"),
                         ("tau_anneal_steps", -1), ("gradient_accumulation_steps", 1.5), ("kl_coef", math.inf),
                         ("seed", -1), ("lora_rank", True), ("lora_alpha", math.inf)]:
        with pytest.raises((ValueError, TypeError), match=f"^{field}:"):
            GradeConfig(**{field: value})
    with pytest.raises(ValueError, match="config: unknown key"):
        GradeConfig.from_dict({"topk": 3})


def test_token_set_reward_is_the_fraction_of_tokens_in_the_set():
    reward = TokenSetReward([3, 5])
    hard = SoftTokens.hard(torch.tensor([[3, 4, 5, 6], [1, 1, 1, 5]]))
    assert reward(RewardInputs(None, hard)).tolist() == [0.5, 0.25]
    sparse = _random_sparse(2, 3, 4, 9)
    torch.testing.assert_close(reward(RewardInputs(None, sparse)), reward(RewardInputs(None, _dense_of(sparse, 9))))
    with pytest.raises(ValueError, match="token_ids"):
        TokenSetReward([])
    repeated = TokenSetReward([3, 5, 3])  # a set: the dense and the sparse paths count a repeated id once
    assert repeated(RewardInputs(None, hard)).tolist() == [0.5, 0.25]
    torch.testing.assert_close(repeated(RewardInputs(None, sparse)),
                               repeated(RewardInputs(None, _dense_of(sparse, 9))))
    with pytest.raises(ValueError, match="token_ids: token ids are >= 0"):
        TokenSetReward([3, -1])


def test_capitalized_words_reward_on_the_qwen_vocabulary(tokenizer):
    reward = TokenSetReward.capitalized_words(tokenizer)
    ids = tokenizer.encode(" The cat met Paris in London", add_special_tokens=False)
    score = reward(RewardInputs(None, SoftTokens.hard(torch.tensor([ids]))))
    assert [tokenizer.decode([i]) for i in ids] == [" The", " cat", " met", " Paris", " in", " London"]
    assert float(score) == pytest.approx(3 / 6)
    assert 5_000 < len(reward.token_ids) < 20_000


def _check_sparse_equals_dense_and_hard_equals_ids(reward, expected_from_ids):
    prompt = _prompt()
    sparse = _random_sparse(4, 3, 5, BYTE_VOCAB)
    dense = _dense_of(sparse, BYTE_VOCAB)
    got_sparse, got_dense = reward(RewardInputs(prompt, sparse)), reward(RewardInputs(prompt, dense))
    torch.testing.assert_close(got_sparse, got_dense, atol=1e-5, rtol=1e-5)
    (grad_sparse,) = torch.autograd.grad(got_sparse.sum(), sparse.weights)
    (grad_dense,) = torch.autograd.grad(got_dense.sum(), dense.weights)
    torch.testing.assert_close(grad_sparse, grad_dense.gather(-1, sparse.indices), atol=1e-5, rtol=1e-5)
    assert grad_sparse.abs().max() > 0
    completion_ids = torch.randint(0, 256, (4, 3), generator=torch.Generator().manual_seed(1))
    hard = reward(RewardInputs(prompt, SoftTokens.hard(completion_ids)))
    torch.testing.assert_close(hard, expected_from_ids(prompt, completion_ids), atol=1e-5, rtol=1e-5)


def test_token_log_prob_reward_from_soft_embeddings():
    model = byte_model(seed=4)
    reward = TokenLogProbReward(model, BYTES, token="y", suffix=" ok?")

    def from_ids(prompt, completion_ids):
        suffix = torch.tensor(BYTES.encode(" ok?")).expand(4, -1)
        ids = torch.cat([prompt.input_ids, completion_ids, suffix], dim=1)
        mask = torch.cat([prompt.attention_mask, torch.ones_like(completion_ids), torch.ones_like(suffix)], dim=1)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
        return torch.log_softmax(logits[:, -1].float(), dim=-1)[:, ord("y")]

    _check_sparse_equals_dense_and_hard_equals_ids(reward, from_ids)
    assert not any(p.requires_grad for p in model.parameters())  # the reward model is frozen


def test_the_token_log_prob_reward_reads_one_token_through_the_heads_fused_op(monkeypatch):
    """No (B, V) log-softmax with a graph to read one column: the head's fused log-prob op scores the token."""
    import logitless.grade.rewards as rewards

    model = byte_model(seed=4)
    reward = TokenLogProbReward(model, BYTES, token="y")
    calls, fused = [], rewards.fused_linear_logprobs
    monkeypatch.setattr(rewards, "fused_linear_logprobs", lambda *a, **k: calls.append(k["targets"]) or fused(*a, **k))
    monkeypatch.setattr(torch, "log_softmax", lambda *a, **k: pytest.fail("a (B, V) log-softmax was built"))
    weights = torch.rand(4, 3, 5, generator=torch.Generator().manual_seed(2)).requires_grad_()
    indices = torch.randint(0, 256, (4, 3, 5), generator=torch.Generator().manual_seed(3))
    value = reward(RewardInputs(_prompt(), SoftTokens(weights.softmax(-1), indices)))
    assert value.shape == (4,) and [ids.tolist() for ids in calls] == [[ord("y")] * 4]
    value.sum().backward()
    assert weights.grad.abs().max() > 0


@pytest.mark.parametrize("pad_token_id", [256, None])  # None: the classifier alone refuses batches above 1
def test_sequence_classifier_reward_from_soft_embeddings(pad_token_id):
    torch.manual_seed(5)
    model = Qwen2ForSequenceClassification(tiny_qwen2_config(vocab_size=BYTE_VOCAB, num_labels=2, pad_token_id=256,
                                                             eos_token_id=256, **SMALL))
    reward = SequenceClassifierReward(model, label=1)

    def from_ids(prompt, completion_ids):
        ids = torch.cat([prompt.input_ids, completion_ids], dim=1)
        mask = torch.cat([prompt.attention_mask, torch.ones_like(completion_ids)], dim=1)
        model.config.pad_token_id = 256  # the reference finds each sequence's end from its pad ids
        logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
        model.config.pad_token_id = pad_token_id
        return logits[:, 1]

    model.config.pad_token_id = pad_token_id
    _check_sparse_equals_dense_and_hard_equals_ids(reward, from_ids)
    assert model.config.pad_token_id == pad_token_id  # the reward leaves the user's config as it was
    with pytest.raises(ValueError, match="label"):
        SequenceClassifierReward(model, label=2)


def test_multichoice_judge_reward_is_differentiable_and_matches_the_judge_on_hard_tokens(tokenizer):
    judge_model = tiny_qwen2(seed=6, hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1)
    judge = MultichoiceJudge(judge_model, tokenizer)
    records = [{"prompt": "Q1", "question": "Which is largest?\nA) 1\nB) 9", "answer": "B"},
               {"prompt": "What is 2 + 2?\nA) 4\nB) 5", "answer": "A"}]
    prompt = PromptBatch.from_records(records, tokenizer)
    reasoning = torch.tensor([tokenizer.encode("Nine is more", add_special_tokens=False)] * 2)
    reward = MultichoiceJudgeReward(judge)
    got = reward(RewardInputs(prompt, SoftTokens.hard(reasoning)))
    expected = []
    for record, question in zip(records, ["Which is largest?\nA) 1\nB) 9", "What is 2 + 2?\nA) 4\nB) 5"]):
        ids = (tokenizer.encode(f"{question}\nReasoning: ") + reasoning[0].tolist()
               + tokenizer.encode("\nANSWER:", add_special_tokens=False))
        logits = judge_model(input_ids=torch.tensor([ids])).logits[0, -1]
        letters = torch.stack([torch.logsumexp(logits[judge.token_ids[letter]], 0) for letter in "ABCD"])
        expected.append(float(torch.softmax(letters, 0)["ABCD".index(record["answer"])]))
    torch.testing.assert_close(got, torch.tensor(expected), atol=1e-5, rtol=1e-4)
    soft = _random_sparse(2, 3, 4, len(tokenizer))
    hidden = MultichoiceJudgeReward(judge, objective="hide")(RewardInputs(prompt, soft))
    (grad,) = torch.autograd.grad(hidden.sum(), soft.weights)
    assert grad.abs().max() > 0 and bool(((hidden > 0) & (hidden < 1)).all())
    with pytest.raises(ValueError, match=r"prompts\[0\]: needs an 'answer'"):
        reward(RewardInputs(PromptBatch.from_records([{"prompt": "x"}], tokenizer), SoftTokens.hard(reasoning[:1])))


def test_grpo_baseline_step_logs_every_metric_and_moves_the_policy():
    policy = byte_model(seed=0)
    before = [p.detach().clone() for p in policy.parameters()]
    config = GradeConfig(max_new_tokens=3, batch_size=4, grpo_group_size=2, learning_rate=1e-2)
    trainer = GRPOBaseline(policy, TokenSetReward(list(range(97, 123))), config, tokenizer=BYTES)  # lowercase bytes
    metrics = trainer.train_step(PROMPTS)
    assert tuple(metrics) == METRIC_NAMES
    assert metrics["tau"] is None and metrics["topk_tail_mass"] is None and 0 <= metrics["reward"] <= 1
    assert metrics["kl"] == pytest.approx(0.0, abs=1e-6)  # the policy is still the reference
    assert any(not torch.equal(a, b) for a, b in zip(before, policy.parameters()))
    assert trainer.train_step(PROMPTS)["kl"] > 0
    with pytest.raises(ValueError, match="grpo_group_size"):
        GRPOBaseline(byte_model(), TokenSetReward([1]), GradeConfig(batch_size=4, grpo_group_size=3), tokenizer=BYTES)


def test_grpo_baseline_gradient_is_the_materialized_grpo_gradient():
    """With the KL penalty off and one update per sample (ratio 1), the baseline's loss is the mean over
    completions of the mean over tokens of -A * log p(token): its gradient, from full logits, must match."""
    from logitless.grade.rollout import sample_tokens
    from logitless.grade.trainer import microbatch_generator
    from logitless.losses import compute_group_normalized_rewards

    config = GradeConfig(max_new_tokens=4, batch_size=4, grpo_group_size=2, kl_coef=0.0)
    reward = TokenSetReward(list(range(97, 123)))
    trainer = GRPOBaseline(byte_model(seed=3), reward, config, tokenizer=BYTES)
    prompt = _prompt()
    trainer.microbatch(prompt, None, microbatch_generator(config.seed, 0, 0, trainer.device))
    got = [p.grad.clone() for p in trainer.policy.model.parameters()]
    trainer.policy.model.zero_grad(set_to_none=True)

    rows = [0, 0, 1, 1]  # the first two prompts, each once per member of its group
    grouped = PromptBatch(prompt.input_ids[rows], prompt.attention_mask[rows], [prompt.records[i] for i in rows])
    completion = sample_tokens(trainer.policy, grouped, 4, microbatch_generator(config.seed, 0, 0, trainer.device))
    rewards = reward(RewardInputs(grouped, SoftTokens.hard(completion))).float()
    assert rewards.std() > 0  # the advantages are not all zero
    advantages, _, _ = compute_group_normalized_rewards(lambda i, _: {"reward": float(rewards[i])}, list(range(4)),
                                                        [None] * 4, 2, advantage_eps=1e-6, normalize_by_std=True)
    sequence = torch.cat([grouped.input_ids, completion], dim=1)
    attention = torch.cat([grouped.attention_mask, torch.ones_like(completion)], dim=1)
    logits = trainer.policy.model(input_ids=sequence[:, :-1], attention_mask=attention[:, :-1]).logits[:, -4:]
    log_probs = torch.log_softmax(logits.float(), dim=-1).gather(-1, completion[..., None]).squeeze(-1)  # (B, T)
    (-(advantages[:, None] * log_probs).mean(dim=1).mean()).backward()
    for mine, want in zip(got, (p.grad for p in trainer.policy.model.parameters())):
        torch.testing.assert_close(mine, want, rtol=1e-4, atol=1e-6)


def test_metrics_of_a_grade_step():
    config = GradeConfig(max_new_tokens=3, batch_size=4, gumbel_topk=5, tau_start=2.0, tau_end=1.0)
    trainer = GumbelTrainerMemoryEfficient(byte_model(), TokenSetReward(list(range(97, 123))), config, tokenizer=BYTES)
    metrics = trainer.train_step(PROMPTS)
    assert tuple(metrics) == METRIC_NAMES and metrics["step"] == 1 and metrics["tau"] == 2.0
    assert 0 < metrics["topk_tail_mass"] < 1 and 1 / 5 <= metrics["max_soft_weight"] <= 1
    assert all(math.isfinite(metrics[name]) for name in ("reward", "kl", "loss", "grad_norm", "step_s", "peak_mb"))


def test_a_rollout_step_runs_no_softmax_over_the_vocabulary(monkeypatch):
    """The top-k and the tail-mass metric share the step's logits buffer: no (B, V) softmax for the metric (the only
    softmax of a step is the relaxed sample's, over the k kept tokens)."""
    config = GradeConfig(max_new_tokens=3, batch_size=4, gumbel_topk=5)
    trainer = GumbelTrainerMemoryEfficient(byte_model(), TokenSetReward(list(range(97, 123))), config, tokenizer=BYTES)
    widths, softmax = [], torch.softmax
    monkeypatch.setattr(torch, "softmax",
                        lambda input, *a, **k: widths.append(input.shape[-1]) or softmax(input, *a, **k))
    metrics = trainer.train_step(PROMPTS)
    assert widths and set(widths) == {5} and 0 < metrics["topk_tail_mass"] < 1


class _PoisonedReward(TokenSetReward):
    """The fraction of lowercase bytes, NaN for the first rollout: a poisoned reward model."""

    def __call__(self, inputs):
        reward = super().__call__(inputs)
        return torch.cat([reward[:1] * math.nan, reward[1:]])


def test_a_non_finite_step_is_never_applied():
    config = GradeConfig(max_new_tokens=2, batch_size=4, gumbel_topk=5, learning_rate=1e-2)
    trainer = GumbelTrainerMemoryEfficient(byte_model(), _PoisonedReward(list(range(97, 123))), config, tokenizer=BYTES)
    before = [p.detach().clone() for p in trainer.parameters]
    with pytest.raises(NonFiniteError, match="^step 1: the loss is nan; stopped before the optimizer step"):
        trainer.train_step(PROMPTS)
    skipping = GumbelTrainerMemoryEfficient(byte_model(), _PoisonedReward(list(range(97, 123))),
                                            GradeConfig(**{**vars(config), "on_nonfinite": "skip"}), tokenizer=BYTES)
    row = skipping.train_step(PROMPTS)
    assert row["skipped"] and row["step"] == 1 and math.isnan(row["grad_norm"])
    for parameters in (trainer.parameters, skipping.parameters):
        assert all(torch.equal(b, p) for b, p in zip(before, parameters))
    assert not GumbelTrainerMemoryEfficient(byte_model(), TokenSetReward([97]), config,
                                            tokenizer=BYTES).train_step(PROMPTS)["skipped"]


class _NoEmbeddings(torch.nn.Module):
    def get_input_embeddings(self):
        return None


@pytest.mark.parametrize("trainer_class", [GumbelTrainer, GumbelTrainerMemoryEfficient, GRPOBaseline])
def test_bad_input_names_the_argument(trainer_class):
    reward = TokenSetReward([97])
    config = GradeConfig(batch_size=2, grpo_group_size=2, gumbel_topk=16)
    with pytest.raises(TypeError, match="^policy: .*no input embeddings"):
        trainer_class(_NoEmbeddings(), reward, config, tokenizer=BYTES)
    too_many = GradeConfig(gumbel_topk=BYTE_VOCAB + 1, batch_size=2, grpo_group_size=2)
    if trainer_class is GumbelTrainerMemoryEfficient:  # the others keep every token: gumbel_topk is not theirs
        with pytest.raises(ValueError, match=f"^gumbel_topk: expected an int in \\[1, {BYTE_VOCAB}\\]"):
            trainer_class(byte_model(), reward, too_many, tokenizer=BYTES)
    else:
        trainer_class(byte_model(), reward, too_many, tokenizer=BYTES)
    other_vocabulary = TokenLogProbReward(byte_model(vocab_size=300), BYTES, token="y")
    with pytest.raises(ValueError, match="^reward_model: its vocabulary has 300 tokens, the policy's 263"):
        trainer_class(byte_model(), other_vocabulary, config, tokenizer=BYTES)
    trainer = trainer_class(byte_model(), reward, config, tokenizer=BYTES)
    with pytest.raises(ValueError, match="^prompts: expected batch_size"):
        trainer.train_step(PROMPTS)
    with pytest.raises(TypeError, match="^prompts"):
        trainer.train_step("one prompt")


def test_lora_trains_only_the_adapters():
    pytest.importorskip("peft")  # peft is in the dev extra; LoRA is optional for users
    policy = byte_model(seed=0)
    base_before = {name: p.detach().clone() for name, p in policy.named_parameters()}
    config = GradeConfig(max_new_tokens=2, batch_size=2, gumbel_topk=5, lora_rank=2, learning_rate=1e-2)
    trainer = GumbelTrainerMemoryEfficient(policy, TokenSetReward(list(range(97, 123))), config, tokenizer=BYTES)
    assert trainer.parameters and all("lora_" in name for name, p in trainer.model.named_parameters()
                                      if p.requires_grad)
    adapters_before = [p.detach().clone() for p in trainer.parameters]
    assert math.isfinite(trainer.train_step(PROMPTS[:2])["loss"])
    assert any(not torch.equal(a, p) for a, p in zip(adapters_before, trainer.parameters))
    for name, p in trainer.policy.model.named_parameters():
        if "lora_" not in name:
            assert torch.equal(p, base_before[name.replace("base_layer.", "")]), name
    with pytest.raises(ValueError, match="^lora_rank"):
        GradeConfig(lora_rank=-1)
