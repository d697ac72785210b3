"""The reference gradients of GRADE's objective (`logitless.grade.gradients`), and GRADE's minibatch gradients
approaching the exact one."""

import pytest
import torch

from grade_helpers import ByteTokenizer, byte_model
from logitless.grade import GradeConfig, GRPOBaseline, GumbelTrainerMemoryEfficient, TokenSetReward
from logitless.grade.gradients import exact_reward_gradient, flat_gradient
from logitless.grade.soft_tokens import PromptBatch, as_records
from logitless.grade.trainer import microbatch_generator


def test_exact_reference_gradient_for_one_token_completions():
    """For T = 1 and a linear reward, the reference is autograd through the softmax: check it on a tiny policy."""
    policy = byte_model(seed=3)
    prompts = PromptBatch.from_records(as_records(["ab", "xyz"]), ByteTokenizer())
    got = exact_reward_gradient(policy, TokenSetReward([97, 98]), prompts)
    # E[r] = mean over prompts of p(a) + p(b), straight from the model's logits
    logits = policy(input_ids=prompts.input_ids, attention_mask=prompts.attention_mask,
                    position_ids=(prompts.attention_mask.cumsum(-1) - 1).clamp(min=0)).logits[:, -1]
    (-torch.softmax(logits, -1)[:, [97, 98]].sum(-1).mean()).backward()
    expected = torch.cat([p.grad.flatten() for p in policy.parameters()])
    torch.testing.assert_close(got, expected)


@pytest.mark.slow
def test_grade_gradient_converges_to_the_exact_gradient_faster_than_grpo():
    """One-token completions on a 263-token vocabulary, where the exact gradient of E[reward] is known: the
    mean of GRADE's minibatch gradients approaches it (up to the relaxation's bias), and faster than GRPO's."""
    policy, tokenizer, reward = byte_model(seed=0), ByteTokenizer(), TokenSetReward(list(range(97, 123)))
    texts = ["ab", "xy", "hello", "Q:"]
    exact = exact_reward_gradient(policy, reward, PromptBatch.from_records(as_records(texts), tokenizer))
    minibatch = PromptBatch.from_records(as_records(texts * 2), tokenizer)
    cosines = {}
    for name, trainer_class in (("gumbel", GumbelTrainerMemoryEfficient), ("grpo", GRPOBaseline)):
        config = GradeConfig(gumbel_topk=16, max_new_tokens=1, batch_size=8, kl_coef=0.0, tau_start=0.7, tau_end=0.7,
                             grpo_group_size=2)
        trainer = trainer_class(policy, reward, config, tokenizer=tokenizer)
        total = 0
        for index in range(50):
            trainer.microbatch(minibatch, None, microbatch_generator(1, 0, index, "cpu"))
            total = total + flat_gradient(trainer.parameters)
        cosines[name] = float(torch.nn.functional.cosine_similarity(total, exact, dim=0))
    assert cosines["gumbel"] > 0.7 and cosines["gumbel"] > cosines["grpo"] > 0, cosines
