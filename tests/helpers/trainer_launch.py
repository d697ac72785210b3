"""logitless's TRL trainers as a training script, run by tests/trl/test_trl_launch.py alone and under torchrun, on CPU.

``python trainer_launch.py MODEL_DIR OUTPUT --teacher TEACHER_DIR [--trainers sft dpo ...] [--layout fsdp2|tp]
[--rollouts fixed|generated] [--summary]``

Each trainer trains one SGD step at learning rate 1 (distillation: 100) on a global batch of four prompts (RLOO
and GRPO: two prompts, two completions each), whatever the number of processes (each takes its share), so the
weights move by exactly the gradient; the main process saves, per trainer, the weights after the step (whole, from
DTensor shards too) and the logged metrics. RLOO, GRPO and distillation generate: here their completions are drawn
from a generator seeded by the prompt, the same whichever process receives it. ``--layout fsdp2``: the models (the
teacher too) are loaded sharded over every process as docs/distributed.md says, ``DistributedConfig(fsdp_size=
WORLD_SIZE, fsdp_plan={"lm_head": "free_full_weight"})``: the LM head is an FSDP unit of its own, whose forward
logitless never calls, so it stays a DTensor sharded on the vocabulary (had FSDP2 gathered it, logitless would say
so in the log); the shape of every DTensor gathered whole (``full_tensor``) while a trainer trains is saved, with
every collective (and the FSDP2 unit whose unshard issued it) and every unshard of a unit holding an LM head.
``--rollouts generated``: RLOO and GRPO sample their completions with the trainer's own generation (rewarded by
their first token) instead, and before training, this rank's prompts are decoded greedily by the policy and by the
whole model loaded in this process (their largest logits difference saved).
``--layout tp``: transformers' tensor parallelism (``DistributedConfig(tp_size=WORLD_SIZE)``), which accelerate
refuses on CPU.
"""

import argparse
import os
import random
from collections import Counter

import torch
import trl
from datasets import Dataset
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

import logitless.trl
from logitless.models import qwen_tokenizer

GLOBAL_BATCH = 4
PROMPTS = ["What is 2+2?", "Name a color.", "Say hi.", "Count to three:"]
COMPLETIONS = [" 4", " Red, or maybe blue.", " Hi there!", " One, two, three."]
OTHERS = [" 5", " A dog.", " Goodbye.", " Three, two, one."]
TRAINERS = ("sft", "dpo", "kto", "rloo", "grpo", "distill")
GATHERED: list[tuple[int, ...]] = []  # the shape of every DTensor gathered whole while a trainer trains
# every collective that moves tensors while a trainer trains: (its name, the FSDP2 parameter group whose unshard
# issued it or "" for any other caller, such as the fused ops' gathers of hidden states, the bytes it received)
COLLECTIVES: list[tuple[str, str, int]] = []
COUNTED = ("all_gather_single", "all_gather_into_tensor", "all_gather", "_all_gather_base", "all_to_all_single",
           "reduce_scatter_single", "reduce_scatter_tensor", "all_reduce")
HEAD_UNSHARDS: list[str] = []  # one entry per FSDP2 unshard of a parameter group that holds an LM head's weight
HEAD_WEIGHTS: set[int] = set()  # id() of the LM head weights (policy, teacher, reference) whose unshards are counted
_UNSHARDING: list[str] = []  # the parameter group whose unshard is running


