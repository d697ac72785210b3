"""Multiple-choice rewards: the probability of the correct answer letter, under the policy and under a judge.

The multiple-choice reward is ``R = P(correct | model) * (1 - P(correct | judge))``: the policy should be right
while a judge reading its chain of thought (with the final answer stripped out) cannot tell the answer.

- P(correct | model) is read from ONE row of the policy's own completion logits, the row the answer
  letter was sampled from (`extract_answer_probability_from_logits`). The rows may be a
  `logitless.ops.lazy.CompletionLogits`, so no ``(C, V)`` tensor is ever built.
- P(correct | judge) comes from `MultichoiceJudge`: one teacher-forced forward over
  question + reasoning + marker, keeping only the last position's logits at the letters' token ids.
- `answer_probability_by_recomputing` recomputes it instead (a second full forward with
  materialized logits), kept as the fallback for stock TRL and as a benchmark baseline.

A letter's probability is the sum over its token ids: the bare letter ("A") and the space-prefixed
one (" A"), which are different tokens in BPE vocabularies.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch

from logitless._checks import check_positive_finite, check_positive_int, check_strings
from logitless._tensor_checks import check_finite, check_tensor
from logitless.data import left_padded, pad_token_id
from logitless.hf import final_hidden_states, lm_head_of, model_body
from logitless.ops.head import LinearHead


def _check_choices(choices) -> str:
    if not isinstance(choices, str):
        raise TypeError(f"choices: expected a string of answer letters such as 'ABCD', got {type(choices).__name__}")
    if not choices:
        raise ValueError("choices: expected at least one answer letter, got ''")
    if len(set(choices)) != len(choices):
        raise ValueError(f"choices: letters must be distinct, got {choices!r}")
    return choices


def _check_marker(marker) -> str:
    if not isinstance(marker, str) or not marker:
        raise TypeError(f"marker: expected a non-empty string such as 'ANSWER:', got {marker!r}")
    return marker


def _check_answer(name: str, answer, choices: str) -> str:
    if not isinstance(answer, str) or len(answer) != 1 or answer not in choices:
        raise ValueError(f"{name}: expected one of the letters {choices!r}, got {answer!r}")
    return answer


def _token_id_list(name: str, ids) -> list[int]:
    """A list or 1-D integer tensor of token ids -> list[int]."""
    if isinstance(ids, torch.Tensor):
        check_tensor(name, ids, ndim=1, integer=True)
        return ids.tolist()
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise TypeError(f"{name}: expected a list or 1-D tensor of token ids, got {type(ids).__name__}")
    for i, token in enumerate(ids):
        if isinstance(token, bool) or not isinstance(token, int):
            raise TypeError(f"{name}[{i}]: expected an int token id, got {type(token).__name__}")
    return list(ids)


def choice_token_ids(tokenizer, choices: str = "ABCD") -> dict[str, list[int]]:
    """For each choice letter its single-token ids: the bare letter ("A") and the spaced one (" A").

    Raises ValueError naming `choices` when a letter, in either form, is not exactly one token.
    """
    _check_choices(choices)
    if not callable(getattr(tokenizer, "encode", None)):
        raise TypeError(f"tokenizer: expected a Hugging Face tokenizer with encode(), got {type(tokenizer).__name__}")
    token_ids: dict[str, list[int]] = {}
    owner: dict[int, str] = {}
    for letter in choices:
        ids = []
        for form in (letter, " " + letter):
            encoded = tokenizer.encode(form, add_special_tokens=False)
            if len(encoded) != 1:
                raise ValueError(f"choices: letter {letter!r} is not a single token in the form {form!r} "
                                 f"(it encodes to {list(encoded)}); use letters the tokenizer keeps whole")
            if encoded[0] in owner and owner[encoded[0]] != letter:
                raise ValueError(f"choices: letters {owner[encoded[0]]!r} and {letter!r} share token id {encoded[0]}")
            owner[encoded[0]] = letter
            ids.append(encoded[0])
        token_ids[letter] = list(dict.fromkeys(ids))  # one id when both forms are the same token
    return token_ids


def _letter_log_probs(id_logits: torch.Tensor, token_ids: dict[str, list[int]]) -> torch.Tensor:
    """(..., N) logits at the letters' ids, in `token_ids` order -> (..., L) log-sum-exp per letter, fp32."""
    per_letter, start = [], 0
    for ids in token_ids.values():
        per_letter.append(torch.logsumexp(id_logits[..., start: start + len(ids)].float(), dim=-1))
        start += len(ids)
    return torch.stack(per_letter, dim=-1)


