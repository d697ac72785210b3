"""Grading math answers: find the final answer in a response and compare it with the truth.

The answer is the content of the last ``<answer>...</answer>``, else of the last ``\\boxed{...}``
(braces balanced). Two answers are equal if both parse as numbers within a relative 1e-6
(integers, decimals, ``1,000``, ``3/4``, ``\\frac{3}{4}``, ``50\\%``, ``$5``), else if their
normalized strings match (case, spaces, ``\\text{}``, ``\\left``/``\\right``, a trailing period).
"""

from __future__ import annotations

import math
import re

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_FRAC = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
_TEXT = re.compile(r"\\(?:text|mathrm|textbf|mbox)\{([^{}]*)\}")


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    brace = text.find("{", start)
    if brace < 0:
        return None
    depth = 0
    for i in range(brace, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[brace + 1: i]
    return None


def extract_answer(response: str) -> str | None:
    """The final answer of a response, or None when it has neither an <answer> tag nor a \\boxed{}."""
    if not isinstance(response, str):
        raise TypeError(f"response: expected a string, got {type(response).__name__}")
    tagged = _ANSWER_TAG.findall(response)
    if tagged:
        inner = tagged[-1]
        boxed = _last_boxed(inner)
        return (boxed if boxed is not None else inner).strip()
    boxed = _last_boxed(response)
    return boxed.strip() if boxed is not None else None


_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")  # a comma between digit groups of three


def normalize_answer(answer: str) -> str:
    """A canonical string form: no spaces, braces, $, \\left/\\right, \\text{} wrappers, trailing period; lower case."""
    text = _TEXT.sub(r"\1", answer)
    for token in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\$", "$", " ", "{", "}"):
        text = text.replace(token, "")
    return text.rstrip(".").lower()


def _as_number(answer: str) -> float | None:
    text = _THOUSANDS.sub("", normalize_answer(_FRAC.sub(r"(\1)/(\2)", answer)))  # 1,000 -> 1000; (1,2) stays
    percent = text.endswith("\\%") or text.endswith("%")
    text = text.removesuffix("\\%").removesuffix("%")
    # an optional sign before a parenthesized fraction (-\frac{1}{2} -> -(1)/(2)), a number, an optional denominator
    match = re.fullmatch(r"([-+]?)\(?([-+]?\d*\.?\d+(?:e[-+]?\d+)?)\)?(?:/\(?([-+]?\d*\.?\d+)\)?)?", text)
    if not match:
        return None
    value = float(match.group(2)) * (-1.0 if match.group(1) == "-" else 1.0)
    if match.group(3) is not None:
        denominator = float(match.group(3))
        if denominator == 0:
            return None
        value /= denominator
    return value / 100 if percent else value


def answers_match(given: str, truth: str) -> bool:
    given_number, true_number = _as_number(given), _as_number(truth)
    if given_number is not None and true_number is not None:
        return math.isclose(given_number, true_number, rel_tol=1e-6, abs_tol=1e-9)
    return normalize_answer(given) == normalize_answer(truth)


def math_reward(response: str, ground_truth: str) -> dict[str, float]:
    """``reward_fn(response, ground_truth)`` for `compute_group_normalized_rewards`.

    format_reward is 1 when the response states an answer (<answer> tag or \\boxed{}); answer_reward
    is 1 when that answer equals the truth; reward = answer_reward. A ground truth that is itself a
    worked solution is reduced to its own boxed/tagged answer first.
    """
    if not isinstance(ground_truth, (str, int, float)):
        raise TypeError(f"ground_truth: expected a string or number, got {type(ground_truth).__name__}")
    truth = str(ground_truth)
    truth = extract_answer(truth) or truth
    given = extract_answer(response)
    if given is None:
        return {"reward": 0.0, "format_reward": 0.0, "answer_reward": 0.0}
    correct = float(answers_match(given, truth))
    return {"reward": correct, "format_reward": 1.0, "answer_reward": correct}
