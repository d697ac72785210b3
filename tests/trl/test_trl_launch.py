"""GRPOTrainerWithLogits launched as docs/trl.md's "Distributed" section tells users, on 2 CPU processes (gloo), against
the same script (tests/helpers/grpo_launch.py) in one process; and every trainer (SFT, DPO, KTO, RLOO, GRPO,
distillation) under torchrun, with DDP and on an FSDP2-sharded model whose LM head is never gathered
(tests/helpers/trainer_launch.py).

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
from ports import free_port  # noqa: E402

from logitless.models import save_model_and_tokenizer, tiny_qwen2  # noqa: E402

import logitless  # noqa: E402

SCRIPT = (Path(__file__).parents[1] / "helpers" / "grpo_launch.py")
LIBRARY_ROOT = str(Path(logitless.__file__).parents[1])  # the script imports the logitless under test
SCORING_LINE = "logitless: tokens scored by logitless's fused LM head (PyTorch blocks on cpu, 151,936-token vocabulary"
FSDP_NOT_SHARDED = "logitless: FSDP was requested but the model is not sharded"
TIED_HEAD_GATHERED = "logitless: the LM head is tied to the input embeddings, which FSDP2 gathers for the input lookup"


def accelerate_launch(*flags: str) -> list[str]:
    """``accelerate launch FLAGS`` on a free port."""
    return [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", *flags,
            "--main_process_port", str(free_port())]


def torchrun(*flags: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *flags, "--master_addr", "127.0.0.1",
            "--master_port", str(free_port())]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir) -> Path:
    return tiny_model_dir


def _run(launcher: list[str], model_dir: Path, run_dir: Path, *options: str, script: Path = SCRIPT
         ) -> tuple[dict, str]:
    """``script MODEL_DIR OUTPUT OPTIONS`` under ``launcher`` (``[sys.executable]`` for one process) -> (what it saved,
    its whole output)."""
    output = run_dir / "saved.pt"
    env = os.environ | {"OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1",
                        "HF_HOME": str(run_dir / "hf"),  # no accelerate config file: the flags alone
                        "PYTHONPATH": os.pathsep.join([LIBRARY_ROOT, os.environ.get("PYTHONPATH", "")])}
    run_dir.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([*launcher, str(script), str(model_dir), str(output), *options],
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
    assert TIED_HEAD_GATHERED in log  # the tiny model's head is its input embedding, which FSDP2 gathers
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


TRAINERS = ("sft", "dpo", "kto", "rloo", "grpo", "distill")
TRAINER_SCRIPT = (Path(__file__).parents[1] / "helpers" / "trainer_launch.py")
WHOLE_HEAD = (151936, 64)  # the tiny model's output embedding, gathered whole


@pytest.fixture(scope="module")
def untied_dirs(tmp_path_factory, tokenizer) -> tuple[Path, Path]:
    """A student and a wider, more confident teacher (hidden size 96: two heads of different widths), each with an LM
    head of its own (a tied one is the input embedding, which FSDP2 gathers for the input lookup)."""
    saved = tmp_path_factory.mktemp("untied")
    student = tiny_qwen2(seed=0, tie_word_embeddings=False)
    # peaked logits: a divergence far from 0, a gradient far from its rounding
    teacher = tiny_qwen2(seed=1, hidden_size=96, intermediate_size=192, tie_word_embeddings=False,
                         initializer_range=0.2)
    return (save_model_and_tokenizer(student, tokenizer, saved / "student"),
            save_model_and_tokenizer(teacher, tokenizer, saved / "teacher"))


def _run_trainers(launcher: list[str], models: tuple[Path, Path], run_dir: Path, *options: str) -> dict:
    student, teacher = models
    saved, log = _run(launcher, student, run_dir, "--teacher", str(teacher), *options, script=TRAINER_SCRIPT)
    scored = "(PyTorch blocks on cpu, 151,936-token vocabulary, no (batch, seq, vocab) logits)"
    assert log.count(scored) == len(TRAINERS)
    assert "gathered the LM head" not in log and TIED_HEAD_GATHERED not in log
    return saved


@pytest.fixture(scope="module")
def one_process_trainers(untied_dirs, tmp_path_factory) -> dict:
    return _run_trainers([sys.executable], untied_dirs, tmp_path_factory.mktemp("trainers"))


def _assert_same_steps(saved: dict, reference: dict, model_dir: Path) -> None:
    """Every trainer took the one-process step: the same weights after it (so the same gradients: plain SGD) and the
    same logged metrics. The gradient norm is one fp32 sum of every parameter's squared gradient, rounded to about
    sqrt(parameters) * eps; the other metrics to 1e-5."""
    initial = load_file(model_dir / "model.safetensors")
    norm_rounding = math.sqrt(sum(weight.numel() for weight in initial.values())) * torch.finfo(torch.float32).eps
    for trainer in TRAINERS:
        one, many = reference[trainer], saved[trainer]
        assert many["world_size"] == 2
        assert max((one["weights"][name] - initial[name]).abs().max().item() for name in initial) > 0.01, trainer
        for name, weight in one["weights"].items():
            # 1e-6 of the largest weight: the ranks' gradients are averaged in another order than one process sums them
            atol = 1e-6 * max(1.0, weight.abs().max().item())
            torch.testing.assert_close(many["weights"][name], weight, atol=atol, rtol=0, msg=f"{trainer}: {name}")
        metrics = one["log"].keys() - {"step_time", "epoch"}
        assert metrics <= many["log"].keys() and {"loss", "grad_norm"} <= metrics, trainer
        for metric in metrics:
            rel = norm_rounding if metric == "grad_norm" else 1e-5
            assert many["log"][metric] == pytest.approx(one["log"][metric], rel=rel, abs=1e-6), (trainer, metric)


@pytest.mark.distributed
def test_every_trainer_by_torchrun_equals_one_process(untied_dirs, tmp_path, one_process_trainers):
    """SFT, DPO, KTO, RLOO, GRPO and distillation under DDP (2 processes, gloo): one SGD step ends with the one-process
    step's weights, so the two processes' fused-head gradients averaged to the whole batch's."""
    saved = _run_trainers(torchrun("--nproc_per_node", "2"), untied_dirs, tmp_path)
    assert {saved[trainer]["wrapper"] for trainer in TRAINERS} == {"DistributedDataParallel"}
    _assert_same_steps(saved, one_process_trainers, untied_dirs[0])


