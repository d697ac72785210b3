"""Where a completion gives its answer, and P(correct answer) read there from the completion's own logits.

Only ONE row is read: the row the answer letter was sampled from. The rows may be a
`logitless.ops.lazy.CompletionLogits`, so no ``(C, V)`` tensor is ever built.
"""

from __future__ import annotations

import torch

from logitless._checks import check_tensor
from logitless.multichoice.letters import (check_answer, check_marker, choice_token_ids, letter_logsumexp,
                                           token_id_list)


def find_answer_position(completion_ids, tokenizer, choices: str = "ABCD", marker: str = "ANSWER:") -> int | None:
    """Index of the answer letter's token in the completion, or None.

    The first choice-letter token after the last occurrence of ``marker`` (case-insensitive) in the
    decoded completion, or None when none follows it (a letter before the marker is not the answer);
    without a marker, the last choice-letter token anywhere in it; else None.
    """
    ids = token_id_list("completion_ids", completion_ids)
    check_marker(marker)
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
    letter_log_probs = letter_logsumexp(row[flat_ids], token_ids)  # (L,) unnormalized
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
    check_answer("correct_answer", correct_answer, choices)
    ids = token_id_list("completion_ids", completion_ids)
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
