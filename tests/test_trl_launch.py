"""GRPOTrainerWithLogits launched as docs/trl.md's "Distributed" section tells users, on 2 CPU processes (gloo), against
the same script (tests/grpo_launch.py) in one process; and SFTTrainer and DPOTrainer under torchrun
(tests/trainer_launch.py).

Each launch trains one SGD step with learning rate 1, so the weights move by exactly the gradient: the weights after
the step equal the one-process run's to 1e-6, and the parameters have the layout the launch promises (whole replicas
for DDP, DTensor shards for FSDP2, ZeRO-3 partitions) while the optimizer steps. Every launch prints the line naming
the head that scores the tokens once; a launch whose FSDP accelerate does not run says so.
"""

import inspect
import itertools
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")

from safetensors.torch import load_file  # noqa: E402
from test_trl_distributed import _free_port  # noqa: E402

import logitless  # noqa: E402

SCRIPT = Path(__file__).with_name("grpo_launch.py")
LIBRARY_ROOT = str(Path(logitless.__file__).parents[1])  # the script imports the logitless under test
SCORING_LINE = "logitless: tokens scored by logitless's fused LM head (PyTorch blocks on cpu, 151,936-token vocabulary"
FSDP_NOT_SHARDED = "logitless: FSDP was requested but the model is not sharded"


def accelerate_launch(*flags: str) -> list[str]:
    """``accelerate launch FLAGS`` on a free port."""
    return [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", *flags,
            "--main_process_port", str(_free_port())]


def torchrun(*flags: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *flags, "--master_addr", "127.0.0.1",
            "--master_port", str(_free_port())]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir) -> Path:
    return tiny_model_dir


def _run(launcher: list[str], model_dir: Path, run_dir: Path, *options: str, script: Path = SCRIPT,
         arguments: tuple[str, ...] = ()) -> tuple[dict, str]:
    """``script ARGUMENTS MODEL_DIR OUTPUT OPTIONS`` under ``launcher`` (``[sys.executable]`` for one process) -> (what
    it saved, its whole output)."""
    output = run_dir / "saved.pt"
    env = os.environ | {"OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1",
                        "HF_HOME": str(run_dir / "hf"),  # no accelerate config file: the flags alone
                        "PYTHONPATH": os.pathsep.join([LIBRARY_ROOT, os.environ.get("PYTHONPATH", "")])}
    run_dir.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([*launcher, str(script), *arguments, str(model_dir), str(output), *options],
                          capture_output=True, text=True, timeout=600, env=env, cwd=run_dir)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-6000:]
    # every rank printed DDP's notice that the flag was on for a model whose every parameter is used in every step
    assert "find_unused_parameters=True was specified" not in log
    return torch.load(output), log


@pytest.fixture(scope="module")
def one_process(model_dir, tmp_path_factory) -> dict:
    saved, log = _run([sys.executable], model_dir, tmp_path_factory.mktemp("one"))
    assert saved["world_size"] == 1 and saved["layouts"] == ["whole"]
    assert log.count(SCORING_LINE) == 1 and "policy: one process" in log
    return saved


def _assert_same_step(saved: dict, reference: dict, model_dir: Path) -> None:
    """Two processes took the step one process took: the same weights after it, rewards and gradient norm."""
    assert saved["world_size"] == 2
    initial = load_file(model_dir / "model.safetensors")
    moved = max((reference["weights"][name] - initial[name]).abs().max().item() for name in initial)
    assert moved > 0.1  # the step changed the weights: equal weights mean equal gradients
    assert saved["weights"].keys() == reference["weights"].keys()
    for name, weight in reference["weights"].items():
        torch.testing.assert_close(saved["weights"][name], weight, atol=1e-6, rtol=0, msg=name)
    for metric in ("reward", "rewards/confidence_reward/mean", "grad_norm", "entropy"):
        assert saved["log"][metric] == pytest.approx(reference["log"][metric], rel=1e-5), metric


@pytest.mark.distributed
def test_ddp_by_accelerate_launch_on_cpu_equals_one_process(model_dir, tmp_path, one_process):
    """`accelerate launch --multi_gpu --num_processes 2` starts 2 processes on CPU too (use_cpu=True in the script)."""
    saved, log = _run(accelerate_launch("--multi_gpu", "--num_processes", "2"), model_dir, tmp_path)
    assert saved["distributed_type"] == "DistributedType.MULTI_CPU"
    assert saved["wrapper"] == "DistributedDataParallel" and saved["layouts"] == ["whole"]
    assert log.count(SCORING_LINE) == 1 and "policy: DDP, a whole copy in each of 2 processes" in log
    _assert_same_step(saved, one_process, model_dir)


@pytest.mark.distributed
def test_ddp_by_torchrun_equals_one_process(model_dir, tmp_path, one_process):
    saved, log = _run(torchrun("--nproc_per_node", "2"), model_dir, tmp_path)
    assert saved["wrapper"] == "DistributedDataParallel" and saved["layouts"] == ["whole"]
    assert log.count(SCORING_LINE) == 1
    _assert_same_step(saved, one_process, model_dir)


