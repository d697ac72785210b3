"""What GRPOTrainerWithLogits says when training starts: one line naming the head that scores the tokens, and a
warning for each layout a launch asked for and does not get (tests/trl/test_trl_launch.py sees both in real
launches)."""

import logging
from types import SimpleNamespace

import pytest
import torch

trl = pytest.importorskip("trl")
from accelerate.utils import DistributedType  # noqa: E402
from datasets import Dataset  # noqa: E402

from logitless.models import tiny_qwen2  # noqa: E402
from logitless.trl import GRPOTrainerWithLogits  # noqa: E402
from logitless.trl.notices import launch_warnings, policy_layout, scoring_line  # noqa: E402


def _accelerator(distributed_type=DistributedType.MULTI_CPU, num_processes=2, zero_stage=None):
    state = SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=zero_stage))
    return SimpleNamespace(distributed_type=distributed_type, num_processes=num_processes, state=state,
                           device=torch.device("cpu"))


@pytest.fixture(scope="module")
def model():
    return tiny_qwen2(seed=0, vocab_size=1000, pad_token_id=0, eos_token_id=0)


def _zero_reward(completions, **kwargs):
    return [0.0] * len(completions)


def test_training_starts_with_one_line_naming_the_head_and_nothing_else(tmp_path, tiny_model_dir, tokenizer, caplog):
    """The line is the library logger's (INFO, on stderr unless the application configures logging), not a print."""
    model_dir = tiny_model_dir
    args = trl.GRPOConfig(output_dir=str(tmp_path / "run"), use_cpu=True, bf16=False, activation_checkpointing=False,
                          per_device_train_batch_size=2, num_generations=2, max_completion_length=4, max_steps=1,
                          report_to="none", save_strategy="no", cast_lm_head_to_fp32=True)
    dataset = Dataset.from_dict({"prompt": ["Say hi."] * 2})
    trainer = GRPOTrainerWithLogits(model=str(model_dir), reward_funcs=_zero_reward, args=args,
                                    processing_class=tokenizer, train_dataset=dataset)
    with caplog.at_level(logging.INFO, logger="logitless"):
        trainer.train()
    said = [(record.levelno, record.getMessage()) for record in caplog.records if record.name.startswith("logitless")]
    assert said == [(logging.INFO, "logitless: tokens scored by logitless's fused LM head (PyTorch blocks on cpu, "
                                   "fp32, 151,936-token vocabulary, no (batch, seq, vocab) logits); "
                                   "policy: one process")]


def test_the_library_logger_reaches_stderr_unless_the_application_configured_logging():
    """As transformers' logger does: a script that configures nothing sees the INFO line; one that configured the
    root logger gets no second handler."""
    import subprocess
    import sys

    script = ("import logging, sys\n{configure}import logitless\n"
              "logging.getLogger('logitless.trl.seam').info('hello from logitless')\n"
              "print(len(logging.getLogger('logitless').handlers))")
    alone = subprocess.run([sys.executable, "-c", script.format(configure="")], capture_output=True, text=True)
    assert alone.stderr.strip() == "hello from logitless" and alone.stdout.strip() == "1"
    configured = subprocess.run([sys.executable, "-c", script.format(
        configure="logging.basicConfig(level=logging.WARNING, format='%(name)s %(message)s')\n")],
                                capture_output=True, text=True)
    assert configured.stdout.strip() == "0" and configured.stderr.strip() == ""


def test_the_line_names_the_layout(model):
    assert policy_layout(model, _accelerator()) == "DDP, a whole copy in each of 2 processes"
    assert policy_layout(model, _accelerator(DistributedType.FSDP)) == \
        "FSDP (accelerate), parameters sharded over 2 processes"
    assert policy_layout(model, _accelerator(DistributedType.DEEPSPEED, zero_stage=3)) == \
        "DeepSpeed ZeRO-3 over 2 processes"
    assert policy_layout(model, _accelerator(DistributedType.NO, 1)) == "one process"
    assert scoring_line(model, _accelerator()).endswith(
        "(PyTorch blocks on cpu, 1,000-token vocabulary, no (batch, seq, vocab) logits); policy: DDP, a whole copy "
        "in each of 2 processes")


def test_fsdp_that_accelerate_runs_as_ddp_is_warned(model):
    """On CPU accelerate ignores --use_fsdp (ACCELERATE_USE_FSDP) and GRPOConfig(fsdp=...): DDP trains instead."""
    expected = ["logitless: FSDP was requested but the model is not sharded: accelerate runs FSDP only on GPUs and "
                "other accelerators, and here trains with DDP, a whole copy in each of 2 processes; to shard on CPU, "
                "load the model sharded instead: AutoModelForCausalLM.from_pretrained(..., "
                "distributed_config=DistributedConfig(fsdp_size=WORLD_SIZE)) (docs/trl.md, Distributed)"]
    no_fsdp = SimpleNamespace(fsdp=False)
    assert launch_warnings(model, _accelerator(), no_fsdp, {"ACCELERATE_USE_FSDP": "true"}) == expected
    assert launch_warnings(model, _accelerator(), SimpleNamespace(fsdp=True), {}) == expected
    assert launch_warnings(model, _accelerator(DistributedType.FSDP), no_fsdp, {"ACCELERATE_USE_FSDP": "true"}) == []
    assert launch_warnings(model, _accelerator(), no_fsdp, {"ACCELERATE_USE_FSDP": "false", "WORLD_SIZE": "2"}) == []


def test_processes_that_each_train_alone_are_warned(model):
    """Launched as 2 processes on a machine without GPUs and without use_cpu=True, accelerate makes each one a run of
    its own."""
    alone = _accelerator(DistributedType.NO, num_processes=1)
    found = launch_warnings(model, alone, SimpleNamespace(fsdp=False), {"WORLD_SIZE": "2"})
    assert found == ["logitless: 2 processes were launched but each trains alone (accelerate found no GPU and use_cpu "
                     "is off): set use_cpu=True in the trainer's config to train them together on CPU"]
