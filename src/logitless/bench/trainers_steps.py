"""One trainer of `logitless bench trl` in this process (``python -m logitless.bench.trainers_steps --worker
NAME:IMPLEMENTATION``): built on the benchmark's data, its steps timed, the peak memory of its run."""

from __future__ import annotations

import statistics
import sys
import tempfile
import time

import torch
import trl
from datasets import Dataset
from transformers import AutoModelForCausalLM, TrainerCallback

import logitless.trl
from logitless.memory import PeakMemory, synchronize
from logitless.bench.timing import timed
from logitless.bench.trainers import IMPLEMENTATIONS, TRAINERS, TRLBenchConfig
from logitless.bench.worker import worker_main
from logitless.models import load_tokenizer

WORDS = ("alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "maple", "orbit", "cedar", "amber", "pixel")


def _text(index: int, words: int) -> str:
    """A text of ``words`` words, one token each in the Qwen vocabulary (with their leading space)."""
    return "".join(f" {WORDS[(index * 7 + k * 5) % len(WORDS)]}" for k in range(words))


def _length_reward(completions, **kwargs):
    return [float(len(completion)) for completion in completions]


def _answer_log_probs_with_logits(model, rows: list[tuple[list[int], int, int]]) -> list[torch.Tensor]:
    """The obvious way: ``rows`` (token ids, the first and one past the last answer token) left-padded into one
    no-grad forward of ``model`` with its logits ``(R, L, V)``, their log_softmax, the answer tokens' gathered."""
    length = max(len(ids) for ids, _, _ in rows)
    input_ids = torch.zeros(len(rows), length, dtype=torch.long, device=model.device)
    attention_mask = torch.zeros_like(input_ids)
    for row, (ids, _, _) in enumerate(rows):
        input_ids[row, length - len(ids):] = torch.tensor(ids)
        attention_mask[row, length - len(ids):] = 1
    with torch.no_grad():
        log_probs = torch.log_softmax(model(input_ids=input_ids, attention_mask=attention_mask).logits.float(),
                                      dim=-1)  # (R, L, V)
    return [log_probs[row, length - len(ids) + first - 1:length - len(ids) + stop - 1]
            .gather(-1, input_ids[row, length - len(ids) + first:length - len(ids) + stop, None])[:, 0]
            for row, (ids, first, stop) in enumerate(rows)]


def _materialized_reference_probability(model, tokenizer):
    """RLPR's reward written the obvious way, as a user of stock TRL would: the same rows as
    `logitless.trl.reference_probability_reward` scores (each completion with its answer replaced, and each prompt's
    answer alone), scored with the logits (`_answer_log_probs_with_logits`); the mean of the answer tokens'
    probabilities, debiased, clipped."""
    from logitless.trl.reference_probability import answer_alone, answer_replaced, covering_tokens, prompt_token_ids

    def reference_probability(prompts, completions, solution, **kwargs):
        rows, pairs, alone = [], [], {}  # (ids, first, stop); (completion's row, answer-alone row); prompt -> row

        def add_row(prompt_ids, text_span) -> int:
            ids, first, stop = covering_tokens(tokenizer, *text_span)
            rows.append((prompt_ids + ids, len(prompt_ids) + first, len(prompt_ids) + stop))
            return len(rows) - 1

        for prompt, completion, reference in zip(prompts, completions, solution):
            replaced = answer_replaced(completion, reference)
            if replaced is None:
                pairs.append(None)
                continue
            prompt_ids = prompt_token_ids(tokenizer, prompt)
            row = add_row(prompt_ids, replaced)
            key = (tuple(prompt_ids), reference)
            if key not in alone:  # once per prompt, as the fused reward scores it
                alone[key] = add_row(prompt_ids, answer_alone(reference))
            pairs.append((row, alone[key]))
        if not rows:
            return [0.0] * len(completions)
        probabilities = [log_probs.exp().mean().item() for log_probs in _answer_log_probs_with_logits(model, rows)]
        return [0.0 if pair is None else min(max(probabilities[pair[0]] - probabilities[pair[1]], 0.0), 1.0)
                for pair in pairs]

    return reference_probability


def _materialized_verifree_reward(model, tokenizer, answer_start: str, answer_template: str):
    """VeriFree's reward as a stock TRL user would write it for GRPO: R = pi(y* | x, z), the product of the
    probabilities of the reference answer's template after the completion's reasoning (what it wrote after
    ``answer_start`` replaced), scored with the logits (`_answer_log_probs_with_logits`); 0 without the tag."""
    from logitless.trl.reference_probability import answer_from_template, covering_tokens, prompt_token_ids

    def verifree_reward(prompts, completions, solution, **kwargs):
        rows, scored = [], []
        for prompt, completion, reference in zip(prompts, completions, solution):
            replaced = answer_from_template(completion, reference, answer_start, answer_template)
            scored.append(replaced is not None)
            if replaced is not None:
                prompt_ids = prompt_token_ids(tokenizer, prompt)
                ids, first, stop = covering_tokens(tokenizer, *replaced)
                rows.append((prompt_ids + ids, len(prompt_ids) + first, len(prompt_ids) + stop))
        rewards = iter(log_probs.sum().exp().item() for log_probs in _answer_log_probs_with_logits(model, rows)
                       ) if rows else iter(())
        return [next(rewards) if answered else 0.0 for answered in scored]

    return verifree_reward


def _with_an_answer(reward):
    """``reward`` on completions that each end in an answer tag and a word: a random model's completions carry no
    tag, and RLPR scores only completions with an answer to replace, so both rewards get every completion so."""

    def answered(prompts, completions, **kwargs):
        return reward(prompts, [completion + " <answer> maybe" for completion in completions], **kwargs)

    answered.__name__ = "reference_probability"
    return answered


def _tagged_within(tokenizer, completion_ids: list[int], tag: str, limit: int) -> str:
    """The completion's text, cut short (from its end, a token at a time) so that with `` tag`` and any of the
    benchmark's answers after it, tokenized again as the trainers tokenize it, it holds at most ``limit`` tokens."""
    longest = " " + max(WORDS, key=len)
    for keep in range(len(completion_ids), -1, -1):
        text = tokenizer.decode(completion_ids[:keep], skip_special_tokens=True) + " " + tag
        if len(tokenizer(text + longest, add_special_tokens=False)["input_ids"]) <= limit:
            return text
    raise ValueError(f"completion_length: {limit} tokens cannot hold the answer tag {tag!r} and an answer")


def _completions_ending_in_a_tag(trainer, tokenizer, tag: str, limit: int) -> None:
    """Makes ``trainer``'s completions end in ``tag``, with room before ``limit`` tokens for the answer after it: a
    random model writes no tag, and VeriFree rewards (and trains the answer of) only completions with one that fits,
    so both trainers get every completion so: the same completions, each tagged, for stock TRL's GRPO and VeriFree."""
    generate = trainer._generate

    def generate_tagged(prompts):
        prompt_ids, completion_ids, tool_mask, completions, *rest = generate(prompts)
        texts = [_tagged_within(tokenizer, list(ids), tag, limit) for ids in completion_ids]
        tagged_ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
        return (prompt_ids, tagged_ids, tool_mask, texts, *rest)

    trainer._generate = generate_tagged


def _trainer(name: str, implementation: str, model_dir: str, teacher_dir: str, output_dir: str,
             config: TRLBenchConfig):
    """Trainer ``name``: stock TRL's class, or logitless's of the same name, on the benchmark's data."""
    classes = trl if implementation == "trl" else logitless.trl
    settings = dict(output_dir=output_dir, use_cpu=config.device == "cpu", bf16=False, max_steps=config.steps,
                    logging_steps=1, report_to="none", save_strategy="no", seed=0, learning_rate=1e-5,
                    disable_tqdm=True)
    tokenizer = load_tokenizer(model_dir)
    kwargs = dict(model=model_dir, processing_class=tokenizer)
    if name in ("sft", "dpo", "kto"):
        half, count = config.seq // 2, config.batch * config.steps
        prompts = [_text(i, half) for i in range(count)]
        completions = [_text(i + 1, config.seq - half) for i in range(count)]
        data = {"sft": {"prompt": prompts, "completion": completions},
                "dpo": {"prompt": prompts, "chosen": completions, "rejected": [_text(i + 2, config.seq - half)
                                                                               for i in range(count)]},
                "kto": {"prompt": prompts, "completion": completions, "label": [i % 2 == 0 for i in range(count)]}}
        settings.update(per_device_train_batch_size=config.batch, max_length=config.seq + 8)
        kwargs["train_dataset"] = Dataset.from_dict(data[name])
    else:
        length = config.short_completion_length if name == "distill_short" else config.completion_length
        settings.update(per_device_train_batch_size=config.completions, max_completion_length=length)
        kwargs["train_dataset"] = Dataset.from_dict({"prompt": [_text(i, 16) for i in
                                                                range(config.completions * config.steps)]})
        if name.startswith("distill"):
            kwargs["teacher_model"] = teacher_dir
        else:
            settings["num_generations"] = 4
            kwargs["reward_funcs"] = _length_reward
        if name in ("rlpr", "verifree"):  # the policy scores its own probability of each prompt's reference answer
            kwargs["train_dataset"] = kwargs["train_dataset"].add_column("solution", [
                WORDS[i % len(WORDS)] for i in range(config.completions * config.steps)])
            kwargs["model"] = policy = AutoModelForCausalLM.from_pretrained(model_dir)
        if name == "rlpr":
            reward = (_materialized_reference_probability(policy, tokenizer) if implementation == "trl"
                      else logitless.trl.reference_probability_reward(policy, tokenizer))
            kwargs["reward_funcs"] = _with_an_answer(reward)
        if name == "verifree":  # VeriFree's objective, or stock GRPO with VeriFree's reward read from the logits
            # the answer a word after the tag: a random model's probability of the paper's 11-token template, a
            # product of 11 probabilities near 1/V, is 0 in fp32 for both trainers, which would compare nothing
            verifree = logitless.trl.VeriFreeConfig(**settings, answer_start="<answer>", answer_template=" {answer}")
            if implementation == "logitless":
                del kwargs["reward_funcs"]
                trainer = logitless.trl.VeriFreeTrainer(args=verifree, **kwargs)
            else:
                kwargs["reward_funcs"] = _materialized_verifree_reward(policy, tokenizer, verifree.answer_start,
                                                                       verifree.answer_template)
                trainer = trl.GRPOTrainer(args=trl.GRPOConfig(**settings), **kwargs)
            _completions_ending_in_a_tag(trainer, tokenizer, verifree.answer_start, length)
            return trainer
    config_class, trainer_class = {"sft": ("SFTConfig", "SFTTrainer"), "dpo": ("DPOConfig", "DPOTrainer"),
                                   "kto": ("KTOConfig", "KTOTrainer"), "rloo": ("RLOOConfig", "RLOOTrainer"),
                                   "grpo": ("GRPOConfig", "GRPOTrainer"), "rlpr": ("GRPOConfig", "GRPOTrainer"),
                                   "distill": ("DistillationConfig", "DistillationTrainer"),
                                   "distill_short": ("DistillationConfig", "DistillationTrainer")}[name]
    return getattr(classes, trainer_class)(args=getattr(trl, config_class)(**settings), **kwargs)


class StepClock(TrainerCallback):
    """The wall time of each optimizer step, and of the loss and its backward within it (``loss_seconds[0]``, summed
    by `bench.timing.timed` wrappers), the work queued on ``device`` included."""

    def __init__(self, device: torch.device, loss_seconds: list[float]):
        self.device, self.loss_seconds = device, loss_seconds
        self.seconds, self.loss_backward_seconds = [], []

    def on_step_begin(self, args, state, control, **kwargs):
        synchronize(self.device)
        self.started, self.loss_started = time.perf_counter(), self.loss_seconds[0]

    def on_step_end(self, args, state, control, **kwargs):
        synchronize(self.device)
        self.seconds.append(time.perf_counter() - self.started)
        self.loss_backward_seconds.append(self.loss_seconds[0] - self.loss_started)


def run_worker(worker: str, model_dirs: str, config: TRLBenchConfig) -> dict:
    """One trainer (``NAME:IMPLEMENTATION``) in this fresh process: its steps timed (whole, and the loss with its
    backward), the peak memory of the run."""
    name, implementation = worker.split(":")
    model_dir, teacher_dir = model_dirs.split(",")
    with tempfile.TemporaryDirectory() as output_dir:
        torch.manual_seed(0)
        trainer = _trainer(name, implementation, model_dir, teacher_dir, output_dir, config)
        device, loss_seconds = trainer.accelerator.device, [0.0]
        trainer.compute_loss = timed(trainer.compute_loss, loss_seconds, device)
        trainer.accelerator.backward = timed(trainer.accelerator.backward, loss_seconds, device)
        clock = StepClock(device, loss_seconds)
        trainer.add_callback(clock)
        torch.manual_seed(0)
        with PeakMemory(device) as peak:
            trainer.train()
            synchronize(device)
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        rewards = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]  # generating ones
    timed_steps = slice(1, None) if len(clock.seconds) > 1 else slice(None)  # the first step allocates
    return {"step_s": statistics.median(clock.seconds[timed_steps]), "steps_s": clock.seconds,
            "loss_backward_s": statistics.median(clock.loss_backward_seconds[timed_steps]),
            "peak_mb": peak.megabytes, "losses": losses, "rewards": rewards}


if __name__ == "__main__":
    sys.exit(worker_main(run_worker, TRLBenchConfig, tuple(f"{t}:{i}" for t in TRAINERS for i in IMPLEMENTATIONS),
                         "--model-dirs"))
