"""VeriFree (Zhou et al., 2025, "Reinforcing General Reasoning without Verifiers"): RL towards the reference answer
without a verifier, on logitless's fused LM head.

The policy samples a completion for a prompt x; its reasoning z is what it wrote before its first ``answer_start``
(with the tag). What follows is replaced by ``answer_template`` holding the prompt's reference answer y*, and the
objective is ``J = E_z[pi(y* | x, z)]``. With ``R_i = pi(y* | x, z_i) = exp(sum_{t in y*} log pi(y*_t | ...))``,
held constant, and ``b_i`` the mean R of the other completions of the prompt's group (RLOO), the loss is the
estimator of the paper's code (its defaults: ``reward_source p``, ``sft_coef_source reward``, ``critic_type
rloo``)::

    loss = mean_i [ -(R_i - b_i) * sum_{t in z_i} log pi(z_i,t)  -  R_i * sum_{t in y*} log pi(y*_t) ]

a sum over each sequence's tokens, not normalized by their count, and a mean over the batch's sequences. The two
terms are the policy gradient of the reasoning and the R-weighted likelihood of the answer; their gradient is
``E_z[R (grad log pi(z) + grad log pi(y* | z))] = grad J``, the baseline aside.

All three numbers come from ONE forward of the body over prompt + replaced completion, scored by the fused head:
the answer's log-probs give R, and with the reasoning's they give the loss. No ``(B, T, V)`` logits, and no pass
beyond the training forward (the paper's code scores R in a pass of its own first).

* The tokens. The replaced completion (the text up to and with the tag, then the filled template) is tokenized as
  one text; y*'s tokens are those whose characters overlap the filled template (a token the tokenizer merged
  across the tag's end counts as the answer's), everything before them is the reasoning. The defaults are the
  paper's: the tag ``<answer`` without its ``>``, which starts the template ``> \\boxed{y*} </answer>``, so that the
  tag's tokens are the same whatever follows it.
* No answer (the paper's rule): a completion without ``answer_start`` has R = 0; all of its sampled tokens are
  reasoning, pushed down by ``-b_i``, and it has no likelihood term. A completion whose replaced completion is
  longer than ``max_completion_length`` also has R = 0, its reasoning and answer in the sequence. Logged per batch:
  "verifree/no_answer" and "verifree/cut", the fractions of completions of each kind; "reward" is the mean R.
  (The paper's sampler stops at ``</answer>`` and also gives R = 0 to a completion it cut at the length limit
  after the tag; here generation stops at EOS, and what follows the tag, cut or not, is replaced.)

Every micro-batch holds whole groups (the baseline reads the group's R from the same forward), the batch is
trained on-policy (one optimizer step per generation, as in the paper), and TRL's loss options (``loss_type``,
``epsilon``, ``scale_rewards``, importance sampling) do not apply; options that would add a term the objective
lacks are refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from trl import GRPOTrainer
from trl.trainer.grpo_config import GRPOConfig  # the class itself, even where trl.GRPOConfig is replaced
from trl.trainer.utils import pad

from logitless._checks import check_answer_template, completion_text
from logitless.trl.checkpoints import AtomicCheckpoints
from logitless.trl.reference_probability import answer_from_template, covering_tokens
from logitless.trl.resume import ExactResume
from logitless.trl.seam import LogitlessHead

NO_ANSWER_METRIC = "verifree/no_answer"
CUT_METRIC = "verifree/cut"
# GRPOConfig options whose other values would add what VeriFree's objective lacks: name -> the value it needs
FIXED_OPTIONS = {"beta": 0.0, "num_iterations": 1, "use_vllm": False, "mask_truncated_completions": False,
                 "top_entropy_quantile": 1.0, "entropy_coef": 0.0, "log_completions": False}


@dataclass
class VeriFreeConfig(GRPOConfig):
    """`trl.GRPOConfig` with VeriFree's answer boundary and the dataset column of the reference answers.

    ``answer_column``: the dataset column holding each prompt's reference answer y*. ``answer_start``: where a
    completion's reasoning ends (its first occurrence, kept in the reasoning). ``answer_template``: what replaces
    the rest, a ``str.format`` template whose ``{answer}`` field is y* (literal braces doubled); it is what R is
    the probability of. The defaults are the paper's.
    """

    answer_column: str = field(default="solution", metadata={"help": "Dataset column of the reference answers."})
    answer_start: str = field(default="<answer", metadata={"help": "Where a completion's reasoning ends."})
    answer_template: str = field(default="> \\boxed{{{answer}}} </answer>",
                                 metadata={"help": "What replaces the rest of the completion; {answer} is y*."})

    def __post_init__(self):
        super().__post_init__()
        for name in ("answer_column", "answer_start"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"{name}: expected a non-empty string, got {getattr(self, name)!r}")
        check_answer_template("answer_template", self.answer_template)
        for name, needed in FIXED_OPTIONS.items():
            if getattr(self, name) != needed:
                raise ValueError(f"{name}: VeriFree's objective has no term for it; leave it at {needed!r}, got "
                                 f"{getattr(self, name)!r}")
        if self.per_device_train_batch_size % self.num_generations:
            raise ValueError(f"per_device_train_batch_size: must hold whole groups of num_generations="
                             f"{self.num_generations} completions (the baseline is read in the same forward), got "
                             f"{self.per_device_train_batch_size}")
        if self.gradient_accumulation_steps % self.steps_per_generation:
            raise ValueError(f"steps_per_generation: VeriFree trains on-policy, so it must divide "
                             f"gradient_accumulation_steps={self.gradient_accumulation_steps}, got "
                             f"{self.steps_per_generation}")
        if (self.num_generations_eval or self.num_generations) < 2:
            raise ValueError(f"num_generations_eval: the leave-one-out baseline needs at least 2 completions per "
                             f"prompt, got {self.num_generations_eval}")


def verifree_objective(log_probs: torch.Tensor, reasoning_mask: torch.Tensor, answer_mask: torch.Tensor,
                       rewarded: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """The paper's loss (see the module docstring) of one batch of whole groups.

    log_probs (B, C): each completion token's log-prob (differentiable); reasoning_mask, answer_mask (B, C): the
    reasoning's and y*'s tokens; rewarded (B,) bool: the completions whose R is read (False: R = 0); groups of
    ``group_size`` consecutive rows. Returns "loss" (), "reasoning_loss" and "answer_loss" (its two terms), and
    "rewards", "advantages" (B,), without gradient.
    """
    reasoning_mask, answer_mask = reasoning_mask.to(log_probs.dtype), answer_mask.to(log_probs.dtype)
    answer_log_prob = (log_probs * answer_mask).sum(-1)  # (B,) log pi(y* | x, z)
    rewards = torch.where(rewarded, answer_log_prob.detach().exp(), torch.zeros_like(answer_log_prob))  # (B,) R
    grouped = rewards.view(-1, group_size)  # (B / G, G)
    others = (grouped.sum(-1, keepdim=True) - grouped) / (group_size - 1)  # the RLOO baseline b_i
    advantages = (grouped - others).reshape(-1)  # (B,)
    reasoning_loss = -(advantages * (log_probs * reasoning_mask).sum(-1)).mean()
    answer_loss = -(rewards * answer_log_prob).mean()
    return {"loss": reasoning_loss + answer_loss, "reasoning_loss": reasoning_loss.detach(),
            "answer_loss": answer_loss.detach(), "rewards": rewards, "advantages": advantages}


def _reward_in_the_loss(*args, **kwargs):
    """TRL's trainer needs a reward source; VeriFree's reward is read in the training forward instead."""
    raise RuntimeError("VeriFreeTrainer computes its reward in the loss; no reward function is called")


class VeriFreeTrainer(AtomicCheckpoints, ExactResume, LogitlessHead, GRPOTrainer):
    """VeriFree on `trl.GRPOTrainer` (generation, logging, checkpoints, exact resume) and logitless's fused head; see
    the module docstring. ``args`` is a `VeriFreeConfig`; the dataset needs a "prompt" column and
    ``args.answer_column``. Generation is transformers' or a ``rollout_func``'s (text prompts or conversations)."""

    def __init__(self, model, args: VeriFreeConfig | None = None, train_dataset=None, eval_dataset=None,
                 processing_class=None, callbacks=None, optimizers=(None, None), peft_config=None,
                 rollout_func=None):
        if not isinstance(args, VeriFreeConfig):
            raise TypeError(f"args: expected a VeriFreeConfig, got {type(args).__name__}")
        super().__init__(model=model, reward_funcs=[_reward_in_the_loss], args=args, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class, callbacks=callbacks,
                         optimizers=optimizers, peft_config=peft_config, rollout_func=rollout_func)
        if not getattr(self._tokenizer, "is_fast", False):
            raise TypeError("processing_class: expected a fast tokenizer (is_fast): the answer's tokens are found from "
                            "the character offsets only fast tokenizers give")

    def _group_size(self) -> int:
        return self.num_generations if self.model.training else self.num_generations_eval

    def _prepare_inputs(self, generation_batch):
        """TRL's buffering of a generation batch, split into micro-batches of whole groups (in a shuffled order)."""
        if not self.model.training:
            return self._generate_and_score_completions(generation_batch)
        if self._step % self.args.steps_per_generation == 0 or self._buffered_inputs is None:
            batch = self._generate_and_score_completions(generation_batch)
            rows = len(batch["completion_ids"])
            order = torch.randperm(rows // self.num_generations).repeat_interleave(self.num_generations)
            order = order * self.num_generations + torch.arange(rows) % self.num_generations  # groups kept whole
            size = rows // self.args.steps_per_generation
            self._buffered_inputs = [{key: value[order[start:start + size].to(value.device)]
                                      for key, value in batch.items()} for start in range(0, rows, size)]
        return self._buffered_inputs[self._step % self.args.steps_per_generation]

    def _answer_replaced(self, completion_ids: list[int], completion: str, reference: str
                         ) -> tuple[list[int], int, int, bool, bool]:
        """(the completion's ids as trained, where y*'s tokens start and stop among them, whether it has an answer,
        whether its R is read)."""
        replaced = answer_from_template(completion, reference, self.args.answer_start, self.args.answer_template)
        if replaced is None:
            return completion_ids, len(completion_ids), len(completion_ids), False, False
        ids, first, stop = covering_tokens(self._tokenizer, *replaced)
        return ids, first, stop, True, len(ids) <= self.max_completion_length

    def _generate_and_score_completions(self, inputs):
        device = self.accelerator.device
        mode = "train" if self.model.training else "eval"
        column = self.args.answer_column
        if any(column not in row for row in inputs):
            raise ValueError(f"answer_column: the dataset needs a column '{column}' with each prompt's reference "
                             f"answer")
        if len(inputs) % self._group_size():
            raise ValueError(f"num_generations: a process's batch of {len(inputs)} holds no whole groups of "
                             f"{self._group_size()}")
        prompt_ids_list, completion_ids_list, tool_mask, completions, *_ = self._generate([x["prompt"] for x in inputs])
        if tool_mask is not None:
            raise ValueError("rollout_func: VeriFree trains every completion token as the policy's; an env_mask is "
                             "not supported")
        rows = []
        for i, (row, completion_ids) in enumerate(zip(inputs, completion_ids_list)):
            reference = row[column]
            if not isinstance(reference, str) or not reference.strip():
                raise ValueError(f"{column}[{i}]: expected a non-empty reference answer, got {reference!r}")
            rows.append(self._answer_replaced(list(completion_ids),
                                              completion_text(f"completions[{i}]", completions[i]), reference))
        ids = [torch.tensor(ids) for ids, *_ in rows]
        lengths = torch.tensor([len(i) for i in ids])
        positions = torch.arange(int(lengths.max()))  # (C,)
        first = torch.tensor([first for _, first, *_ in rows])[:, None]
        stop = torch.tensor([stop for _, _, stop, *_ in rows])[:, None]
        has_answer = torch.tensor([answered for *_, answered, _ in rows], device=device)
        rewarded = torch.tensor([read for *_, read in rows], device=device)
        prompts = [torch.tensor(p) for p in prompt_ids_list]
        self._metrics[mode][NO_ANSWER_METRIC].append(self.accelerator.gather(~has_answer).float().mean().item())
        self._metrics[mode][CUT_METRIC].append(self.accelerator.gather(has_answer & ~rewarded).float().mean().item())
        return {"prompt_ids": pad(prompts, self._tokenizer.pad_token_id, "left").to(device),
                "prompt_mask": pad([torch.ones_like(p) for p in prompts], 0, "left").to(device),
                "completion_ids": pad(ids, self._tokenizer.pad_token_id, "right").to(device),
                "completion_mask": (positions < lengths[:, None]).long().to(device),  # (B, C)
                "reasoning_mask": (positions < first).to(device),
                "answer_mask": ((positions >= first) & (positions < stop)).to(device), "rewarded": rewarded}

    def _compute_loss(self, model, inputs):
        mode = "train" if self.model.training else "eval"
        completion_ids = inputs["completion_ids"]
        log_probs, entropies, _ = self._get_per_token_logps_and_entropies(
            model, torch.cat([inputs["prompt_ids"], completion_ids], dim=1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1), completion_ids.size(1),
            compute_entropy=True)  # (B, C): the one forward
        terms = verifree_objective(log_probs, inputs["reasoning_mask"], inputs["answer_mask"], inputs["rewarded"],
                                   self._group_size())
        rewards = self.accelerator.gather(terms["rewards"])
        mask = inputs["completion_mask"].bool()
        entropy = self.accelerator.gather(torch.stack([entropies[mask].sum(), mask.sum().float()]).detach()[None])
        metrics = {"reward": rewards.mean(), "reward_std": rewards.std(),
                   "verifree/reasoning_loss": self.accelerator.gather(terms["reasoning_loss"]).mean(),
                   "verifree/answer_loss": self.accelerator.gather(terms["answer_loss"]).mean(),
                   "entropy": entropy[:, 0].sum() / entropy[:, 1].sum().clamp(min=1)}
        for name, value in metrics.items():
            self._metrics[mode][name].append(value.item())
        return terms["loss"] / (self.current_gradient_accumulation_steps if mode == "train" else 1.0)

