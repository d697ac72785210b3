"""A chain of thought without its final answer: what the judge reads."""

from __future__ import annotations

import re

from logitless.multichoice.letters import check_choices, check_marker


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
    check_choices(choices)
    check_marker(marker)
    markers = list(re.finditer(re.escape(marker), text, re.IGNORECASE))
    if markers:
        text = text[: markers[-1].start()].rstrip()
    statement = _final_answer_statement(choices).search(text)
    return text[: statement.start()].rstrip(" \t\n\r\f\v,;:.") if statement else text
