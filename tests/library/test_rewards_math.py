import pytest

from logitless.rewards.math import extract_answer, math_reward


@pytest.mark.parametrize("response, truth, correct", [
    ("<think>3+4</think> <answer>7</answer>", "7", True),
    ("<answer>8</answer>", "7", False),
    ("The answer is \\boxed{\\frac{3}{4}}.", "0.75", True),
    ("\\boxed{{1,000}}", "1000", True),
    ("<answer>50\\%</answer>", "0.5", True),
    ("<answer>$5.00</answer>", "5", True),
    ("<answer> x + 1 </answer>", "x+1", True),
    ("\\boxed{\\text{Paris}}", "paris", True),
    ("<answer>-2/4</answer>", "-0.5", True),
    ("first <answer>1</answer> then <answer>2</answer>", "2", True),
    ("Worked: \\boxed{12}", "so it is \\boxed{12}", True),
    ("\\boxed{(1,2)}", "12", False),  # a pair is not twelve: only thousands separators are dropped
    ("\\boxed{1,2}", "12", False),
    ("\\boxed{12,345,678}", "12345678", True),
    ("\\boxed{-\\frac{1}{2}}", "-0.5", True),
    ("\\boxed{\\$5.00}", "5", True),
])
def test_grading(response, truth, correct):
    reward = math_reward(response, truth)
    assert reward == {"reward": float(correct), "format_reward": 1.0, "answer_reward": float(correct)}


def test_no_answer_gets_no_format_reward():
    assert math_reward("I think it is 7", "7") == {"reward": 0.0, "format_reward": 0.0, "answer_reward": 0.0}
    assert extract_answer("\\boxed{unbalanced") is None


def test_nested_braces_in_boxed():
    assert extract_answer("\\boxed{\\frac{1}{2}} and \\boxed{x^{2}+1}") == "x^{2}+1"


def test_bad_input():
    with pytest.raises(TypeError, match="response"):
        math_reward(None, "1")
    with pytest.raises(TypeError, match="ground_truth"):
        math_reward("<answer>1</answer>", None)
