"""VeriFreeTrainer against the paper's objective written out on the model's own materialized logits, its rule for
completions without an answer, its one body pass per training forward, and its options."""

import pytest
import torch

trl = pytest.importorskip("trl")
from datasets import Dataset  # noqa: E402

from logitless.trl import VeriFreeConfig, VeriFreeTrainer  # noqa: E402
from logitless.trl.reference_probability import answer_from_template, covering_tokens  # noqa: E402
from spread_policy import spread_policy  # noqa: E402

FRANCE, SUM = "What is the capital of France?", "2+2?"
REFERENCES = {FRANCE: "Paris", SUM: "4"}
# each prompt's group of 3 completions: (text, ended by EOS)
COMPLETIONS = {FRANCE: [("It is Lyon. ANSWER: Lyon", True), ("Paris, ANSWER: Paris", True),
                        ("I do not know.", True)],  # no answer
               SUM: [("Add. ANSWER: 5", True), ("ANSWER: 4", True),
                     ("Add them up, then say what it is. ANSWER:", False)]}  # at the length limit: see CUT
ANSWER_START, ANSWER_TEMPLATE = "ANSWER:", " {answer}"
CUT = COMPLETIONS[SUM][2][0]  # max_completion_length is its length: replaced, it is longer, so R = 0


def _sampled_ids(tokenizer, text: str, ended: bool) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] + ([tokenizer.eos_token_id] if ended else [])


def _rollout(prompts, trainer):
    """TRL's ``rollout_func``: each prompt's completions of `COMPLETIONS`, in order, without running the model."""
    tokenizer, drawn = trainer.processing_class, {}
    output = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
    for prompt in prompts:
        text, ended = COMPLETIONS[prompt][drawn.setdefault(prompt, 0)]
        drawn[prompt] += 1
        ids = _sampled_ids(tokenizer, text, ended)
        output["prompt_ids"].append(tokenizer(prompt)["input_ids"])
        output["completion_ids"].append(ids)
        output["logprobs"].append([0.0] * len(ids))
    return output


def _trainer(tokenizer, tmp_path, monkeypatch, dtype=torch.float32, **options):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func
    texts = [FRANCE, SUM, *(text for group in COMPLETIONS.values() for text, _ in group), " Paris", " 4"]
    args = VeriFreeConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, num_generations=3,
                          max_completion_length=len(_sampled_ids(tokenizer, CUT, ended=False)),
                          report_to="none", save_strategy="no", logging_steps=1, answer_start=ANSWER_START,
                          answer_template=ANSWER_TEMPLATE, **options)
    dataset = Dataset.from_dict({"prompt": [FRANCE, SUM], "solution": [REFERENCES[FRANCE], REFERENCES[SUM]]})
    return VeriFreeTrainer(model=spread_policy(tokenizer, texts).to(dtype), args=args, train_dataset=dataset,
                           processing_class=tokenizer, rollout_func=_rollout)


def _papers_loss(model, tokenizer, max_completion_length: int) -> torch.Tensor:
    """The paper's code, transcribed: the reasoning is the completion up to its first answer tag (with it), tokenized
    alone, the answer is the template with y* tokenized alone (a completion without the tag: its sampled tokens
    are the reasoning and it has no answer); each sequence's log-probs from its own forward's (T, V) logits
    (log_softmax, gather); R = exp(the answer's summed log-probs), 0 without an answer, for a completion cut before
    a replaced one over the length limit; the RLOO advantage (R - group mean) * n / (n - 1); the loss the
    batch mean of -A * (the reasoning's summed log-probs) - R * (the answer's)."""
    reasoning_terms, answer_terms, rewards = [], [], []
    for prompt, group in COMPLETIONS.items():
        for text, ended in group:
            prompt_ids = tokenizer(prompt)["input_ids"]
            index = text.find(ANSWER_START)
            if index < 0:
                think, answer = _sampled_ids(tokenizer, text, ended), []
            else:
                think = tokenizer(text[:index] + ANSWER_START, add_special_tokens=False)["input_ids"]
                answer = tokenizer(ANSWER_TEMPLATE.format(answer=REFERENCES[prompt]),
                                   add_special_tokens=False)["input_ids"]
            ids = torch.tensor([prompt_ids + think + answer])
            logits = model(input_ids=ids).logits[0]  # (T, V)
            log_probs = torch.log_softmax(logits, dim=-1)[:-1].gather(-1, ids[0, 1:, None])[:, 0]  # (T - 1,)
            start = len(prompt_ids) - 1
            reasoning_terms.append(log_probs[start:start + len(think)].sum())
            answer_terms.append(log_probs[start + len(think):start + len(think) + len(answer)].sum())
            scored = answer and len(think) + len(answer) <= max_completion_length
            rewards.append(answer_terms[-1].detach().exp() if scored else torch.tensor(0.0, dtype=torch.float64))
    rewards = torch.stack(rewards).view(-1, 3)
    advantages = ((rewards - rewards.mean(1, keepdim=True)) * 3 / 2).reshape(-1)
    rewards = rewards.reshape(-1)
    return torch.stack([-a * r - w * s for a, r, w, s in zip(advantages, reasoning_terms, rewards,
                                                             answer_terms)]).mean()


