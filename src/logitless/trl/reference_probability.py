"""RLPR's reward for GRPO and RLOO: how much a completion's reasoning raises the policy's own probability of the
reference answer (Yu et al., 2025, "RLPR: Extrapolating RLVR to General Domains without Verifiers").

For a prompt x, a completion whose reasoning z runs up to its answer tag, and the reference answer y* of the
prompt's dataset row::

    r = clip(P(y* | x, z) - P(y* | x), 0, 1)

* P(y* | x, z): the completion's own answer is replaced by y*. The completion's text up to its ``<answer>`` tag,
  the tag, the whitespace the completion wrote after it (one space when none), y*, a space and ``</answer>`` are
  tokenized as one text, as the model would read them, after the prompt's tokens; y*'s tokens are those whose
  characters overlap y*'s (a token the tokenizer merged with the space before y* counts), and P is the mean of the
  policy's probabilities of those tokens ("mean", the paper's default) or their product ("sequence").
* P(y* | x): the same for the prompt followed by a space, y* and a space, with no reasoning (the debiasing term).

A completion with no answer to replace (no ``<answer>`` tag, more than one, or nothing after it) gets 0, as in the
paper's code; the fraction of such completions is logged as "reference_probability/no_answer".

All rows of a call, every completion's and each prompt's answer-alone row once, are scored by ONE no-grad pass of
the policy's body (left-padded), and only the answer tokens' hidden states go through the fused log-probs: no
``(B, T, V)`` logits exist.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from logitless._checks import check_choice, check_positive_finite, completion_text
from logitless.hf import final_hidden_states, lm_head_of
from logitless.hf_probe import check_head
from logitless.ops.fused import fused_linear_logprobs

AGGREGATES = ("mean", "sequence")
NO_ANSWER_METRIC = "reference_probability/no_answer"
WITH_REASONING_METRIC = "reference_probability/with_reasoning"
WITHOUT_REASONING_METRIC = "reference_probability/without_reasoning"


def answer_replaced(completion: str, reference: str, answer_start: str = "<answer>",
                    answer_end: str = "</answer>") -> tuple[str, tuple[int, int]] | None:
    """(the completion with its answer replaced by ``reference``, the character span of ``reference`` in it), or
    None when the completion has no answer to replace: ``answer_start`` missing, twice or more, or only whitespace
    after it."""
    if completion.count(answer_start) != 1:
        return None
    reasoning, answer = completion.split(answer_start)
    if not answer.strip():
        return None
    leading = answer[:len(answer) - len(answer.lstrip())] or " "
    start = len(reasoning) + len(answer_start) + len(leading)
    text = reasoning + answer_start + leading + reference + " " + answer_end
    return text, (start, start + len(reference))


def answer_from_template(completion: str, reference: str, answer_start: str, answer_template: str
                         ) -> tuple[str, tuple[int, int]] | None:
    """VeriFree's rule: (the completion up to and with its first ``answer_start``, then ``answer_template`` with
    ``reference`` in its ``{answer}`` field; the character span of that filled template), or None when
    ``answer_start`` does not occur. What the completion wrote after the tag is dropped."""
    position = completion.find(answer_start)
    if position < 0:
        return None
    start = position + len(answer_start)
    text = completion[:start] + answer_template.format(answer=reference)
    return text, (start, len(text))


def answer_alone(reference: str) -> tuple[str, tuple[int, int]]:
    """The continuation the debiasing term scores: a space, ``reference`` and a space; with ``reference``'s span."""
    return " " + reference + " ", (1, 1 + len(reference))


def covering_tokens(tokenizer, text: str, span: tuple[int, int]) -> tuple[list[int], int, int]:
    """(``text``'s token ids, the first and one past the last token whose characters overlap ``span``)."""
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    covering = [i for i, (first, end) in enumerate(encoding["offset_mapping"]) if first < span[1] and end > span[0]]
    return list(encoding["input_ids"]), covering[0], covering[-1] + 1


def prompt_token_ids(tokenizer, prompt) -> list[int]:
    """The prompt's tokens as TRL's trainers tokenize it: a string as is, a conversation with the chat template and
    its generation prompt."""
    if isinstance(prompt, str):
        return list(tokenizer(text=prompt)["input_ids"])
    if isinstance(prompt, list):
        return list(tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                                  return_dict=True)["input_ids"])
    raise TypeError(f"prompts: expected strings or conversations, got {type(prompt).__name__}")


