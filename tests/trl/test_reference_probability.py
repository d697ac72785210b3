"""RLPR's reward (`reference_probability_reward`) against the model's own materialized logits, and its
standard-deviation filter (`RewardStdFilter`), alone and in a GRPOTrainerWithLogits run."""

import pytest
import torch

trl = pytest.importorskip("trl")
from datasets import Dataset  # noqa: E402

from logitless.trl import GRPOTrainerWithLogits, RewardStdFilter, reference_probability_reward  # noqa: E402
from logitless.trl.reference_probability import answer_replaced  # noqa: E402
from spread_policy import spread_policy  # noqa: E402

FRANCE = "What is the capital of France?"
PRIME = [{"role": "user", "content": "Name a prime."}]
# (prompt, completion, reference answer, the completion with its answer replaced as the paper's code writes it)
CASES = [
    (FRANCE, "It is in France. <answer> Lyon </answer>", "Paris", "It is in France. <answer> Paris </answer>"),
    (FRANCE, "<answer>\nParis</answer>", "Paris", "<answer>\nParis </answer>"),  # the completion's own whitespace
    (FRANCE, "I do not know.", "Paris", None),  # no answer to replace: reward 0
    ("2+2?", "Add them.<answer>5</answer>", "4", "Add them.<answer> 4 </answer>"),  # a shorter prompt: left padding
    (PRIME, [{"role": "assistant", "content": "Two is one. <answer> 2 </answer>"}], "3",
     "Two is one. <answer> 3 </answer>"),  # a conversation, through the chat template
]


@pytest.fixture(scope="module")
def chat_tokenizer(tokenizer):
    """The Qwen tokenizer with a plain chat template (the embedded one has none)."""
    import copy

    chat = copy.deepcopy(tokenizer)
    chat.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}assistant:{% endif %}")
    return chat


@pytest.fixture(scope="module")
def policy(tokenizer):
    texts = [FRANCE, "2+2?", "Name a prime."] + [text for *_, text in CASES if text] + [" Paris ", " 4 ", " 3 "]
    return spread_policy(tokenizer, texts)


def _prompt_ids(tokenizer, prompt) -> list[int]:
    if isinstance(prompt, str):
        return tokenizer(prompt)["input_ids"]
    chat = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True)
    return chat["input_ids"]


def _materialized_probability(model, tokenizer, prompt, text: str, reference: str, aggregate: str,
                              temperature: float) -> float:
    """P(reference | prompt + text) from the model's own (T, V) logits: log_softmax, gather, then the mean of the
    reference tokens' probabilities or their product; the reference's tokens are those overlapping its last
    occurrence's characters."""
    prompt_ids = _prompt_ids(tokenizer, prompt)
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    start = text.rindex(reference)
    positions = [len(prompt_ids) + i for i, (first, end) in enumerate(encoding["offset_mapping"])
                 if first < start + len(reference) and end > start]
    ids = torch.tensor([prompt_ids + encoding["input_ids"]])
    with torch.no_grad():
        log_probs = torch.log_softmax(model(input_ids=ids).logits[0].double() / temperature, dim=-1)  # (T, V)
    token_log_probs = torch.stack([log_probs[p - 1, ids[0, p]] for p in positions])
    return (token_log_probs.exp().mean() if aggregate == "mean" else token_log_probs.sum().exp()).item()


@pytest.mark.parametrize("aggregate, debias, temperature", [("mean", True, 1.0), ("sequence", True, 1.0),
                                                             ("mean", False, 0.7)])
def test_reward_equals_the_materialized_probabilities_in_one_body_pass(policy, chat_tokenizer, aggregate, debias,
                                                                        temperature):
    """Each reward is clip(P(y* | x, z) - P(y* | x), 0, 1) computed from the model's own logits of each sequence
    alone, to 1e-6: one-token answers, an answer the tokenizer merged with the space before it, a shorter prompt
    left-padded beside longer ones, a conversation; a completion without an answer gets 0. All of it in one
    no-grad pass of the body, and no allocation as large as even one row's logits."""
    from torch.profiler import ProfilerActivity, profile

    tokenizer = chat_tokenizer
    assert tokenizer(" Paris", add_special_tokens=False)["input_ids"] != tokenizer("Paris")["input_ids"]  # merged
    assert len(tokenizer("4")["input_ids"]) == 1  # a one-token answer
    prompts, completions, references, replaced = map(list, zip(*CASES))
    reward = reference_probability_reward(policy, tokenizer, answer_column="reference", aggregate=aggregate,
                                          debias=debias, temperature=temperature)
    metrics = {}
    passes = []
    body = getattr(policy, policy.base_model_prefix)
    hook = body.register_forward_hook(lambda *_: passes.append(1))
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            rewards = reward(prompts=prompts, completions=completions, reference=references,
                             log_metric=metrics.__setitem__)
    finally:
        hook.remove()
    assert len(passes) == 1
    shortest = min(len(_prompt_ids(tokenizer, p)) for p in prompts) + 3  # no row of the batch is shorter
    largest = max(event.self_cpu_memory_usage for event in prof.events())  # one allocation's bytes
    assert largest < shortest * policy.config.vocab_size * 4  # not even one row's (T, V) fp32 logits

    expected = []
    for prompt, reference, text in zip(prompts, references, replaced):
        if text is None:
            expected.append(0.0)
            continue
        with_reasoning = _materialized_probability(policy, tokenizer, prompt, text, reference, aggregate, temperature)
        alone = (_materialized_probability(policy, tokenizer, prompt, f" {reference} ", reference, aggregate,
                                           temperature) if debias else 0.0)
        expected.append(min(max(with_reasoning - alone, 0.0), 1.0))
    assert rewards == pytest.approx(expected, abs=1e-6, rel=0)
    assert sum(0.0 < value < 1.0 for value in expected) >= 2  # not all clipped: the comparison sees the values
    assert metrics["reference_probability/no_answer"] == pytest.approx(1 / 5)