def test_loss_and_gradients_equal_the_papers_objective_from_one_body_pass(tokenizer, tmp_path, monkeypatch):
    """One batch of two groups: answers replaced (one-token and two-token answers), a completion with no answer and
    one whose replaced completion passes the length limit (R = 0, reasoning still trained), counted in the logs. The
    loss and every parameter's gradient equal the transcription's, from one pass of the body and no allocation as
    large as the batch's (B, C, V) logits but the parameters' own gradients."""
    from torch.profiler import ProfilerActivity, profile

    trainer = _trainer(tokenizer, tmp_path, monkeypatch, torch.float64, per_device_train_batch_size=6)  # exact sums
    model = trainer.model
    model.train()
    inputs = trainer._generate_and_score_completions([{"prompt": prompt, "solution": REFERENCES[prompt]}
                                                      for prompt in COMPLETIONS for _ in range(3)])
    assert inputs["rewarded"].tolist() == [True, True, False, True, True, False]
    assert trainer._metrics["train"]["verifree/no_answer"] == [pytest.approx(1 / 6)]
    assert trainer._metrics["train"]["verifree/cut"] == [pytest.approx(1 / 6)]

    trainer.current_gradient_accumulation_steps = 1  # what the training loop sets at each step
    passes = []
    hook = model.model.register_forward_hook(lambda *_: passes.append(1))
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            loss = trainer.compute_loss(model, inputs)
            loss.backward()
    finally:
        hook.remove()
    assert passes == [1]
    parameter_bytes = {p.numel() * p.element_size() for p in model.parameters()}
    allocations = [event.self_cpu_memory_usage for event in prof.events()]
    logits_bytes = inputs["completion_ids"].numel() * model.config.vocab_size * 8  # (B, C, V) fp64
    assert max(allocations) <= max(parameter_bytes)  # the (V, H) gradients of the embedding and the head
    assert max(size for size in allocations if size not in parameter_bytes) < logits_bytes / 4
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}

    model.zero_grad()
    expected = _papers_loss(model, tokenizer, trainer.max_completion_length)
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-10, atol=1e-13)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-7, atol=1e-10, msg=name)
    assert max(grad.abs().max().item() for grad in grads.values()) > 1e-2  # the comparison sees the terms
    assert trainer._metrics["train"]["reward"][0] > 1e-4


def test_training_splits_the_generation_into_whole_groups_with_one_body_pass_each(tokenizer, tmp_path, monkeypatch):
    """Two micro-batches of one group each per optimizer step: each is one forward of the body (the reward, its
    baseline and the loss all from it), and nothing else runs the body."""
    trainer = _trainer(tokenizer, tmp_path, monkeypatch, per_device_train_batch_size=3, gradient_accumulation_steps=2,
                       max_steps=1, learning_rate=1e-3)
    seen, passes = [], []
    compute_loss = trainer.compute_loss
    trainer.compute_loss = lambda model, inputs, **kwargs: seen.append(inputs) or compute_loss(model, inputs,
                                                                                               **kwargs)
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    hook = trainer.model.model.register_forward_hook(lambda *_: passes.append(len(seen)))
    try:
        trainer.train()
    finally:
        hook.remove()
    assert passes == [1, 2]  # inside each micro-batch's loss
    prompts = [{tuple(row[mask.bool()].tolist()) for row, mask in zip(inputs["prompt_ids"], inputs["prompt_mask"])}
               for inputs in seen]  # each micro-batch's prompts, without their left padding
    assert sorted(prompts) == sorted({tuple(tokenizer(prompt)["input_ids"])} for prompt in COMPLETIONS)  # whole
    logged = trainer.state.log_history[0]
    assert logged["reward"] > 0 and logged["verifree/no_answer"] == pytest.approx(1 / 6)
    assert any(not torch.equal(p, before[name]) for name, p in trainer.model.named_parameters())


def test_the_papers_defaults_split_before_the_tags_bracket(tokenizer):
    """The defaults: the reasoning keeps "<answer", the template "> \\boxed{y*} </answer>" replaces the rest, and
    the tokens of the text read as one are the paper's two pieces tokenized apart."""
    config = VeriFreeConfig(output_dir="unused", use_cpu=True, report_to="none")
    text, span = answer_from_template("So it is three. <answer> \\boxed{3} </answer>", "4", config.answer_start,
                                      config.answer_template)
    assert text == "So it is three. <answer> \\boxed{4} </answer>" and text[span[0]:span[1]] == "> \\boxed{4} </answer>"
    ids, first, stop = covering_tokens(tokenizer, text, span)
    think = tokenizer("So it is three. <answer", add_special_tokens=False)["input_ids"]
    answer = tokenizer("> \\boxed{4} </answer>", add_special_tokens=False)["input_ids"]
    assert (ids, first, stop) == (think + answer, len(think), len(ids))
    assert answer_from_template("no tag here", "4", config.answer_start, config.answer_template) is None


@pytest.mark.parametrize("options, error", [
    (dict(beta=0.1), "^beta: VeriFree's objective has no term for it; leave it at 0.0, got 0.1"),
    (dict(num_iterations=2), "^num_iterations: VeriFree's objective has no term for it"),
    (dict(per_device_train_batch_size=4, num_generations=2, gradient_accumulation_steps=2, steps_per_generation=4),
     "^steps_per_generation: VeriFree trains on-policy"),
    (dict(per_device_train_batch_size=3, num_generations=2, generation_batch_size=6),
     "^per_device_train_batch_size: must hold whole groups of num_generations=2"),
    (dict(answer_template="\\boxed{{answer}}"), r"^answer_template: expected exactly one field, \{answer\}"),
    (dict(answer_start=""), "^answer_start: expected a non-empty string"),
])
def test_options_the_objective_lacks_are_refused_by_name(options, error):
    with pytest.raises(ValueError, match=error):
        VeriFreeConfig(output_dir="unused", use_cpu=True, report_to="none", **options)


def test_the_trainer_takes_a_verifree_config(tokenizer, tmp_path):
    with pytest.raises(TypeError, match="^args: expected a VeriFreeConfig, got GRPOConfig"):
        VeriFreeTrainer(model="unused", args=trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none"))
