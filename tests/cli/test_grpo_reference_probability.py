"""`logitless grpo --reward reference-probability`: RLPR's reward of the correct letter, its std filter, their options
and a resume of such a run."""

import json

import pytest

from logitless.cli import main

RLPR = ["grpo", "--reward", "reference-probability", "--completions-per-step", "4", "--num-generations", "2",
        "--max-completion-length", "8", "--save-every", "1"]


def test_the_reward_options_are_documented_and_a_judge_without_the_judge_reward_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["grpo", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--reward {judge,reference-probability}" in text and "(default: judge)" in text
    assert "--reward-std-filter drop from the loss" in text and "(default: off)" in text
    with pytest.raises(SystemExit, match=r"^logitless grpo: --judge: has no effect on this run \(used with --reward "
                                         r"judge only, not reference-probability\); leave it out, or pass --reward "
                                         r"judge$"):
        main([*RLPR, "--judge", "tiny-qwen2"])
    with pytest.raises(SystemExit):
        main([*RLPR[:1], "--reward", "rlpr"])
    assert "argument --reward: invalid choice: 'rlpr'" in capsys.readouterr().err
    with pytest.raises(SystemExit, match=r"^logitless grpo: --reward: the judge reward reads the letter of a "
                                         r"multiple-choice question; --task free-form needs --reward "
                                         r"reference-probability$"):
        main(["grpo", "--task", "free-form"])
    (tmp_path / "config.yaml").write_text("reward_std_filter: 'yes'\n")
    with pytest.raises(SystemExit, match="^logitless grpo: --reward-std-filter: expected true or false, got 'yes'$"):
        main(["grpo", "--config", str(tmp_path / "config.yaml")])


def test_the_reward_is_the_policy_probability_of_the_correct_letter_after_the_answer_marker():
    """The recipe's RLPR reward, against the probabilities of a plain forward's full logits: the letter the prompt
    asks for, in place of what the completion wrote after "ANSWER:", at the run's temperature, debiased by the
    letter's probability right after the prompt."""
    import torch

    from logitless.multichoice.data import synthetic_multichoice
    from logitless.recipes.common import load_model
    from logitless.recipes.grpo import make_reward
    from logitless.recipes.grpo_options import MultichoiceGRPOConfig
    from logitless.trl.reference_probability import WITH_REASONING_METRIC, WITHOUT_REASONING_METRIC

    config = MultichoiceGRPOConfig(reward="reference-probability", temperature=0.7)
    policy, tokenizer = load_model("model", config.model, config.seed)
    record = synthetic_multichoice(count=1, seed=3)[0]
    reasoning = " The largest sum is the fourth. ANSWER:"

    def probability(text: str, letter: str) -> float:
        """P(" letter" | text), from the full (1, T, V) logits at the run's temperature."""
        ids = tokenizer(text, return_tensors="pt").input_ids
        with torch.no_grad():
            logits = policy(ids).logits[0, -1].double() / config.temperature  # (V,)
        (letter_id,) = tokenizer(" " + letter, add_special_tokens=False).input_ids
        return logits.softmax(-1)[letter_id].item()

    logged = {}
    rewards = make_reward(config, policy, tokenizer)(
        prompts=[record["prompt"]], completions=[reasoning + " fourth D"], answer=[record["answer"]],
        log_metric=logged.__setitem__)
    with_reasoning = probability(record["prompt"] + reasoning, record["answer"])
    without_reasoning = probability(record["prompt"], record["answer"])
    assert logged[WITH_REASONING_METRIC] == pytest.approx(with_reasoning, rel=1e-4)
    assert logged[WITHOUT_REASONING_METRIC] == pytest.approx(without_reasoning, rel=1e-4)
    assert rewards == [pytest.approx(min(max(with_reasoning - without_reasoning, 0.0), 1.0), abs=1e-9)]
    other = next(letter for letter in "ABCD" if letter != record["answer"])  # the check tells the letters apart
    assert probability(record["prompt"] + reasoning, other) != pytest.approx(with_reasoning, rel=1e-4)


@pytest.mark.slow
def test_rlpr_run_logs_its_reward_and_resumes_with_the_std_filter_state(tmp_path, capsys):
    """Two steps of RLPR's reward with its std filter on the embedded tiny model, then a resume to step 3."""
    from logitless.trl.std_filter import STATE_FILE

    out = tmp_path / "run"
    grpo = [*RLPR, "--reward-std-filter", "--output-dir", str(out)]
    assert main([*grpo, "--steps", "2"]) == 0
    first = json.loads((out / "history.json").read_text())
    assert len(first["reward"]) == 2 and first["std_filter_dropped"] == [0.0, 0.0]  # the paper's: 10 steps to warm up
    assert {"no_answer", "p_reference_with_reasoning", "p_reference_without_reasoning", "std_filter_threshold"} <= set(
        first) and "p_correct_judge" not in first
    # the untrained model never writes "ANSWER:": no completion has an answer to replace, and each scores 0
    assert first["no_answer"] == [1.0, 1.0] and first["reward"] == [0.0, 0.0]
    assert "RLPR's, clip(P(answer | reasoning)" in (out / "README.md").read_text()
    assert json.loads((out / "checkpoint-2" / STATE_FILE).read_text())["batches"] == 2

    with pytest.raises(SystemExit, match=r"^logitless grpo: --reward: resuming the run in .* \(reward "
                                         r"'reference-probability' -> 'judge'"):
        main([*grpo, "--steps", "3", "--reward", "judge"])
    capsys.readouterr()
    assert main([*grpo, "--steps", "3"]) == 0
    assert "logitless grpo: resuming from step 2" in capsys.readouterr().out
    resumed = json.loads((out / "history.json").read_text())
    assert len(resumed["reward"]) == 3 and resumed["no_answer"] == [1.0, 1.0, 1.0]
    assert json.loads((out / "checkpoint-3" / STATE_FILE).read_text())["batches"] == 3  # the filter's state resumed


@pytest.mark.slow
@pytest.mark.parametrize("command", [RLPR, ["verifree", *RLPR[3:]]], ids=["rlpr", "verifree"])
def test_free_form_runs_score_the_embedded_questions_answer_after_the_reasoning(tmp_path, warm_policy, command):
    """On the embedded free-form questions, a policy that writes "ANSWER:" gets its reference answer (a number or a
    word) scored after its reasoning: a probability above 0, and the run card names the questions."""
    policy, _ = warm_policy
    output_dir = tmp_path / "run"
    assert main([*command, "--task", "free-form", "--model", str(policy), "--steps", "1", "--temperature", "0.3",
                 "--output-dir", str(output_dir)]) == 0
    history = json.loads((output_dir / "history.json").read_text())
    scored = history["p_reference_with_reasoning" if command is RLPR else "reward"]
    assert len(scored) == 1 and 0 < scored[0] < 1 and history["no_answer"][0] < 1
    card = " ".join((output_dir / "README.md").read_text().split())
    assert "on free-form questions (140 embedded free-form questions" in card