def test_answer_replacement_follows_the_papers_rule():
    assert answer_replaced("So. <answer>x</answer>", "y") == ("So. <answer> y </answer>", (13, 14))
    assert answer_replaced("So.<answer>\t x", "yz") == ("So.<answer>\t yz </answer>", (13, 15))
    assert answer_replaced("a [[b", "c", answer_start="[[", answer_end="]]") == ("a [[ c ]]", (5, 6))
    for no_answer in ("no tag", "<answer>a</answer> <answer>b</answer>", "reasoning <answer>  \n"):
        assert answer_replaced(no_answer, "y") is None


def test_bad_input_is_named(policy, tokenizer):
    reward = reference_probability_reward(policy, tokenizer)
    with pytest.raises(ValueError, match="^solution: the dataset needs a column 'solution'"):
        reward(prompts=[FRANCE], completions=["<answer> a </answer>"])
    with pytest.raises(ValueError, match=r"^solution\[0\]: expected a non-empty reference answer"):
        reward(prompts=[FRANCE], completions=["<answer> a </answer>"], solution=[" "])
    with pytest.raises(ValueError, match="^solution: got 1 prompts and 2 reference answers for 1 completions"):
        reward(prompts=[FRANCE], completions=["<answer> a </answer>"], solution=["a", "b"])
    with pytest.raises(TypeError, match=r"^completions\[0\]: expected a string or a list of messages"):
        reward(prompts=[FRANCE], completions=[3], solution=["a"])
    with pytest.raises(ValueError, match="^aggregate: expected one of 'mean', 'sequence'"):
        reference_probability_reward(policy, tokenizer, aggregate="max")
    with pytest.raises(ValueError, match="^answer_start: expected a non-empty string"):
        reference_probability_reward(policy, tokenizer, answer_start="")
    with pytest.raises(ValueError, match="^temperature"):
        reference_probability_reward(policy, tokenizer, temperature=0)
    with pytest.raises(ValueError, match="^decay: expected a number in"):
        RewardStdFilter(decay=1.0)
    with pytest.raises(ValueError, match="^warmup_batches: expected a positive int"):
        RewardStdFilter(warmup_batches=0)


def test_std_filter_drops_exactly_the_groups_below_its_moving_threshold():
    """One batch skipped, two of warm-up (nothing dropped, their mean starts the average), then each batch keeps the
    groups whose std reaches beta times the average of the batches before it (a std equal to it stays, a NaN one
    goes), and moves the average by its mean std."""
    stds = [torch.tensor(values, dtype=torch.float64) for values in
            ([9.0, 9.0], [0.25, 0.75], [0.5, 1.0], [0.3125, 0.3, float("nan"), 0.5], [0.29, 0.31, 0.5])]
    flt = RewardStdFilter(beta=0.5, decay=0.9, skip_batches=1, warmup_batches=2)
    thresholds, kept = [], []
    for batch in stds:
        thresholds.append(flt.threshold)
        kept.append(flt.keep(batch).tolist())
    assert thresholds[:3] == [None, None, None] and kept[:3] == [[True, True]] * 3
    ema = (0.5 + 0.75) / 2  # the warm-up batches' mean stds; the skipped batch's 9.0 counts nowhere
    assert thresholds[3] == 0.5 * ema == 0.3125
    assert kept[3] == [True, False, False, True]
    ema = 0.9 * ema + 0.1 * (0.3125 + 0.3 + 0.5) / 3  # the mean of its finite stds, dropped groups included
    assert thresholds[4] == pytest.approx(0.5 * ema, rel=1e-15)
    assert kept[4] == [False, True, True]
    assert flt.ema == pytest.approx(0.9 * ema + 0.1 * (0.29 + 0.31 + 0.5) / 3, rel=1e-15)


