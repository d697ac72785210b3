"""Reward functions: math answers (boxed / <answer> grading). Multiple choice lives in `logitless.multichoice`."""

from logitless.rewards.math import extract_answer, math_reward, normalize_answer

__all__ = ["extract_answer", "math_reward", "normalize_answer"]