def find_answer_position(completion_ids, tokenizer, choices: str = "ABCD", marker: str = "ANSWER:") -> int | None:
    """Index of the answer letter's token in the completion, or None.

    The first choice-letter token after the last occurrence of ``marker`` (case-insensitive) in the
    decoded completion, or None when none follows it (a letter before the marker is not the answer);
    without a marker, the last choice-letter token anywhere in it; else None.
    """
    ids = _token_id_list("completion_ids", completion_ids)
    _check_marker(marker)
    letter_ids = {token for forms in choice_token_ids(tokenizer, choices).values() for token in forms}
    needle = marker.lower()
    occurrences = tokenizer.decode(ids).lower().count(needle)
    if occurrences:
        # Smallest prefix whose text holds every occurrence: its last token completes the last marker.
        low, high = 1, len(ids)
        while low < high:
            middle = (low + high) // 2
            if tokenizer.decode(ids[:middle]).lower().count(needle) >= occurrences:
                high = middle
            else:
                low = middle + 1
        return next((t for t in range(low, len(ids)) if ids[t] in letter_ids), None)
    return next((t for t in reversed(range(len(ids))) if ids[t] in letter_ids), None)


def _answer_probability_from_row(row: torch.Tensor, token_ids: dict[str, list[int]], correct_answer: str,
                                 renormalize: bool) -> float:
    """P(correct_answer) from one (V,) logits row: over the letters when `renormalize`, else over the vocabulary."""
    check_tensor("completion_logits", row, ndim=1, floating=True)
    if bool(torch.isnan(row).any() | torch.isposinf(row).any()):  # -inf: a token that can never be sampled
        raise ValueError("completion_logits: contains NaN or +inf")
    flat_ids = [token for ids in token_ids.values() for token in ids]
    if max(flat_ids) >= row.shape[0]:
        raise ValueError(f"completion_logits: rows have {row.shape[0]} entries, fewer than the tokenizer's "
                         f"choice token id {max(flat_ids)}")
    row = row.float()  # (V,)
    letter_log_probs = _letter_log_probs(row[flat_ids], token_ids)  # (L,) unnormalized
    normalizer = torch.logsumexp(letter_log_probs if renormalize else row, dim=0)
    correct = list(token_ids).index(correct_answer)
    if torch.isneginf(letter_log_probs[correct]):  # the correct letter cannot be sampled (nor, perhaps, any letter)
        return 0.0
    return float(torch.exp(letter_log_probs[correct] - normalizer))


def extract_answer_probability_from_logits(completion_logits, completion_ids, tokenizer, correct_answer: str,
                                           choices: str = "ABCD", *, renormalize: bool = True,
                                           marker: str = "ANSWER:") -> float:
    """P(correct_answer) at the answer position of one completion, read from its own logits.

    ``completion_logits``: a (C, V) tensor or a `CompletionLogits`, anything whose ``[t]`` is the (V,)
    logits row completion token t was sampled from (temperature already applied). Only the row at
    `find_answer_position` is read and softmaxed in fp32. A letter's probability sums its bare and
    spaced token ids. With ``renormalize=True`` (the default) the result is renormalized over the
    choice letters (the letters' probabilities sum to 1); with False it is the raw probability under
    the full vocabulary. Returns 0.0 when the completion has no answer position.
    """
    token_ids = choice_token_ids(tokenizer, choices)
    _check_answer("correct_answer", correct_answer, choices)
    ids = _token_id_list("completion_ids", completion_ids)
    if isinstance(completion_logits, torch.Tensor):
        check_tensor("completion_logits", completion_logits, ndim=2, floating=True)
    elif not hasattr(completion_logits, "__getitem__"):
        raise TypeError(f"completion_logits: expected a (C, V) tensor or CompletionLogits, "
                        f"got {type(completion_logits).__name__}")
    if hasattr(completion_logits, "__len__") and len(completion_logits) != len(ids):
        raise ValueError(f"completion_logits: has {len(completion_logits)} rows for {len(ids)} completion_ids")
    position = find_answer_position(ids, tokenizer, choices, marker)
    if position is None:
        return 0.0
    return _answer_probability_from_row(completion_logits[position], token_ids, correct_answer, renormalize)


