"""Reward functions: math answers (boxed / <answer> grading)."""

from logitless.rewards.math import extract_answer, math_reward, normalize_answer

__all__ = ["extract_answer", "math_reward", "normalize_answer"]
