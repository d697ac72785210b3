"""P(correct answer) by running the policy again: the fallback when a trainer does not hand the reward the
completion's logits (stock TRL), and the baseline `logitless bench reward` measures what reading them saves."""

from __future__ import annotations

import torch

from logitless._checks import check_positive_finite
from logitless.hf import final_hidden_states, lm_head_of
from logitless.hf_probe import check_head
from logitless.multichoice.answer import extract_answer_probability_from_logits
from logitless.multichoice.letters import token_id_list


def answer_probability_by_recomputing(policy, tokenizer, prompt: str, completion_ids, correct_answer: str,
                                      choices: str = "ABCD", marker: str = "ANSWER:", renormalize: bool = True,
                                      *, temperature: float = 1.0) -> float:
    """P(correct_answer) by running ``policy`` again over prompt + completion.

    One more teacher-forced forward of the policy, whose completion rows go through the policy's head
    (`lm_head_of`: the sampling temperature, logit scale and soft cap of the loss's own definition) as
    materialized (C, V) logits, then the same reading as `extract_answer_probability_from_logits`. It
    is the fallback when the trainer does not pass ``completion_logits`` (stock TRL) and exists so a
    benchmark can show what reading the policy's own logits saves: the duplicate forward and its (C, V)
    tensor. The prompt is tokenized with special tokens, as TRL does.
    """
    if not isinstance(prompt, str):
        raise TypeError(f"prompt: expected a plain-text prompt, got {type(prompt).__name__}")
    ids = token_id_list("completion_ids", completion_ids)
    temperature = check_positive_finite("temperature", temperature)
    check_head(policy, "extract_answer_probability_from_logits reads the logits of its own forward", "policy")
    prompt_ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    if not prompt_ids:
        raise ValueError("prompt: tokenizes to no tokens; the first completion token needs a row to come from")
    device = next(policy.parameters()).device
    input_ids = torch.tensor([prompt_ids + ids], dtype=torch.long, device=device)  # (1, P + C)
    was_training = policy.training
    policy.eval()
    try:
        with torch.no_grad():
            hidden = final_hidden_states(policy,
                                         input_ids)[0, len(prompt_ids) - 1: -1]  # (C, H): row t predicts token t
            completion_logits = lm_head_of(policy, temperature).logits(hidden)  # (C, V) fp32, materialized
    finally:
        policy.train(was_training)
    return extract_answer_probability_from_logits(completion_logits, ids, tokenizer, correct_answer, choices,
                                                  renormalize=renormalize, marker=marker)