def answer_log_probs(model, head, rows: Sequence[tuple[list[int], int, int]]) -> list[torch.Tensor]:
    """For each row (token ids, first, stop): the log-probs (stop - first,) of its tokens first..stop-1, each given
    the tokens before it; all rows left-padded into one no-grad pass of ``model``'s body."""
    device = head.weight.device
    length = max(len(ids) for ids, _, _ in rows)
    input_ids = torch.zeros(len(rows), length, dtype=torch.long, device=device)  # (R, L), left-padded
    attention_mask = torch.zeros(len(rows), length, dtype=torch.long, device=device)
    for row, (ids, _, _) in enumerate(rows):
        input_ids[row, length - len(ids):] = torch.tensor(ids, dtype=torch.long)
        attention_mask[row, length - len(ids):] = 1
    scored = [(row, length - len(ids) + position) for row, (ids, first, stop) in enumerate(rows)
              for position in range(first, stop)]  # (row, padded position of a scored token)
    row_index = torch.tensor([row for row, _ in scored], device=device)
    position = torch.tensor([column for _, column in scored], device=device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            hidden = final_hidden_states(model, input_ids, attention_mask)  # (R, L, H)
            log_probs = fused_linear_logprobs(hidden[row_index, position - 1],  # (N, H): the row before each token
                                              targets=input_ids[row_index, position], head=head)  # (N,)
    finally:
        model.train(was_training)
    return list(log_probs.float().split([stop - first for _, first, stop in rows]))


def _aggregated(log_probs: torch.Tensor, aggregate: str) -> float:
    return (log_probs.exp().mean() if aggregate == "mean" else log_probs.sum().exp()).item()


def reference_probability_reward(model, tokenizer, *, answer_column: str = "solution", aggregate: str = "mean",
                                 debias: bool = True, answer_start: str = "<answer>", answer_end: str = "</answer>",
                                 temperature: float = 1.0):
    """A TRL reward function (GRPO, RLOO): ``clip(P(y* | x, z) - P(y* | x), 0, 1)`` per completion, RLPR's reward;
    see the module docstring.

    ``model`` is the policy being trained (the same object the trainer is given), ``tokenizer`` its tokenizer (a fast
    one: y*'s tokens are found from their character offsets). The reference answer y* of each prompt is its dataset
    row's ``answer_column`` (TRL hands reward functions the dataset's columns by name; "solution" is the column TRL's
    own accuracy rewards read). ``aggregate``: "mean" (the mean of y*'s token probabilities, the paper's default) or
    "sequence" (their product). ``debias=False`` drops the ``P(y* | x)`` term. ``answer_start`` / ``answer_end``:
    the tags around an answer. ``temperature`` divides the policy's logits.
    """
    check_choice("aggregate", aggregate, AGGREGATES)
    if not isinstance(debias, bool):
        raise TypeError(f"debias: expected a bool, got {type(debias).__name__}")
    for name, value in (("answer_column", answer_column), ("answer_start", answer_start), ("answer_end", answer_end)):
        if not isinstance(value, str) or not value:
            raise ValueError(f"{name}: expected a non-empty string, got {value!r}")
    temperature = check_positive_finite("temperature", temperature)
    if not getattr(tokenizer, "is_fast", False):
        raise TypeError("tokenizer: expected a fast tokenizer (is_fast): the reference answer's tokens are found "
                        "from the character offsets only fast tokenizers give")
    check_head(model, "reference_probability_reward reads the answer's probabilities from those hidden states only")

    def reference_probability(prompts, completions, log_metric=None, **columns) -> list[float]:
        references = columns.get(answer_column)
        if references is None:
            raise ValueError(f"{answer_column}: the dataset needs a column '{answer_column}' with each prompt's "
                             f"reference answer (answer_column= names another)")
        if len(prompts) != len(completions) or len(references) != len(completions):
            raise ValueError(f"{answer_column}: got {len(prompts)} prompts and {len(references)} reference answers "
                             f"for {len(completions)} completions")
        for i, reference in enumerate(references):
            if not isinstance(reference, str) or not reference.strip():
                raise ValueError(f"{answer_column}[{i}]: expected a non-empty reference answer, got {reference!r}")

        rows = []  # (token ids, first, stop) of every row the body pass scores
        completion_rows, alone_rows = {}, {}  # completion index -> (row, prompt key); prompt key -> row
        for i, (prompt, completion, reference) in enumerate(zip(prompts, completions, references)):
            prompt_ids = prompt_token_ids(tokenizer, prompt)
            if not prompt_ids:
                raise ValueError(f"prompts[{i}]: tokenizes to no tokens; the answer's first token needs a row")
            replaced = answer_replaced(completion_text(f"completions[{i}]", completion), reference, answer_start,
                                       answer_end)
            if replaced is None:
                continue
            ids, first, stop = covering_tokens(tokenizer, *replaced)
            key = (tuple(prompt_ids), reference)
            completion_rows[i] = (len(rows), key)
            rows.append((prompt_ids + ids, len(prompt_ids) + first, len(prompt_ids) + stop))
            if debias and key not in alone_rows:
                ids, first, stop = covering_tokens(tokenizer, *answer_alone(reference))
                alone_rows[key] = len(rows)
                rows.append((prompt_ids + ids, len(prompt_ids) + first, len(prompt_ids) + stop))

        head = lm_head_of(model, temperature)
        probabilities = [_aggregated(lp, aggregate) for lp in answer_log_probs(model, head, rows)] if rows else []
        rewards = [0.0] * len(completions)
        with_reasoning, without_reasoning = [], []
        for i, (row, key) in completion_rows.items():
            baseline = probabilities[alone_rows[key]] if debias else 0.0
            with_reasoning.append(probabilities[row])
            without_reasoning.append(baseline)
            rewards[i] = min(max(probabilities[row] - baseline, 0.0), 1.0)
        if log_metric is not None and completions:
            log_metric(NO_ANSWER_METRIC, 1.0 - len(completion_rows) / len(completions))
            if with_reasoning:
                log_metric(WITH_REASONING_METRIC, sum(with_reasoning) / len(with_reasoning))
                log_metric(WITHOUT_REASONING_METRIC, sum(without_reasoning) / len(without_reasoning))
        return rewards

    return reference_probability
