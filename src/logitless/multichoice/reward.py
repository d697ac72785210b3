"""The multiple-choice judge reward for TRL: ``R = P(correct | model) * (1 - P(correct | judge))`` per completion.

The policy should be right while a judge reading its chain of thought (with the final answer stripped out) cannot
tell the answer. P(correct | model) is read from ONE row of the policy's own completion logits
(`logitless.multichoice.answer`), or recomputed with another forward when the trainer does not pass them
(`logitless.multichoice.recompute`); P(correct | judge) comes from `logitless.multichoice.judge.MultichoiceJudge`.
"""

from __future__ import annotations

from logitless._checks import check_positive_finite, completion_text
from logitless.multichoice.answer import extract_answer_probability_from_logits
from logitless.multichoice.letters import check_marker, choice_token_ids
from logitless.multichoice.recompute import answer_probability_by_recomputing


def multichoice_judge_reward(judge, tokenizer, choices: str = "ABCD", *, policy=None, marker: str = "ANSWER:",
                             temperature: float = 1.0):
    """A TRL reward function: ``R = P(correct | model) * (1 - P(correct | judge))`` per completion.

    P(correct | model) comes from the ``completion_logits`` the trainer passes (GRPOTrainerWithLogits),
    via `extract_answer_probability_from_logits`; when it is None (stock TRL) it is recomputed with
    `answer_probability_by_recomputing` on ``policy`` at ``temperature`` (a ValueError if no policy).
    P(correct | judge) is ``judge.probabilities(question, completion, answer)``, with ``judge`` a
    `MultichoiceJudge` or anything with that method. The dataset must have an ``answer`` column (the
    letter); a ``question`` column (the question with its choices) is what the judge reads, the
    prompt when absent. Batch means of both factors go to TRL's ``log_metric`` as
    "multichoice/p_correct_model" and "multichoice/p_correct_judge".
    """
    if not callable(getattr(judge, "probabilities", None)):
        raise TypeError(f"judge: expected an object with a probabilities(questions, chains_of_thought, "
                        f"correct_answers) method, got {type(judge).__name__}")
    choice_token_ids(tokenizer, choices)
    check_marker(marker)
    temperature = check_positive_finite("temperature", temperature)

    def multichoice_judge_reward(prompts, completions, completion_ids, completion_logits=None, answer=None,
                                 question=None, log_metric=None, **kwargs) -> list[float]:
        count = len(completions)
        if answer is None:
            raise ValueError("answer: the dataset needs an 'answer' column with the correct letter per prompt")
        for name, values in (("prompts", prompts), ("completion_ids", completion_ids), ("answer", answer),
                             ("question", question), ("completion_logits", completion_logits)):
            if values is not None and len(values) != count:
                raise ValueError(f"{name}: got {len(values)} for {count} completions")
        if completion_logits is None and policy is None:
            raise ValueError("completion_logits: not passed by the trainer (stock TRL does not); train with "
                             "GRPOTrainerWithLogits or give multichoice_judge_reward a policy= to recompute them")

        if completion_logits is not None:
            p_model = [extract_answer_probability_from_logits(completion_logits[i], completion_ids[i], tokenizer,
                                                              answer[i], choices, marker=marker)
                       for i in range(count)]
        else:
            p_model = [answer_probability_by_recomputing(policy, tokenizer, prompts[i], completion_ids[i], answer[i],
                                                         choices, marker, temperature=temperature)
                       for i in range(count)]
        texts = [completion_text(f"completions[{i}]", c) for i, c in enumerate(completions)]
        questions = question if question is not None else [completion_text(f"prompts[{i}]", p)
                                                           for i, p in enumerate(prompts)]
        p_judge = judge.probabilities(list(questions), texts, list(answer))
        if log_metric is not None and count:
            log_metric("multichoice/p_correct_model", sum(p_model) / count)
            log_metric("multichoice/p_correct_judge", sum(p_judge) / count)
        return [model_p * (1.0 - judge_p) for model_p, judge_p in zip(p_model, p_judge)]

    return multichoice_judge_reward
