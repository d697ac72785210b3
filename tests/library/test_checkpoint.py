"""Checkpoints appear complete or not at all; the newest complete one is found; GRPOTrainerWithLogits' saves."""

import json

import pytest
import torch

from logitless.checkpoint import (RECORD_FILE, checkpoint_problem, checkpoint_step, complete_checkpoints,
                                  last_complete_checkpoint, load_checkpoint_state, publish_directory,
                                  save_checkpoint)
from logitless.models import tiny_qwen2


def _sealed(path, files):
    path.mkdir()
    for name, text in files.items():
        (path / name).write_text(text)
    return path


def test_a_checkpoint_is_complete_only_with_its_record_and_every_file(tmp_path):
    staging = _sealed(tmp_path / "staging", {"model.safetensors": "weights", "trainer_state.json": "{}"})
    final = publish_directory(staging, tmp_path / "checkpoint-1")
    assert not staging.exists() and checkpoint_problem(final) is None
    (final / "model.safetensors").write_text("weigh")  # truncated
    assert checkpoint_problem(final) == "model.safetensors has 5 bytes, not the 7 it was written with"
    (final / "model.safetensors").unlink()
    assert checkpoint_problem(final) == "model.safetensors is missing"
    (final / RECORD_FILE).unlink()
    assert "has no logitless-checkpoint.json" in checkpoint_problem(final)
    assert checkpoint_problem(tmp_path / "nowhere") == "it does not exist"


def test_publishing_replaces_an_incomplete_directory_but_never_a_complete_one(tmp_path):
    (tmp_path / "checkpoint-2").mkdir()
    (tmp_path / "checkpoint-2" / "model.safetensors").write_text("half")  # an interrupted older save
    publish_directory(_sealed(tmp_path / "a", {"x": "1"}), tmp_path / "checkpoint-2")
    assert (tmp_path / "checkpoint-2" / "x").read_text() == "1"
    with pytest.raises(FileExistsError, match="already holds a complete checkpoint"):
        publish_directory(_sealed(tmp_path / "b", {"x": "2"}), tmp_path / "checkpoint-2")


def test_the_newest_complete_checkpoint_and_what_was_skipped(tmp_path):
    assert last_complete_checkpoint(tmp_path / "missing") == (None, [])
    publish_directory(_sealed(tmp_path / "s1", {"trainer_state.json": "{}"}), tmp_path / "checkpoint-1")
    publish_directory(_sealed(tmp_path / "s10", {"trainer_state.json": "{}"}), tmp_path / "checkpoint-10")
    (tmp_path / "checkpoint-12").mkdir()  # partial: no record, no trainer_state.json
    (tmp_path / "checkpoint-11").mkdir()  # written by a stock Trainer: no record, trainer_state.json last
    (tmp_path / "checkpoint-11" / "training_args.bin").write_bytes(b"args")
    (tmp_path / "checkpoint-11" / "trainer_state.json").write_text(json.dumps({"global_step": 11}))
    (tmp_path / "checkpoint-x").mkdir()
    found, skipped = last_complete_checkpoint(tmp_path)
    assert found == tmp_path / "checkpoint-11"
    assert len(skipped) == 1 and "checkpoint-12" in skipped[0] and "a finished save writes last" in skipped[0]
    (tmp_path / "checkpoint-11" / "trainer_state.json").write_text('{"global_st')  # killed while writing it
    assert last_complete_checkpoint(tmp_path)[0] == tmp_path / "checkpoint-10"
    (tmp_path / "checkpoint-11" / "training_args.bin").unlink()  # ours lost its record: not a stock Trainer's
    (tmp_path / "checkpoint-11" / "trainer_state.json").write_text(json.dumps({"global_step": 11}))
    assert last_complete_checkpoint(tmp_path)[0] == tmp_path / "checkpoint-10"
    state = tmp_path / "checkpoint-10" / "trainer_state.json"  # damaged in place, same size as recorded
    state.write_text("{" + " " * (state.stat().st_size - 1))
    found, skipped = last_complete_checkpoint(tmp_path)
    assert found == tmp_path / "checkpoint-1" and "trainer_state.json is unreadable" in skipped[-1]


