"""``make demo``: the embedded tiny Qwen2 (real 151,936-token Qwen vocabulary) learns from a reward on CPU,
logit-free, in a few minutes, and a summary table says what the fused path saved.

1. Warm-up SFT (`warm_start`) of "tiny-qwen2-untied": the model learns the answer format
   " ANSWER: <ordinal> <letter>" on sums it cannot solve, so it does not know which option to pick yet.
2. GRPO with `GRPOTrainerWithLogits` and the judge reward ``P(correct | model) * (1 - P(correct |
   judge))`` on "Which number is the largest?" with the options in increasing order: the answer is
   always the last one, a rule the policy can only learn from the reward. P(correct | model) is read
   from the policy's own logits (no extra forward); the judge is a frozen copy of the warm-up model.
3. A short GRADE run (`logitless grade`'s default): the untrained tiny Qwen2 learns to write capitalized
   words by backpropagating that reward through its Gumbel-softmax rollouts, top-k soft tokens and the
   exact KL from hidden states, no (B, T, V) tensor (grade/gumbel/reward.png).
4. Accuracy on held-out questions (sampled) before and after GRPO; the peak memory of one GRPO step
   with stock TRL (logits) and with GRPOTrainerWithLogits, each in a fresh process
   (`logitless bench grpo`); the error of fused and of materialized log-probs against float64.
   The summary table, printed and written to OUTPUT_DIR/summary.md.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tqdm import tqdm

from logitless import interrupts
from logitless.data import tokenize_prompt_and_output
from logitless.demo_options import DemoConfig
from logitless.hf import final_hidden_states, lm_head_of
from logitless.logprobs import get_response_log_probs
from logitless.models import load_model_and_tokenizer
from logitless.multichoice.data import synthetic_multichoice
from logitless.multichoice.accuracy import sampled_accuracy
from logitless.multichoice.warm_start import multichoice_sft_pairs, warm_start_policy
from logitless.plots import plot_curve
from logitless.recipes.grpo import train_grpo_multichoice
from logitless.recipes.grpo_options import MultichoiceGRPOConfig
from logitless.recipes.options import option_error
from logitless.rundir import RunDirectory

TASK = ("sorted_largest",)  # "Which number is the largest?", options in increasing order
OUTPUTS = ("sft", "grpo", "grade", "warm_start.jsonl", "questions.jsonl", "summary.md")


def quarter_means(values: list[float]) -> tuple[float, float]:
    """Means of the first and of the last quarter of ``values`` (at least one value each)."""
    quarter = max(len(values) // 4, 1)
    return sum(values[:quarter]) / quarter, sum(values[-quarter:]) / quarter


def log_prob_errors(model_dir: str | Path) -> dict[str, float]:
    """Max |error| of the response tokens' log-probs on the warm-up model, fused (``impl="auto"``) and materialized
    (``impl="reference"``), against a float64 computation from the same hidden states (fp32 log_softmax over
    151,936 logits rounds)."""
    model, tokenizer = load_model_and_tokenizer(str(model_dir))
    pairs = multichoice_sft_pairs(synthetic_multichoice(count=8, seed=7))
    tensors = tokenize_prompt_and_output([p["prompt"] for p in pairs], [p["response"] for p in pairs], tokenizer)
    rows = tensors["response_mask"].bool()  # (B, T)
    with torch.no_grad():
        scored = {impl: get_response_log_probs(model, tensors["input_ids"], tensors["labels"], impl=impl)["log_probs"]
                  for impl in ("auto", "reference")}
        hidden = final_hidden_states(model, tensors["input_ids"])[rows].double()  # (N, H), response rows only
        exact = torch.log_softmax(hidden @ lm_head_of(model).weight.double().T, dim=-1)  # (N, V) float64
        exact = exact.gather(-1, tensors["labels"][rows][:, None])[:, 0]
    return {impl: (log_probs[rows].double() - exact).abs().max().item() for impl, log_probs in scored.items()}


STARTS_OVER = "a rerun of `logitless demo` starts over (it keeps no checkpoint to resume from)"


def phase(number: int, words: str) -> None:
    """The demo enters phase ``number`` of 4: an interrupt names it and the step reached."""
    interrupts.stage(f"in phase {number} of 4 ({words})", STARTS_OVER)


def train_demo(config: DemoConfig, directory: Path, *, progress: bool = True) -> dict:
    """Steps 1 and 2 and the accuracies of step 3, in ``directory``; returns the numbers of the summary."""
    print(f"logitless demo 1/4: {config.steps} + {config.steps // 10} warm-up SFT steps of tiny-qwen2-untied "
          "(vocabulary 151,936): the answer format ' ANSWER: <ordinal> <letter>', on sums it cannot solve")
    phase(1, "the warm-up SFT")
    sft, policy_dir = warm_start_policy(directory / "sft", steps=config.steps, progress=progress,
                                        data_file=directory / "warm_start.jsonl", on_step=interrupts.step_done)
    plot_curve(sft["loss"], directory / "sft" / "loss.png", title="SFT loss (mean token NLL on responses)",
               ylabel="loss (nats/token)")
    print(f"SFT loss {sft['loss'][0]:.3f} -> {sft['loss'][-1]:.3f} nats/token in {sft['seconds']:.0f}s; "
          f"plot: {directory / 'sft' / 'loss.png'}")

    questions = directory / "questions.jsonl"
    records = synthetic_multichoice(count=256, seed=1, kinds=TASK)
    questions.write_text("\n".join(json.dumps({k: r[k] for k in ("question", "choices", "answer")})
                                   for r in records) + "\n")
    held_out = synthetic_multichoice(count=config.eval_questions, seed=2, kinds=TASK)
    print(f"logitless demo 2/4: {config.grpo_steps} GRPO steps of {config.completions_per_step} completions with "
          "GRPOTrainerWithLogits on 'Which number is the largest?' (options in increasing order); reward "
          "P(correct|model) x (1 - P(correct|judge)), P(correct|model) read from the policy's own logits")
    phase(2, "GRPO")
    grpo = train_grpo_multichoice(MultichoiceGRPOConfig(
        model=str(policy_dir), data=str(questions), output_dir=str(directory / "grpo"), steps=config.grpo_steps,
        save_every=config.grpo_steps, completions_per_step=config.completions_per_step,
        num_generations=config.num_generations, max_completion_length=8, learning_rate=config.grpo_learning_rate),
        progress=progress)
    print(f"plot: {directory / 'grpo' / 'reward.png'}")
    phase(2, "held-out accuracy before and after GRPO")
    before_and_after = tqdm((policy_dir, directory / "grpo" / f"checkpoint-{config.grpo_steps}"),
                            desc="held-out accuracy", unit="model", disable=not progress)
    return {"sft_loss": (sft["loss"][0], sft["loss"][-1]), "reward": quarter_means(grpo["reward"]),
            "p_correct_model": quarter_means(grpo["p_correct_model"]),
            "p_correct_judge": quarter_means(grpo["p_correct_judge"]), "steps_trained": len(grpo["reward"]),
            "accuracy": tuple(sampled_accuracy(model_dir, held_out) for model_dir in before_and_after),
            "completions_scored": config.completions_per_step * len(grpo["reward"]),
            "history": grpo, "policy_dir": policy_dir}


def train_grade_demo(config: DemoConfig, directory: Path, *, progress: bool = True) -> tuple[float, float] | None:
    """Step 3: `logitless grade`'s default run, shortened; the reward's first- and last-quarter means."""
    if not config.grade_steps:
        return None
    from logitless.recipes.grade import train_grade
    from logitless.recipes.grade_options import GradeRunConfig

    print(f"logitless demo 3/4: {config.grade_steps} GRADE steps (Gumbel-softmax, top-k soft tokens, exact KL from "
          "hidden states) of an untrained tiny-qwen2; reward: the fraction of capitalized words it writes")
    phase(3, "GRADE")
    run = GradeRunConfig(output_dir=str(directory / "grade"), steps=config.grade_steps, save_every=config.grade_steps)
    rewards = [row["reward"] for row in train_grade(run, progress=progress)["gumbel"]]
    print(f"plot: {directory / 'grade' / 'gumbel' / 'reward.png'}")
    return quarter_means(rewards)


def measure_step_memory(config: DemoConfig, *, progress: bool = False) -> dict | None:
    """Peak memory of one GRPO step, stock TRL vs GRPOTrainerWithLogits, in fresh processes (bench grpo)."""
    if not config.memory_completion_length:
        return None
    from logitless.bench import grpo as bench_grpo

    report = bench_grpo.run(bench_grpo.GRPOBenchConfig(
        completions=config.memory_completions, completion_length=config.memory_completion_length,
        num_generations=config.num_generations, steps=1, setups=("default",)), progress=progress, concurrently=True)
    return {name: result["peak_mb"] for name, result in report["results"]["default"].items()}


def summary_table(config: DemoConfig, results: dict, memory: dict | None,
                  grade_reward: tuple[float, float] | None = None) -> str:
    """The demo's outcome as a markdown table."""
    quarter = max(results["steps_trained"] // 4, 1)
    accuracy = results["accuracy"]
    rows = ["| | start | end |", "|---|---|---|",
            f"| judge reward (mean of the first / last {quarter} GRPO steps) | {results['reward'][0]:.3f} | "
            f"{results['reward'][1]:.3f} |",
            f"| P(correct \\| model), same steps | {results['p_correct_model'][0]:.3f} | "
            f"{results['p_correct_model'][1]:.3f} |",
            f"| P(correct \\| judge), same steps | {results['p_correct_judge'][0]:.3f} | "
            f"{results['p_correct_judge'][1]:.3f} |",
            f"| accuracy on {config.eval_questions} held-out questions (4 samples each) | {accuracy[0]:.0%} | "
            f"{accuracy[1]:.0%} |"]
    if grade_reward is not None:
        grade_quarter = max(config.grade_steps // 4, 1)
        rows.append(f"| GRADE reward, capitalized words (mean of the first / last {grade_quarter} GRADE steps) | "
                    f"{grade_reward[0]:.3f} | {grade_reward[1]:.3f} |")
    rows += ["", "| what the fused path saved | stock TRL (logits) | logitless |", "|---|---|---|"]
    if memory is not None:
        ratio = memory["logitless"] / memory["trl"] if memory["trl"] >= 1 else float("nan")
        rows.append(f"| peak memory of one GRPO step ({config.memory_completions} completions x "
                    f"{config.memory_completion_length} tokens), fresh process | {memory['trl']:.0f} MB | "
                    f"{memory['logitless']:.0f} MB ({ratio:.2f}x) |")
    rows.append(f"| policy forwards made by the reward to read P(correct \\| model) | "
                f"{results['completions_scored']} (one per completion) | 0 (reads completion_logits) |")
    return "\n".join(rows)


def run(config: DemoConfig) -> int:
    run_dir = RunDirectory.claim(config.output_dir, "demo", outputs=OUTPUTS)
    run_dir.start({"steps": config.steps, "grpo_steps": config.grpo_steps}, resume=False,
                  result_options=())  # the demo starts over: its own earlier outputs are replaced
    directory = run_dir.path
    results = train_demo(config, directory)
    grade_reward = train_grade_demo(config, directory)
    print("logitless demo 4/4: held-out accuracy, peak memory of a GRPO step with and without logits (fresh "
          "processes), fused vs materialized")
    phase(4, "measuring a GRPO step's peak memory and the log-probs' error")
    memory = measure_step_memory(config, progress=True)
    errors = log_prob_errors(results["policy_dir"])
    table = summary_table(config, results, memory, grade_reward)
    (directory / "summary.md").write_text(table + "\n")
    print(f"\n{table}\n\nlog-probs of the warm-up model's response tokens against float64: fused max error "
          f"{errors['auto']:.1e}, materialized (fp32 logits, log_softmax) {errors['reference']:.1e}\n"
          f"summary: {directory / 'summary.md'}")
    first, last = results["sft_loss"]
    if not last < first or errors["auto"] > 1e-4 or results["steps_trained"] != config.grpo_steps:
        print("demo FAILED: the SFT loss did not fall, GRPO did not run every step, or the fused path is off")
        return 1
    return 0


def run_command(config: DemoConfig) -> int:
    """The demo with checked options: the output directory is claimed (errors name --output-dir), then `run`."""
    try:
        RunDirectory.claim(config.output_dir, "demo", outputs=OUTPUTS)
    except (TypeError, ValueError) as err:
        raise option_error(err, ("output_dir",)) from None
    return run(config)