def _count_gathers() -> None:
    """Count, while a trainer trains: every DTensor gathered whole (``full_tensor``), every collective of `COUNTED`
    with the FSDP2 parameter group that issued it, and every unshard of a group that holds an LM head's weight
    (`HEAD_WEIGHTS`)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    real_full_tensor, real_unshard = DTensor.full_tensor, FSDPParamGroup.unshard

    def full_tensor(self, *args, **kwargs):
        GATHERED.append(tuple(self.shape))
        return real_full_tensor(self, *args, **kwargs)

    def unshard(self, *args, **kwargs):
        holds_head = any(id(fsdp_param.sharded_param) in HEAD_WEIGHTS for fsdp_param in self.fsdp_params)
        name = ("head:" if holds_head else "") + (self._module_fqn or "root")
        if holds_head:
            HEAD_UNSHARDS.append(name)
        _UNSHARDING.append(name)
        try:
            return real_unshard(self, *args, **kwargs)
        finally:
            _UNSHARDING.pop()

    DTensor.full_tensor, FSDPParamGroup.unshard = full_tensor, unshard
    for collective in COUNTED:
        real = getattr(torch.distributed, collective, None)
        if real is None:
            continue

        def counted(output, *args, _real=real, _name=collective, **kwargs):
            outputs = output if isinstance(output, list) else [output]
            received = sum(tensor.numel() * tensor.element_size() for tensor in outputs)
            COLLECTIVES.append((_name, _UNSHARDING[-1] if _UNSHARDING else "", received))
            return _real(output, *args, **kwargs)

        setattr(torch.distributed, collective, counted)


class FixedRollouts:
    """Mixin for the trainers that generate: completion k of a prompt drawn from a generator seeded by the prompt
    and k, instead of sampled from the policy (the same completions in one process and in several)."""

    def _generate_single_turn(self, prompt_ids, *args, **kwargs):
        drawn = Counter()
        completions = []
        for ids in prompt_ids:
            key = tuple(ids)
            draw = random.Random(f"{key}#{drawn[key]}")
            drawn[key] += 1
            completions.append([draw.randrange(100, 5000) for _ in range(draw.randint(2, 6))])
        return (completions, None) if isinstance(self, trl.GRPOTrainer) else completions  # GRPO's: and log-probs


def length_reward(completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]


def first_token_reward(completion_ids, **kwargs):
    """A reward that differs between sampled completions of a random model (which rarely ends one early)."""
    return [float(ids[0] % 5) for ids in completion_ids]


def load(model_dir: str, layout: str):
    """The model directory (one process, DDP) or the model loaded sharded over every process: ``layout`` "fsdp2" or
    "tp" (transformers' tensor parallelism, ``DistributedConfig(tp_size=WORLD_SIZE)``)."""
    if layout == "whole":
        return model_dir
    from transformers.distributed import DistributedConfig

    processes = int(os.environ["WORLD_SIZE"])
    if layout == "tp":
        sharding = DistributedConfig(tp_size=processes)
    else:
        sharding = DistributedConfig(fsdp_size=processes, fsdp_plan={"lm_head": "free_full_weight"})
    return AutoModelForCausalLM.from_pretrained(model_dir, distributed_config=sharding, dtype=torch.float32)


def build(name: str, model_dir: str, teacher_dir: str, output_dir: str, layout: str, rollouts: str = "fixed"):
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    settings = dict(output_dir=output_dir, use_cpu=True, bf16=False, max_steps=1, logging_steps=1, report_to="none",
                    save_strategy="no", seed=0, optim="sgd", learning_rate=1.0, max_grad_norm=1e9,
                    per_device_train_batch_size=GLOBAL_BATCH // world_size)
    common = dict(model=load(model_dir, layout), processing_class=qwen_tokenizer())
    if name == "sft":
        return logitless.trl.SFTTrainer(args=trl.SFTConfig(**settings), **common, train_dataset=Dataset.from_dict(
            {"prompt": PROMPTS, "completion": COMPLETIONS}))
    if name == "dpo":
        return logitless.trl.DPOTrainer(args=trl.DPOConfig(**settings), **common, train_dataset=Dataset.from_dict(
            {"prompt": PROMPTS, "chosen": COMPLETIONS, "rejected": OTHERS}))
    if name == "kto":
        return logitless.trl.KTOTrainer(args=trl.KTOConfig(**settings), **common, train_dataset=Dataset.from_dict(
            {"prompt": PROMPTS, "completion": COMPLETIONS, "label": [True, False, True, False]}))
    if name == "distill":
        trainer = type("Distillation", (FixedRollouts, logitless.trl.DistillationTrainer), {})
        settings["learning_rate"] = 100.0  # a divergence between two random models has a small gradient
        return trainer(args=trl.DistillationConfig(**settings, max_completion_length=6), **common,
                       teacher_model=load(teacher_dir, layout), train_dataset=Dataset.from_dict({"prompt": PROMPTS}))
    prompts = Dataset.from_dict({"prompt": PROMPTS[:2]})
    generating = dict(**settings, num_generations=2, max_completion_length=6, disable_dropout=True)
    mixins, reward = ((FixedRollouts,), length_reward) if rollouts == "fixed" else ((), first_token_reward)
    if name == "rloo":
        trainer = type("RLOO", (*mixins, logitless.trl.RLOOTrainer), {})
        return trainer(args=trl.RLOOConfig(**generating), **common, reward_funcs=reward, train_dataset=prompts)
    trainer = type("GRPO", (*mixins, logitless.trl.GRPOTrainer), {})
    return trainer(args=trl.GRPOConfig(**generating, loss_type="grpo"), **common, reward_funcs=reward,
                   train_dataset=prompts)


def whole(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def greedy_generation_error(model, model_dir: str) -> float:
    """This rank's prompts decoded greedily by ``model`` (sharded) and by the whole model loaded from ``model_dir`` in
    this process: the largest difference of their per-step logits (inf where the tokens differ)."""
    tokenizer = qwen_tokenizer()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    tokenizer.padding_side = "left"
    prompts = tokenizer(PROMPTS[rank::world], return_tensors="pt", padding=True)
    whole_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    options = dict(max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True,
                   pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        sharded, expected = (m.generate(**prompts, **options) for m in (model, whole_model))
    if not torch.equal(sharded.sequences, expected.sequences):
        return float("inf")
    return max((a - b).abs().max().item() for a, b in zip(sharded.logits, expected.logits))


def main(model_dir: str, teacher_dir: str, output_path: str, trainers: list[str], layout: str, rollouts: str,
         summary: bool = False) -> None:
    _count_gathers()
    saved = {}
    for name in trainers:
        trainer = build(name, model_dir, teacher_dir, os.path.join(os.path.dirname(output_path), name), layout,
                        rollouts)
        model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
        models = [model, getattr(trainer, "teacher_model", None), getattr(trainer, "ref_model", None)]
        HEAD_WEIGHTS.clear()
        HEAD_WEIGHTS.update(id(m.get_output_embeddings().weight) for m in models if m is not None)
        for counts in (GATHERED, COLLECTIVES, HEAD_UNSHARDS):
            counts.clear()
        generation_error = greedy_generation_error(model, model_dir) if rollouts == "generated" else None
        trainer.train()
        model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
        saved[name] = {"world_size": trainer.accelerator.num_processes,
                       "wrapper": type(trainer.model_wrapped).__name__, "log": trainer.state.log_history[0],
                       "head_is_dtensor": isinstance(model.get_output_embeddings().weight, DTensor),
                       "gathered": list(GATHERED), "collectives": list(COLLECTIVES),
                       "head_unshards": list(HEAD_UNSHARDS), "generation_error": generation_error,
                       "weights": {name: whole(p) for name, p in model.named_parameters()}}
        trainer.accelerator.wait_for_everyone()
    if int(os.environ.get("RANK", 0)) == 0:
        torch.save(saved, output_path)
        if summary:
            print_collectives(saved)


def print_collectives(saved: dict) -> None:
    """Per trainer, what its step (generation included) moved on this rank: each collective by the FSDP2 unit whose
    unshard issued it ("-" outside any unshard: logitless's own, FSDP2's gradient reduce-scatters), its calls and MB
    (10^6 bytes) received, and the head's unshards."""
    for name, run in saved.items():
        print(f"{name}: {len(run['head_unshards'])} unshards of a unit holding the LM head")
        moved = Counter()
        calls = Counter()
        for collective, unit, received in run["collectives"]:
            moved[collective, unit or "-"] += received
            calls[collective, unit or "-"] += 1
        for (collective, unit), received in sorted(moved.items(), key=lambda item: -item[1]):
            print(f"  {collective:<22} {unit:<20} {calls[collective, unit]:>4} calls {received / 1e6:>9.2f} MB")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("output")
    parser.add_argument("--teacher", dest="teacher_dir", required=True)
    parser.add_argument("--trainers", nargs="+", choices=TRAINERS, default=list(TRAINERS))
    parser.add_argument("--layout", choices=("whole", "fsdp2", "tp"), default="whole")
    parser.add_argument("--rollouts", choices=("fixed", "generated"), default="fixed")
    parser.add_argument("--summary", action="store_true", help="print what each trainer's step moved (rank 0)")
    options = parser.parse_args()
    main(options.model_dir, options.teacher_dir, options.output, options.trainers, options.layout, options.rollouts,
         options.summary)
    os._exit(0)  # gloo can abort at interpreter exit after a clean run