def answer_probability_by_recomputing(policy, tokenizer, prompt: str, completion_ids, correct_answer: str,
                                      choices: str = "ABCD", marker: str = "ANSWER:", renormalize: bool = True,
                                      *, temperature: float = 1.0) -> float:
    """P(correct_answer) by running ``policy`` again over prompt + completion.

    One more teacher-forced forward of the policy, whose completion rows go through the policy's head
    (`lm_head_of`: the sampling temperature, logit scale and soft cap of the loss's own definition) as
    materialized (C, V) logits, then the same reading as `extract_answer_probability_from_logits`. It
    is the fallback when the trainer does not pass ``completion_logits`` (stock TRL) and exists so a
    benchmark can show what reading the policy's own logits saves: the duplicate forward and its (C, V)
    tensor. The prompt is tokenized with special tokens, as TRL does.
    """
    if not isinstance(prompt, str):
        raise TypeError(f"prompt: expected a plain-text prompt, got {type(prompt).__name__}")
    ids = _token_id_list("completion_ids", completion_ids)
    temperature = check_positive_finite("temperature", temperature)
    prompt_ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    if not prompt_ids:
        raise ValueError("prompt: tokenizes to no tokens; the first completion token needs a row to come from")
    device = next(policy.parameters()).device
    input_ids = torch.tensor([prompt_ids + ids], dtype=torch.long, device=device)  # (1, P + C)
    was_training = policy.training
    policy.eval()
    try:
        with torch.no_grad():
            hidden = final_hidden_states(policy, input_ids)[0, len(prompt_ids) - 1: -1]  # (C, H): row t predicts token t
            completion_logits = lm_head_of(policy, temperature).logits(hidden)  # (C, V) fp32, materialized
    finally:
        policy.train(was_training)
    return extract_answer_probability_from_logits(completion_logits, ids, tokenizer, correct_answer, choices,
                                                  renormalize=renormalize, marker=marker)


def _final_answer_statement(choices: str) -> re.Pattern:
    letters = "".join(re.escape(letter) for letter in choices)
    # no leading separators in the pattern: retried at every position of a long run of them, they made the
    # search quadratic; `strip_final_answer` strips them from the text before the statement instead
    return re.compile(rf"(?:\b(?:so|thus|therefore|hence)\b[\s,]*)?(?:\bthe\s+)?(?:\b(?:final|correct)\s+)?"
                      rf"\banswer\b\s*(?:is\b|would\s+be\b)?\s*:?\s*[(\[*]*\s*[{letters}]\s*[)\]*]*\s*[.!]?\s*$",
                      re.IGNORECASE)


def strip_final_answer(text: str, choices: str = "ABCD", marker: str = "ANSWER:") -> str:
    """The chain of thought without its final answer, for the judge.

    Removes the last ``marker`` (case-insensitive) and everything after it, then a trailing statement
    such as "so the answer is (B)." or "Answer: B" that the marker line would have repeated. Other
    text is returned unchanged.
    """
    if not isinstance(text, str):
        raise TypeError(f"text: expected a string, got {type(text).__name__}")
    _check_choices(choices)
    _check_marker(marker)
    markers = list(re.finditer(re.escape(marker), text, re.IGNORECASE))
    if markers:
        text = text[: markers[-1].start()].rstrip()
    statement = _final_answer_statement(choices).search(text)
    return text[: statement.start()].rstrip(" \t\n\r\f\v,;:.") if statement else text