def _reason_then_answer(prompts, trainer):
    """A rollout (TRL's ``rollout_func``): the policy samples 3 tokens of reasoning, then answers a guess in tags."""
    tokenizer = trainer.processing_class
    model = trainer.accelerator.unwrap_model(trainer.model)
    prompt_ids, completion_ids = [], []
    for i, prompt in enumerate(prompts):
        ids = tokenizer(prompt)["input_ids"]
        with torch.no_grad():
            reasoning = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                       do_sample=True, max_new_tokens=3, min_new_tokens=3,
                                       pad_token_id=tokenizer.pad_token_id)[0, len(ids):].tolist()
        guess = tokenizer(f" <answer> {['Paris', '4', 'blue'][i % 3]} </answer>", add_special_tokens=False)
        prompt_ids.append(ids)
        completion_ids.append(reasoning + guess["input_ids"] + [tokenizer.eos_token_id])
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids,
            "logprobs": [[0.0] * len(ids) for ids in completion_ids]}


def test_grpo_trains_on_the_reward_from_a_dataset_column_and_drops_the_low_std_groups(policy, tokenizer, tmp_path,
                                                                                        monkeypatch):
    """Two GRPOTrainerWithLogits steps on the reference answers of a dataset column: each reward call is one body
    pass, and from the second batch on, the groups whose std of summed rewards is below the filter's threshold (the
    first batch's mean std) leave the loss exactly: their completion mask zeroed, the loss's token count recounted;
    the others are untouched. A second reward spreads every other group, so that both kinds are there. The
    filter's state is in the checkpoint."""
    import copy

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    model = copy.deepcopy(policy)
    rewarded, passes = [], []
    reward = reference_probability_reward(model, tokenizer)

    def reference_probability(**kwargs):
        hook = model.model.register_forward_hook(lambda *_: passes.append(len(rewarded)))
        try:
            rewarded.append(reward(**kwargs))
        finally:
            hook.remove()
        return rewarded[-1]

    def spread(completions, **kwargs):  # every other prompt's group: 0 and 1, the others 0 and 0; RLPR's noise on top
        return [float(i % 2) if (i // 2) % 2 else 0.0 for i in range(len(completions))]

    std_filter = RewardStdFilter(beta=1.0, skip_batches=0, warmup_batches=1)
    judged = []
    keep = std_filter.keep
    std_filter.keep = lambda stds: judged.append((stds.clone(), std_filter.threshold, keep(stds))) or judged[-1][2]
    dataset = Dataset.from_dict({"prompt": [FRANCE, "2+2?", "Name a color.", "Say hi."],
                                 "solution": ["Paris", "4", "blue", "hi"]})
    args = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, per_device_train_batch_size=8,
                          num_generations=2, max_completion_length=16, max_steps=2, logging_steps=1,
                          report_to="none", save_strategy="steps", save_steps=2, seed=0, learning_rate=1e-5)
    trainer = GRPOTrainerWithLogits(model=model, reward_funcs=[reference_probability, spread], args=args,
                                    train_dataset=dataset, processing_class=tokenizer, rollout_func=_reason_then_answer,
                                    reward_std_filter=std_filter)
    outputs = []
    generate_and_score = trainer._generate_and_score_completions
    trainer._generate_and_score_completions = lambda inputs: outputs.append(generate_and_score(inputs)) or outputs[-1]
    trainer.train()

    assert passes == [0, 1]  # one body pass in each of the two reward calls
    assert len(rewarded) == len(judged) == len(outputs) == 2
    for rewards, (stds, _, _) in zip(rewarded, judged):  # the std of each group's summed rewards
        summed = torch.tensor(rewards) + torch.tensor(spread(rewards))
        torch.testing.assert_close(stds.cpu(), summed.view(-1, 2).std(dim=1), rtol=1e-6, atol=0)
    assert judged[0][1] is None and judged[0][2].all()  # the first batch starts the average, drops nothing
    stds, threshold, kept = judged[1]
    assert threshold == pytest.approx(judged[0][0].double().mean().item(), rel=1e-12)
    assert kept.tolist() == (stds >= threshold).tolist() and 0 < int(kept.sum()) < len(kept)  # some of each
    mask = outputs[1]["completion_mask"]
    lengths = [ids.tolist().index(tokenizer.eos_token_id) + 1 for ids in outputs[1]["completion_ids"]]  # to EOS
    assert mask.sum(1).tolist() == [n if k else 0 for n, k in zip(lengths, kept.repeat_interleave(2).tolist())]
    assert int(outputs[1]["num_items_in_batch"]) == int(mask.sum())
    logged = {key for entry in trainer.state.log_history for key in entry}
    assert {"rewards/reference_probability/mean", "reference_probability/no_answer",
            "logitless/std_filter/dropped", "logitless/std_filter/threshold"} <= logged

    trainer.reward_std_filter = RewardStdFilter(beta=1.0, skip_batches=0, warmup_batches=1)  # a resumed run's
    trainer._load_optimizer_and_scheduler(str(tmp_path / "checkpoint-2"))
    assert trainer.reward_std_filter == std_filter and std_filter.batches == 2  # the checkpoint kept its state