@pytest.mark.distributed
def test_every_trainer_on_an_fsdp2_model_scores_with_the_sharded_head(untied_dirs, tmp_path, one_process_trainers):
    """Each trainer on models loaded as docs/distributed.md says (DistributedConfig(fsdp_size=2) with the LM head an
    FSDP unit of its own), launched by torchrun: the head (the teacher's too) reaches the fused ops as a DTensor sharded
    on the vocabulary (logitless says so when it does not), every rank scores its own rows for both ranks' tokens, the
    head is never gathered whole (only reward functions' completion logits would need it; these trainers have none),
    and the step is the one-process step."""
    saved = _run_trainers(torchrun("--nproc_per_node", "2"), untied_dirs, tmp_path, "--layout", "fsdp2")
    for trainer in TRAINERS:
        assert saved[trainer]["head_is_dtensor"], trainer
        assert WHOLE_HEAD not in saved[trainer]["gathered"], (trainer, saved[trainer]["gathered"])
    _assert_same_steps(saved, one_process_trainers, untied_dirs[0])


def _head_gathers(saved: dict) -> list:
    """What moved a whole LM head while the trainer generated and trained: FSDP2 unshards of a head's parameter
    group, the all-gathers they issued, DTensors of the head's shape gathered, and any other all-gather as large."""
    head_bytes = WHOLE_HEAD[0] * WHOLE_HEAD[1] * 4
    gathers = [(unit, moved) for name, unit, moved in saved["collectives"] if "gather" in name]
    return (saved["head_unshards"] + [gather for gather in gathers if gather[0].startswith("head:")]
            + [shape for shape in saved["gathered"] if shape == WHOLE_HEAD]
            + [gather for gather in gathers if not gather[0] and gather[1] >= head_bytes])


