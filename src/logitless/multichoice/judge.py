"""`MultichoiceJudge`: P(correct | chain of thought) under a frozen causal LM, renormalized over the answer letters."""

from __future__ import annotations

import torch

from logitless._checks import check_finite, check_positive_int, check_strings
from logitless.data import left_padded, pad_token_id
from logitless.hf import final_hidden_states, lm_head_of
from logitless.hf_probe import OWN_FORWARD, check_head
from logitless.multichoice.letters import check_answer, check_marker, choice_token_ids, letter_logsumexp
from logitless.multichoice.strip import strip_final_answer
from logitless.ops.head import LinearHead


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
        check_head(model, OWN_FORWARD)  # the judge reads the letters' logits from the hidden states the head reads
        check_positive_int("batch_size", batch_size)
        if not isinstance(strip_answer, bool):
            raise TypeError(f"strip_answer: expected a bool, got {type(strip_answer).__name__}")
        self.model, self.tokenizer = model, tokenizer
        self.token_ids = choice_token_ids(tokenizer, choices)
        # (N,): every letter's token ids, letter after letter
        self.letter_token_ids = torch.tensor([t for ids in self.token_ids.values() for t in ids], dtype=torch.long)
        self.choices, self.marker = choices, check_marker(marker)
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
        return torch.log_softmax(letter_logsumexp(id_logits, self.token_ids), dim=-1)

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
            check_answer(f"correct_answers[{i}]", answer, self.choices)
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