class MultichoiceJudge:
    """P(correct | chain of thought) under a frozen causal LM, renormalized over the choice letters.

    The judge reads ``question + "\\nReasoning: " + chain_of_thought + "\\n" + marker`` (the chain of
    thought without its final answer when ``strip_answer``) and its next-token distribution gives the
    letters' probabilities. Teacher-forced, never generating: ``batch_size`` prompts per forward, left
    padded with an attention mask, and only the last position's logits at the letters' token ids are
    computed from the final hidden states (no (B, T, V) and no (B, V) tensor).
    """

    def __init__(self, model, tokenizer, choices: str = "ABCD", marker: str = "ANSWER:", strip_answer: bool = True,
                 batch_size: int = 8):
        lm_head_of(model)  # raises unless the model has an output embedding the judge can read
        model_body(model)  # and a body that gives the final hidden states
        check_positive_int("batch_size", batch_size)
        if not isinstance(strip_answer, bool):
            raise TypeError(f"strip_answer: expected a bool, got {type(strip_answer).__name__}")
        self.model, self.tokenizer = model, tokenizer
        self.token_ids = choice_token_ids(tokenizer, choices)
        # (N,): every letter's token ids, letter after letter
        self.letter_token_ids = torch.tensor([t for ids in self.token_ids.values() for t in ids], dtype=torch.long)
        self.choices, self.marker = choices, _check_marker(marker)
        self.strip_answer, self.batch_size = strip_answer, batch_size
        self.pad_id = pad_token_id(tokenizer)

    def prompt(self, question: str, chain_of_thought: str) -> str:
        """The text the judge reads; its next token is the answer letter."""
        reasoning = chain_of_thought
        if self.strip_answer:
            reasoning = strip_final_answer(chain_of_thought, self.choices, self.marker)
        return f"{question}\nReasoning: {reasoning}\n{self.marker}"

    def _letter_probabilities(self, prompts: list[str]) -> torch.Tensor:
        """(B,) prompts -> (B, L) probabilities of the letters renormalized over them, one forward."""
        encoded = self.tokenizer(prompts, add_special_tokens=True)["input_ids"]
        head = lm_head_of(self.model)
        device = head.weight.device
        input_ids, attention_mask = left_padded(encoded, self.pad_id)  # (B, T) each
        hidden = final_hidden_states(self.model, input_ids.to(device), attention_mask.to(device))[:, -1]  # (B, H)
        letter_log_probs = self.letter_log_probs(hidden, head)  # (B, L)
        check_finite("model", letter_log_probs)
        return letter_log_probs.exp()

    def letter_log_probs(self, hidden: torch.Tensor, head: LinearHead) -> torch.Tensor:
        """(B, H) final hidden states -> (B, L) log-probabilities of the answer letters, renormalized over them; a
        letter's probability is the sum over its token ids. Only the letters' rows of ``head`` are read."""
        id_logits = head.logits(hidden, self.letter_token_ids.to(hidden.device))  # (B, N)
        return torch.log_softmax(_letter_log_probs(id_logits, self.token_ids), dim=-1)

    def probabilities(self, questions: list[str], chains_of_thought: list[str],
                      correct_answers: list[str]) -> list[float]:
        """P(correct answer | question, chain of thought) per example, renormalized over the letters."""
        questions = check_strings("questions", questions)
        chains_of_thought = check_strings("chains_of_thought", chains_of_thought)
        correct_answers = check_strings("correct_answers", correct_answers)
        for name, values in (("chains_of_thought", chains_of_thought), ("correct_answers", correct_answers)):
            if len(values) != len(questions):
                raise ValueError(f"{name}: got {len(values)} for {len(questions)} questions")
        for i, answer in enumerate(correct_answers):
            _check_answer(f"correct_answers[{i}]", answer, self.choices)
        correct_columns = [self.choices.index(answer) for answer in correct_answers]
        prompts = [self.prompt(q, c) for q, c in zip(questions, chains_of_thought)]

        result: list[float] = []
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                for start in range(0, len(prompts), self.batch_size):
                    letter_probs = self._letter_probabilities(prompts[start: start + self.batch_size])  # (b, L)
                    columns = torch.tensor(correct_columns[start: start + self.batch_size], device=letter_probs.device)
                    result.extend(letter_probs.gather(1, columns[:, None])[:, 0].tolist())
        finally:
            self.model.train(was_training)
        return result


def _completion_text(name: str, completion) -> str:
    """A completion as text: a string, or a conversation whose last message holds it."""
    if isinstance(completion, str):
        return completion
    last_message = completion[-1] if isinstance(completion, list) and completion else None
    if isinstance(last_message, dict) and isinstance(last_message.get("content"), str):
        return last_message["content"]
    raise TypeError(f"{name}: expected a string or a list of messages, got {type(completion).__name__}")


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
    _check_marker(marker)
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
        texts = [_completion_text(f"completions[{i}]", c) for i, c in enumerate(completions)]
        questions = question if question is not None else [_completion_text(f"prompts[{i}]", p)
                                                           for i, p in enumerate(prompts)]
        p_judge = judge.probabilities(list(questions), texts, list(answer))
        if log_metric is not None and count:
            log_metric("multichoice/p_correct_model", sum(p_model) / count)
            log_metric("multichoice/p_correct_judge", sum(p_judge) / count)
        return [model_p * (1.0 - judge_p) for model_p, judge_p in zip(p_model, p_judge)]

    return multichoice_judge_reward