@pytest.mark.distributed
def test_grpo_and_rloo_generate_and_train_on_an_fsdp2_model_without_gathering_the_head(untied_dirs, tmp_path):
    """GRPO and RLOO sample their completions with transformers' generate on a model loaded as docs/distributed.md
    says: each decode step's logits come from the vocabulary shards (`sharded_logits`), so FSDP2 never unshards the
    head, in generation or in training (whose backward would prefetch a head whose forward ran), and no all-gather
    moves it. Greedy decoding on the sharded model equals the whole model's, token for token, logits to 1e-5. The
    only head-sized gathers left are the input embedding's, for the lookup (an FSDP unit of its own)."""
    student, teacher = untied_dirs
    saved, log = _run(torchrun("--nproc_per_node", "2"), student, tmp_path, "--teacher", str(teacher), "--trainers",
                      "rloo", "grpo", "--layout", "fsdp2", "--rollouts", "generated", script=TRAINER_SCRIPT)
    assert "gathered the LM head" not in log and TIED_HEAD_GATHERED not in log
    for trainer in ("rloo", "grpo"):
        run = saved[trainer]
        assert run["head_is_dtensor"] and run["world_size"] == 2, trainer
        assert _head_gathers(run) == [], (trainer, _head_gathers(run))
        assert run["generation_error"] < 1e-5, trainer
        assert math.isfinite(run["log"]["grad_norm"]) and run["log"]["grad_norm"] > 0, trainer
        fsdp_units = {unit for _, unit, _ in run["collectives"] if unit}
        assert "model.embed_tokens" in fsdp_units, trainer  # the counter saw FSDP2's own gathers
        assert any(name == "all_to_all_single" for name, _, _ in run["collectives"]), trainer  # sharded_logits ran


@pytest.mark.distributed
def test_a_head_tied_to_the_input_embedding_under_fsdp2_is_said_once(tmp_path, model_dir, untied_dirs):
    """The tiny model's tied head is its input embedding, which FSDP2 gathers at every forward for the lookup: the
    trainer says so once, naming the way to keep the head sharded."""
    saved, log = _run(torchrun("--nproc_per_node", "2"), model_dir, tmp_path, "--teacher", str(untied_dirs[1]),
                      "--trainers", "sft", "--layout", "fsdp2", script=TRAINER_SCRIPT)
    assert log.count(TIED_HEAD_GATHERED) == 1 and "tie_word_embeddings=False" in log
    assert saved["sft"]["head_unshards"]  # the root unit, which holds the tied embedding, was unsharded


@pytest.mark.distributed
def test_transformers_tensor_parallel_trainer_refused_on_cpu_as_docs_say(untied_dirs, tmp_path):
    """A model loaded with DistributedConfig(tp_size=2) cannot train under transformers' Trainer on CPU: accelerate
    refuses the launch. docs/distributed.md quotes the error; once a release lifts it, this test fails, and the
    tensor-parallel trainers get the test the FSDP2 ones have."""
    student, teacher = untied_dirs
    env = os.environ | {"OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1", "HF_HOME": str(tmp_path / "hf"),
                        "PYTHONPATH": os.pathsep.join([LIBRARY_ROOT, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([*torchrun("--nproc_per_node", "2"), str(TRAINER_SCRIPT), str(student),
                           str(tmp_path / "saved.pt"), "--teacher", str(teacher), "--trainers", "sft",
                           "--layout", "tp"],
                          capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert done.returncode != 0
    refusal = re.search(r"ValueError: (ParallelismConfig is only compatible .*?), but got DistributedType\.MULTI_CPU",
                        done.stdout + done.stderr)
    assert refusal, (done.stdout + done.stderr)[-4000:]
    page = (Path(__file__).resolve().parents[2] / "docs" / "distributed.md").read_text()
    assert refusal.group(1) in " ".join(page.split())  # the page wraps its lines


def test_every_launch_command_in_the_docs_is_run_by_the_test_it_names():
    """docs/trl.md's Distributed table: a row either says untested or names tests of this file whose launches pass
    every flag of its command; its "sharded head" cell says no, untested, or yes with a test of this file."""
    lines = (Path(__file__).resolve().parents[2] / "docs" / "trl.md").read_text().splitlines()
    header = lines.index("| layout | command (`train.py` is your script) | run by | sharded head, not gathered |")
    rows = list(itertools.takewhile(lambda line: line.startswith("|"), lines[header + 2:]))
    assert len(rows) >= 8
    for row in rows:
        _, command, run_by, sharded_head = (cell.strip() for cell in row.strip("|").split(" | "))
        tests = re.findall(r"`(test_\w+)`", run_by)
        assert tests or run_by.startswith("untested"), row
        for name in tests if not run_by.startswith("untested") else ():
            source = inspect.getsource(globals()[name])
            for flag in re.findall(r"--\w+", " ".join(command.split("`")[1::2])):
                assert f'"{flag}"' in source, (name, flag)
        assert re.match(r"(no|untested)\b", sharded_head) or re.fullmatch(
            r"yes: `test_\w+`(; in RLOO's and GRPO's generation too: `test_\w+`)?", sharded_head), row
        for name in re.findall(r"`(test_\w+)`", sharded_head):
            assert "head_is_dtensor" in inspect.getsource(globals()[name]), name
