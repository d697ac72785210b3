"""Reward functions: math answers (boxed / <answer> grading) and multiple choice (logits + judge)."""

from logitless.rewards.math import extract_answer, math_reward, normalize_answer
from logitless.multichoice.reward import (MultichoiceJudge, extract_answer_probability_from_logits,
                                           multichoice_judge_reward)

__all__ = ["MultichoiceJudge", "extract_answer", "extract_answer_probability_from_logits", "math_reward",
           "multichoice_judge_reward", "normalize_answer"]
