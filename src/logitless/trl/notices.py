"""What logitless's TRL trainers say when training starts: the head that scores the tokens and how the policy is laid
out over the processes, and a warning for each way the launch asked for one layout and runs with another.

accelerate decides the layout from the machine as well as from the launch flags: on CPU it runs FSDP as DDP (every
process holding the whole model), and processes launched without ``use_cpu=True`` on a machine without GPUs each
train alone. Neither stops the run, so each is said here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from accelerate.utils import DistributedType
from torch.distributed.tensor import DTensor

from logitless.ops.head import stat_dtype
from logitless.ops.api import implementations

DISTRIBUTED_DOCS = "docs/distributed.md"
SHARD_ON_CPU = ("load the model sharded instead: AutoModelForCausalLM.from_pretrained(..., "
                "distributed_config=DistributedConfig(fsdp_size=WORLD_SIZE)) (docs/trl.md, Distributed)")


def is_sharded_fsdp2(model) -> bool:
    """Whether ``model``'s parameters are FSDP2 shards (DTensors), as after ``fully_shard`` or a sharded load."""
    return any(isinstance(parameter, DTensor) for parameter in model.parameters())


def head_gathered_by_fsdp(model, weight) -> str | None:
    """Why FSDP2 gathers ``model``'s LM head ``weight`` (None when it is never gathered: it arrives sharded in a unit of
    its own, or the model is not FSDP2-sharded): the head is the input embedding, which FSDP2 gathers at every forward
    for the input lookup, however logitless then reads it; or it runs in the same FSDP unit as another module."""
    if not is_sharded_fsdp2(model):
        return None
    if model.config.get_text_config().tie_word_embeddings:
        return ("logitless: the LM head is tied to the input embeddings, which FSDP2 gathers for the input lookup at "
                "every forward, so the head's size moves in every step although logitless never calls the head; "
                "untie the embeddings (tie_word_embeddings=False) to keep the head sharded, never gathered "
                f"({DISTRIBUTED_DOCS})")
    if isinstance(weight, DTensor):
        return None
    return ("logitless: FSDP2 gathered the LM head before logitless read it (its FSDP unit holds another module, "
            "transformers' default groups it with the final norm): load with DistributedConfig(fsdp_size=..., "
            f"fsdp_plan={{'lm_head': 'free_full_weight'}}) to keep it sharded, never gathered ({DISTRIBUTED_DOCS})")


def policy_layout(model, accelerator) -> str:
    """How the policy's parameters are laid out over the processes that train it, in words."""
    processes = accelerator.num_processes
    if is_sharded_fsdp2(model):
        return f"FSDP2, parameters sharded over {processes} processes"
    if accelerator.distributed_type == DistributedType.FSDP:
        return f"FSDP (accelerate), parameters sharded over {processes} processes"
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return f"DeepSpeed ZeRO-{accelerator.state.deepspeed_plugin.zero_stage} over {processes} processes"
    if processes > 1:
        return f"DDP, a whole copy in each of {processes} processes"
    return "one process"


def scoring_line(model, accelerator, cast_lm_head_to_fp32: bool = False,
                 what: str = "tokens scored by logitless's fused LM head") -> str:
    """One line saying ``what`` logitless computes, the kernels it runs and the policy's layout."""
    head_dtype = model.get_output_embeddings().weight.dtype
    chain = implementations("auto", accelerator.device, stat_dtype(head_dtype))
    blocks = "Triton kernels" if chain[0].triton else "PyTorch blocks"
    precision = ", fp32" if cast_lm_head_to_fp32 else ""
    vocabulary = model.config.get_text_config().vocab_size
    return (f"logitless: {what} ({blocks} on {accelerator.device.type}{precision}, "
            f"{vocabulary:,}-token vocabulary, no (batch, seq, vocab) logits); policy: "
            f"{policy_layout(model, accelerator)}")


def launch_warnings(model, accelerator, args, environ: Mapping[str, str] = os.environ) -> list[str]:
    """A warning for each layout the launch asked for that training does not run with."""
    found = []
    launched = int(environ.get("WORLD_SIZE", "1"))
    if launched > accelerator.num_processes:
        found.append(f"logitless: {launched} processes were launched but each trains alone (accelerate found no GPU "
                     "and use_cpu is off): set use_cpu=True in the trainer's config to train them together on CPU")
    fsdp_requested = _flag(environ, "ACCELERATE_USE_FSDP") or bool(getattr(args, "fsdp", False))
    if fsdp_requested and accelerator.distributed_type != DistributedType.FSDP and not is_sharded_fsdp2(model):
        found.append("logitless: FSDP was requested but the model is not sharded: accelerate runs FSDP only on GPUs "
                     f"and other accelerators, and here trains with {policy_layout(model, accelerator)}; to shard on "
                     f"CPU, {SHARD_ON_CPU}")
    return found


def _flag(environ: Mapping[str, str], name: str) -> bool:
    return environ.get(name, "false").lower() in ("1", "true")