def test_save_checkpoint_publishes_checkpoint_step_and_keeps_the_newest(tmp_path, tokenizer):
    model = tiny_qwen2(vocab_size=151646, hidden_size=8, intermediate_size=16, num_hidden_layers=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5)
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    optimizer.step()
    run = tmp_path / "run"
    for step in (1, 2):
        save_checkpoint(run, step, model, tokenizer, optimizer, {"step": step})
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint-1", "checkpoint-2"]  # no staging left behind
    save_checkpoint(run, 3, model, tokenizer, optimizer, {"step": 3}, keep=2)
    assert [p.name for p in complete_checkpoints(run)] == ["checkpoint-2", "checkpoint-3"]
    assert checkpoint_problem(run / "checkpoint-3") is None and checkpoint_step(last_complete_checkpoint(run)[0]) == 3
    restored = torch.optim.AdamW(model.parameters(), lr=0.1)
    assert load_checkpoint_state(run / "checkpoint-3", restored) == {"step": 3}
    assert restored.param_groups[0]["lr"] == 0.5
    for parameter in model.parameters():
        assert torch.equal(optimizer.state[parameter]["exp_avg"], restored.state[parameter]["exp_avg"])
    with pytest.raises(FileExistsError, match="already holds a complete checkpoint"):  # never replaced
        save_checkpoint(run, 3, model, tokenizer, optimizer, {"step": 99})
    assert load_checkpoint_state(run / "checkpoint-3", restored) == {"step": 3}
    with pytest.raises(ValueError, match="keep"):  # keep=0 would otherwise keep every checkpoint
        save_checkpoint(run, 4, model, tokenizer, optimizer, {"step": 4}, keep=0)
    assert [p.name for p in complete_checkpoints(run)] == ["checkpoint-2", "checkpoint-3"]


def test_a_failed_trainer_save_leaves_no_checkpoint_and_the_next_one_succeeds(tmp_path, tokenizer, monkeypatch, caplog):
    """GRPOTrainerWithLogits writes checkpoint-STEP in a staging directory: a save that dies half-way is invisible."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    from logitless.trl import CHECKPOINT_STAGING, GRPOTrainerWithLogits

    args = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, activation_checkpointing=False,
                          per_device_train_batch_size=2, num_generations=2, max_completion_length=2, max_steps=1,
                          report_to="none", save_strategy="no", seed=0, learning_rate=1e-3, disable_tqdm=True)
    trainer = GRPOTrainerWithLogits(model=tiny_qwen2(hidden_size=8, intermediate_size=16, num_hidden_layers=1),
                                    reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
                                    train_dataset=Dataset.from_dict({"prompt": ["a", "b"]}),
                                    processing_class=tokenizer)
    trainer.create_optimizer_and_scheduler(num_training_steps=1)
    trainer.state.global_step = 1
    real_save_rng_state = type(trainer)._save_rng_state

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # as if the process died while writing the rng state
    monkeypatch.setattr(type(trainer), "_save_rng_state", killed)
    with pytest.raises(KeyboardInterrupt):
        trainer._save_checkpoint(trainer.model, None)
    assert not (tmp_path / "checkpoint-1").exists()
    assert (tmp_path / CHECKPOINT_STAGING / "checkpoint-1" / "model.safetensors").is_file()  # the hidden remains
    monkeypatch.setattr(type(trainer), "_save_rng_state", real_save_rng_state)
    trainer._save_checkpoint(trainer.model, None)
    assert checkpoint_problem(tmp_path / "checkpoint-1") is None
    assert not (tmp_path / CHECKPOINT_STAGING).exists()  # emptied and removed once the save is published
    (tmp_path / "checkpoint-2").mkdir()  # incomplete: resume_from_checkpoint=True takes checkpoint-1 and says so
    resumed = []
    monkeypatch.setattr(trl.GRPOTrainer, "train", lambda self, resume_from_checkpoint=None, *a, **k:
                        resumed.append(resume_from_checkpoint))
    with caplog.at_level("WARNING", logger="logitless.trl"):
        trainer.train(resume_from_checkpoint=True)
    assert resumed == [str(tmp_path / "checkpoint-1")] and "skipping incomplete checkpoint" in caplog.text