@pytest.mark.distributed
def test_fsdp2_sharded_at_load_trains_sharded_and_equals_one_process(model_dir, tmp_path, one_process):
    """A model loaded with DistributedConfig(fsdp_size=2) trains as DTensor shards, on CPU, through the trainer's own
    train(); a second trainer then generates with transformers' generate on the sharded model."""
    saved, log = _run(accelerate_launch("--multi_gpu", "--num_processes", "2"), model_dir, tmp_path, "--fsdp2",
                      "--generate")
    assert saved["wrapper"] == "FSDPQwen2ForCausalLM"  # accelerate left the sharded model as it was: no DDP
    assert saved["layouts"] == ["dtensor", "dtensor"]  # both trainers' steps
    assert log.count(SCORING_LINE) == 2 and "policy: FSDP2, parameters sharded over 2 processes" in log
    assert FSDP_NOT_SHARDED not in log
    _assert_same_step(saved, one_process, model_dir)
    assert math.isfinite(saved["generated_log"]["grad_norm"]) and saved["generated_log"]["grad_norm"] > 0


@pytest.mark.distributed
def test_accelerate_fsdp_flags_on_cpu_train_ddp_and_say_so(model_dir, tmp_path, one_process):
    """`--use_fsdp --fsdp_version 2` on CPU: accelerate trains with DDP (a whole model per process); the trainer warns
    once, and the step is still the one-process step."""
    saved, log = _run(accelerate_launch("--use_fsdp", "--fsdp_version", "2", "--num_processes", "2"), model_dir,
                      tmp_path)
    assert saved["wrapper"] == "DistributedDataParallel" and saved["layouts"] == ["whole"]
    assert log.count(FSDP_NOT_SHARDED) == 1 and "DistributedConfig(fsdp_size=WORLD_SIZE)" in log
    _assert_same_step(saved, one_process, model_dir)


@pytest.mark.distributed
def test_deepspeed_zero3_by_accelerate_launch_equals_one_process(model_dir, tmp_path, one_process):
    """ZeRO-3 partitions every parameter; the fused head gathers the output embedding before reading it, in forward,
    in backward and for completion_logits; a second trainer generates with the partitioned model."""
    pytest.importorskip("deepspeed", reason="pip install --no-build-isolation deepspeed")
    saved, log = _run(accelerate_launch("--use_deepspeed", "--zero_stage", "3", "--num_processes", "2"), model_dir,
                      tmp_path, "--generate")
    assert saved["distributed_type"] == "DistributedType.DEEPSPEED" and saved["wrapper"] == "DeepSpeedEngine"
    assert saved["layouts"] == ["partitioned", "partitioned"]
    assert log.count(SCORING_LINE) == 2 and "policy: DeepSpeed ZeRO-3 over 2 processes" in log
    _assert_same_step(saved, one_process, model_dir)
    assert math.isfinite(saved["generated_log"]["grad_norm"]) and saved["generated_log"]["grad_norm"] > 0


@pytest.mark.distributed
@pytest.mark.parametrize("trainer", ["sft", "dpo"])
def test_sft_and_dpo_by_torchrun_equal_one_process(trainer, model_dir, tmp_path):
    """logitless's SFTTrainer and DPOTrainer under DDP (2 processes, gloo): one SGD step ends with the one-process
    step's weights, so the two processes' fused-head gradients averaged to the whole batch's."""
    script = Path(__file__).with_name("trainer_launch.py")
    saved = {}
    for name, launcher in (("one", [sys.executable]), ("two", torchrun("--nproc_per_node", "2"))):
        saved[name], log = _run(launcher, model_dir, tmp_path / name, script=script, arguments=(trainer,))
        assert log.count("logitless: tokens scored by logitless's fused LM head") == 1
    assert saved["two"]["world_size"] == 2 and saved["two"]["wrapper"] == "DistributedDataParallel"
    initial = load_file(model_dir / "model.safetensors")
    assert max((saved["one"]["weights"][name] - initial[name]).abs().max().item() for name in initial) > 0.01
    for name, weight in saved["one"]["weights"].items():
        torch.testing.assert_close(saved["two"]["weights"][name], weight, atol=1e-6, rtol=0, msg=name)
    assert saved["two"]["log"]["loss"] == pytest.approx(saved["one"]["log"]["loss"], rel=1e-5)


def test_every_launch_command_in_the_docs_is_run_by_the_test_it_names():
    """docs/trl.md's Distributed table: a row either says untested or names tests of this file whose launches pass
    every flag of its command."""
    lines = (Path(__file__).resolve().parents[1] / "docs" / "trl.md").read_text().splitlines()
    header = lines.index("| layout | command (`train.py` is your script) | run by |")
    rows = list(itertools.takewhile(lambda line: line.startswith("|"), lines[header + 2:]))
    assert len(rows) >= 6
    for row in rows:
        _, command, run_by = (cell.strip() for cell in row.strip("|").split(" | "))
        tests = re.findall(r"`(test_\w+)`", run_by)
        assert tests or run_by.startswith("untested"), row
        for name in tests:
            source = inspect.getsource(globals()[name])
            for flag in re.findall(r"--\w+", command.split("`")[1]):
                assert f'"{flag}"' in source, (name, flag)
