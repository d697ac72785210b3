"""The multiple-choice judge as a differentiable GRADE reward.

`MultichoiceJudge` reads ``question + "\\nReasoning: " + chain of thought + "\\n" + marker`` and its
next-token distribution over the answer letters gives P(correct | chain of thought). Here the chain
of thought is the policy's soft completion, entered as embeddings (the judge's own embedding of the
soft tokens), so the probability is differentiable with respect to the completion. Soft tokens are not
text, so the judge's ``strip_answer`` cannot apply: the judge reads the completion as it is.

``objective="judge"`` trains the policy to write reasoning from which the judge finds the answer,
R = P(correct | judge). ``objective="hide"`` is the judge's factor of the multiple-choice GRPO reward,
R = 1 - P(correct | judge): reasoning that does not give the answer away.
"""

from __future__ import annotations

import torch

from logitless._checks import check_choice
from logitless.grade.parts import CausalLMParts
from logitless.grade.rewards import RewardInputs, SoftReward, frozen, sequence_inputs
from logitless.grade.soft_tokens import PromptBatch
from logitless.multichoice.judge import MultichoiceJudge


class MultichoiceJudgeReward(SoftReward):
    """Each prompt record needs ``answer`` (the correct letter) and ``question`` (else its ``prompt`` is used)."""

    def __init__(self, judge: MultichoiceJudge, objective: str = "judge"):
        if not isinstance(judge, MultichoiceJudge):
            raise TypeError(f"judge: expected a MultichoiceJudge, got {type(judge).__name__}")
        self.judge, self.objective = judge, check_choice("objective", objective, ("judge", "hide"))
        self.model = frozen(judge.model)
        self.parts = CausalLMParts.of(judge.model, "reward_model")
        self.suffix_ids = torch.tensor(judge.tokenizer.encode("\n" + judge.marker, add_special_tokens=False))

    def __call__(self, inputs: RewardInputs) -> torch.Tensor:
        records = inputs.prompt.records
        for i, record in enumerate(records):
            answer = record.get("answer")
            if not isinstance(answer, str) or len(answer) != 1 or answer not in self.judge.choices:
                raise ValueError(f"prompts[{i}]: needs an 'answer' among the letters {self.judge.choices!r}, "
                                 f"got {record.get('answer')!r}")
        device = inputs.prompt.input_ids.device
        prefix = PromptBatch.from_records(
            [{"prompt": f"{r.get('question', r['prompt'])}\nReasoning: "} for r in records], self.judge.tokenizer,
            device)
        batch = sequence_inputs(self.parts.embedding, prefix, inputs.completion, self.suffix_ids)
        hidden = self.parts.body(**batch, use_cache=False).last_hidden_state[:, -1]  # (B, H)
        letter_log_probs = self.judge.letter_log_probs(hidden, self.parts.head)  # (B, L)
        correct = torch.tensor([self.judge.choices.index(r["answer"]) for r in records], device=device)
        p_correct = letter_log_probs.gather(1, correct[:, None])[:, 0].exp()
        return p_correct if self.objective == "judge" else 1.0 - p_correct
