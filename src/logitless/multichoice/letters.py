"""The answer letters of a multiple-choice question as tokens: their checks, their token ids (the bare letter "A" and
the spaced one " A", different tokens in BPE vocabularies), and a letter's log-probability from its ids' logits."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from logitless._checks import check_tensor


def check_choices(choices) -> str:
    if not isinstance(choices, str):
        raise TypeError(f"choices: expected a string of answer letters such as 'ABCD', got {type(choices).__name__}")
    if not choices:
        raise ValueError("choices: expected at least one answer letter, got ''")
    if len(set(choices)) != len(choices):
        raise ValueError(f"choices: letters must be distinct, got {choices!r}")
    return choices


def check_marker(marker) -> str:
    if not isinstance(marker, str) or not marker:
        raise TypeError(f"marker: expected a non-empty string such as 'ANSWER:', got {marker!r}")
    return marker


def check_answer(name: str, answer, choices: str) -> str:
    if not isinstance(answer, str) or len(answer) != 1 or answer not in choices:
        raise ValueError(f"{name}: expected one of the letters {choices!r}, got {answer!r}")
    return answer


def token_id_list(name: str, ids) -> list[int]:
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
    check_choices(choices)
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


def letter_logsumexp(id_logits: torch.Tensor, token_ids: dict[str, list[int]]) -> torch.Tensor:
    """(..., N) logits at the letters' ids, in `token_ids` order -> (..., L) log-sum-exp per letter, fp32."""
    per_letter, start = [], 0
    for ids in token_ids.values():
        per_letter.append(torch.logsumexp(id_logits[..., start: start + len(ids)].float(), dim=-1))
        start += len(ids)
    return torch.stack(per_letter, dim=-1)
