"""The memory-efficient GRADE trainer against the legacy one, and the KV-cached rollout against re-reading
the prefix: same noise, exact comparisons (fp32)."""

import pytest
import torch

from logitless.grade import GradeConfig, GumbelTrainer, GumbelTrainerMemoryEfficient, TokenLogProbReward
from logitless.grade.legacy import dense_rollout
from logitless.grade.parts import CausalLMParts
from logitless.grade.rewards import RewardInputs
from logitless.grade.rollout import NoiseStream, sparse_rollout
from logitless.grade.soft_tokens import PromptBatch, as_records
from logitless.grade.steppers import CachedStepper, PrefixStepper
from logitless.ops.gumbel import gumbel_noise

from grade_helpers import BYTE_VOCAB, ByteTokenizer, byte_model

PROMPTS = ["Tell me a story:", "Hi", "The answer is", "2 + 2 ="]
HELD_OUT = ["Once", "A cat", "Why is", "Hello there", "Good"]  # never trained on; 5: a last, partial batch


@pytest.fixture
def tokenizer():
    return ByteTokenizer()


def _models():
    return byte_model(seed=0), byte_model(seed=1), byte_model(seed=2)


def _noise(batch, steps, seed):
    return gumbel_noise((batch, steps, BYTE_VOCAB), generator=torch.Generator().manual_seed(seed))


@pytest.mark.slow
@pytest.mark.parametrize("straight_through", [False, True])
def test_efficient_with_full_vocabulary_equals_legacy_over_three_steps(tokenizer, straight_through):
    config = GradeConfig(straight_through=straight_through, gumbel_topk=BYTE_VOCAB, max_new_tokens=3, batch_size=2,
                         gradient_accumulation_steps=2, kl_coef=0.5, tau_start=0.9, tau_end=0.5, tau_anneal_steps=2,
                         max_grad_norm=1e6)
    trainers, grads = [], []
    for trainer_class in (GumbelTrainer, GumbelTrainerMemoryEfficient):
        policy, reference, reward_model = _models()
        reward = TokenLogProbReward(reward_model, tokenizer, token="y", suffix=" Good?")
        trainer = trainer_class(policy, reward, config, tokenizer=tokenizer, reference=reference,
                                optimizer=torch.optim.SGD(policy.parameters(), lr=0.5))
        captured = []
        trainer.optimizer.register_step_pre_hook(
            lambda opt, *_, out=captured: out.append([p.grad.clone() for p in opt.param_groups[0]["params"]]))
        trainers.append(trainer)
        grads.append(captured)
    before = [trainer.evaluate(HELD_OUT, seed=7) for trainer in trainers]
    for step in range(3):
        noise = _noise(4, 3, seed=step)
        legacy, efficient = (trainer.train_step(PROMPTS, noise=noise) for trainer in trainers)
        for name in ("loss", "reward", "kl", "grad_norm", "tau", "max_soft_weight"):
            assert efficient[name] == pytest.approx(legacy[name], abs=1e-4, rel=1e-4), (step, name)
        assert legacy["kl"] > 1e-3  # the KL is really in play (a reference that differs from the policy)
        assert efficient["topk_tail_mass"] == pytest.approx(0.0, abs=1e-6)
        for legacy_grad, efficient_grad in zip(*(g[step] for g in grads)):
            torch.testing.assert_close(efficient_grad, legacy_grad, atol=1e-4, rtol=1e-4)
    for legacy_param, efficient_param in zip(trainers[0].parameters, trainers[1].parameters):
        torch.testing.assert_close(efficient_param, legacy_param, atol=1e-4, rtol=1e-4)
    # the held-out score (sampled hard completions, the same reward) is the same for both
    legacy_score, efficient_score = (trainer.evaluate(HELD_OUT, seed=7) for trainer in trainers)
    assert efficient_score == pytest.approx(legacy_score, abs=1e-4) and before[0] == pytest.approx(before[1])


def test_evaluate_scores_the_current_policys_samples_with_fixed_noise(tokenizer):
    policy, reference, reward_model = _models()
    reward = TokenLogProbReward(reward_model, tokenizer, token="y", suffix=" Good?")
    trainer = GumbelTrainerMemoryEfficient(policy, reward, GradeConfig(gumbel_topk=8, max_new_tokens=3, batch_size=2),
                                           tokenizer=tokenizer, reference=reference)
    score = trainer.evaluate(HELD_OUT, seed=7)
    assert trainer.evaluate(HELD_OUT, seed=7) == score  # the same noise: the same samples
    assert trainer.evaluate(HELD_OUT, seed=8) != score  # other noise: other samples
    with torch.no_grad():
        policy.lm_head.weight.mul_(-3.0)  # another policy: other samples under the same noise
    assert trainer.evaluate(HELD_OUT, seed=7) != score


def _rollout_loss(tokenizer, rollout_fn, seed=3):
    policy, reference, reward_model = _models()
    parts, reference_parts = CausalLMParts.of(policy, "policy"), CausalLMParts.of(reference, "reference")
    reward = TokenLogProbReward(reward_model, tokenizer, token="y")
    prompt = PromptBatch.from_records(as_records(PROMPTS), tokenizer)
    noise = NoiseStream(_noise(4, 5, seed), None, 4, BYTE_VOCAB, "cpu")
    rollout = rollout_fn(parts, reference_parts, prompt, noise)
    loss = (-reward(RewardInputs(prompt, rollout.completion)) + 0.3 * rollout.kl).mean()
    return loss, rollout, torch.autograd.grad(loss, list(policy.parameters()))


@pytest.mark.parametrize("checkpointing", [True, False])
def test_kv_cached_rollout_equals_full_prefix_recompute(tokenizer, checkpointing):
    options = dict(steps=5, k=7, tau=0.7, hard=False)
    cached = _rollout_loss(tokenizer, lambda *a: sparse_rollout(*a, **options, checkpointing=checkpointing,
                                                                 stepper_class=CachedStepper))
    recomputed = _rollout_loss(tokenizer, lambda *a: sparse_rollout(*a, **options, stepper_class=PrefixStepper))
    torch.testing.assert_close(cached[0], recomputed[0], atol=1e-5, rtol=1e-5)
    assert torch.equal(cached[1].completion.indices, recomputed[1].completion.indices)
    for got, expected in zip(cached[2], recomputed[2]):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert max(float(g.abs().max()) for g in cached[2]) > 1e-4  # gradients flow through the cache


def test_online_fused_kl_equals_kl_from_stored_logits(tokenizer):
    online = _rollout_loss(tokenizer, lambda *a: sparse_rollout(*a, steps=5, k=BYTE_VOCAB, tau=0.8, hard=False))
    stored = _rollout_loss(tokenizer, lambda *a: dense_rollout(*a, steps=5, tau=0.8, hard=False))
    torch.testing.assert_close(online[1].kl, stored[1].kl, atol=1e-5, rtol=1e-5)
    assert bool((stored[1].kl > 0).all())
