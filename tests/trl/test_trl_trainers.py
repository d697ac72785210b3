"""Every TRL 1.16 trainer that scores tokens, on logitless's head, against stock TRL: one step on the same batch
gives the same loss, every gradient and every logged metric (fp32, CPU); neither TRL's head nor the model's lm_head
runs in ours; and the option that selects the trainer's loss changes it."""

import contextlib
from unittest import mock

import pytest
import torch

trl = pytest.importorskip("trl")
from datasets import Dataset  # noqa: E402
from trl.trainer import utils as trl_utils  # noqa: E402

from head_models import halved_logits_qwen2  # noqa: E402

import logitless.trl as ours_trl  # noqa: E402
from logitless.hf_probe import UnreadableHead  # noqa: E402
from logitless.models import load_model_and_tokenizer, save_model_and_tokenizer, tiny_qwen2  # noqa: E402
from logitless.trl import lm_head as lm_head_module  # noqa: E402

PROMPTS = ["What is 2+2?", "Name a color.", "Say hi.", "Count to three:"]
COMPLETIONS = [" 4", " Red, or maybe blue.", " Hi there!", " One, two, three."]
OTHERS = [" 5", " A dog.", " Goodbye.", " Three, two, one."]
COMMON = dict(use_cpu=True, bf16=False, per_device_train_batch_size=4, max_steps=1, logging_steps=1,
              report_to="none", save_strategy="no", seed=0, learning_rate=1e-3)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return str(tiny_model_dir)


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory, tokenizer):
    """Another model of the same vocabulary: a reference model that is not the policy, or a teacher."""
    return str(save_model_and_tokenizer(tiny_qwen2(seed=1), tokenizer, tmp_path_factory.mktemp("other")))


def _loaded(model_dir):
    """A reference model is passed loaded (TRL takes a path only for the policy)."""
    return load_model_and_tokenizer(model_dir)[0]


def _sft(cls, model_dir, other_dir, tokenizer, out, peft_config=None, **options):
    data = Dataset.from_dict({"prompt": PROMPTS, "completion": COMPLETIONS})
    return cls(model=model_dir, args=trl.SFTConfig(str(out), **(COMMON | options)), train_dataset=data,
               processing_class=tokenizer, peft_config=peft_config)


def _dpo(cls, model_dir, other_dir, tokenizer, out, peft_config=None, **options):
    """With LoRA, no reference model: TRL scores the reference with the policy's adapters off."""
    data = Dataset.from_dict({"prompt": PROMPTS, "chosen": COMPLETIONS, "rejected": OTHERS})
    return cls(model=model_dir, ref_model=None if peft_config else _loaded(other_dir),
               args=trl.DPOConfig(str(out), **(COMMON | options)), train_dataset=data, processing_class=tokenizer,
               peft_config=peft_config)


def _kto(cls, model_dir, other_dir, tokenizer, out, peft_config=None, **options):
    """With LoRA, no reference model: TRL scores the reference with the policy's adapters off."""
    data = Dataset.from_dict({"prompt": PROMPTS * 2, "completion": COMPLETIONS + OTHERS,
                              "label": [True] * 4 + [False] * 4})
    return cls(model=model_dir, ref_model=None if peft_config else _loaded(other_dir),
               args=trl.KTOConfig(str(out), **(COMMON | options)), train_dataset=data, processing_class=tokenizer,
               peft_config=peft_config)


def _length_reward(completions, **kwargs):
    return [float(len(completion)) for completion in completions]


def _rloo(cls, model_dir, other_dir, tokenizer, out, peft_config=None, **options):
    config = trl.RLOOConfig(str(out), num_generations=2, max_completion_length=8, **(COMMON | options))
    return cls(model=model_dir, reward_funcs=_length_reward, args=config,
               train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tokenizer,
               peft_config=peft_config)


def _distill(cls, model_dir, other_dir, tokenizer, out, peft_config=None, **options):
    config = trl.DistillationConfig(str(out), max_completion_length=8, **(COMMON | options))
    return cls(model=model_dir, teacher_model=other_dir, args=config,
               train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tokenizer,
               peft_config=peft_config)


# trainer -> (builder, stock class, our class, the options of the step checked, the loss option changed after it)
CASES = {
    "sft": (_sft, trl.SFTTrainer, ours_trl.SFTTrainer, {}, {"loss_type": "dft"}),
    "dpo": (_dpo, trl.DPOTrainer, ours_trl.DPOTrainer, {"beta": 0.5}, {"loss_type": ["ipo"]}),
    "dpo_wpo": (_dpo, trl.DPOTrainer, ours_trl.DPOTrainer, {"use_weighting": True}, {"use_weighting": False}),
    "kto": (_kto, trl.KTOTrainer, ours_trl.KTOTrainer, {}, {"loss_type": "apo_zero_unpaired", "beta": 0.5}),
    "rloo": (_rloo, trl.RLOOTrainer, ours_trl.RLOOTrainer, {"beta": 0.05}, {"normalize_advantages": True}),
    "distill": (_distill, trl.DistillationTrainer, ours_trl.DistillationTrainer, {"beta": 0.5, "temperature": 0.9},
                {"beta": 0.0}),
}


def _batch(trainer, name: str):
    """One training batch, as the trainer's loop hands it to compute_loss (generated and scored for RLOO and
    distillation)."""
    torch.manual_seed(0)
    raw = next(iter(trainer.get_train_dataloader()))
    return trainer._prepare_inputs(raw)


def _one_step(trainer, inputs):
    """(loss, every gradient, every metric logged) of one compute_loss + backward on ``inputs``."""
    trainer.model.train()
    trainer.model.zero_grad(set_to_none=True)
    trainer._metrics["train"].clear()
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in trainer.model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, {name: values[-1] for name, values in trainer._metrics["train"].items()}


@contextlib.contextmanager
def _counted(target, name: str):
    """Counts the calls of ``target.name`` while the block runs."""
    with mock.patch.object(target, name, wraps=getattr(target, name)) as spy:
        yield spy


@contextlib.contextmanager
def _lm_head_forbidden(trainer):
    def refuse(*_):
        raise AssertionError("the model's lm_head module was called in a training step")

    handle = trainer.model.get_output_embeddings().register_forward_pre_hook(refuse)
    try:
        yield
    finally:
        handle.remove()


def _trl_kernel(name: str):
    """(where TRL's own head or divergence kernel is looked up, its name) for trainer ``name``."""
    if name == "distill":
        import trl.trainer.distillation_trainer as module

        return module.ChunkedDivergenceFunction, "apply"
    return trl_utils._ChunkedLogProbFunction, "apply"


def _our_kernel(name: str):
    if name == "distill":
        import logitless.trl.distillation as module

        return module, "fused_linear_jsd"
    return lm_head_module, "linear_token_stats"


def _assert_one_step_equals_stock_trl(name, stock, ours, inputs, loose: bool = False):
    """One step of ours equals stock TRL's on ``inputs``: loss, every gradient, every metric (bf16 matmuls: ``loose``),
    with TRL's kernel never run in ours, logitless's run, and the model's lm_head module never called."""
    assert ours.lm_head_path == "logitless"
    with _counted(*_trl_kernel(name)) as trl_calls:
        stock_loss, stock_grads, stock_metrics = _one_step(stock, inputs)
    assert trl_calls.call_count > 0  # the count sees TRL's kernel where it runs
    with _counted(*_trl_kernel(name)) as trl_calls, _counted(*_our_kernel(name)) as our_calls, \
            _lm_head_forbidden(ours):
        our_loss, our_grads, our_metrics = _one_step(ours, inputs)
    assert trl_calls.call_count == 0 and our_calls.call_count > 0
    relative, grad_tolerance = (1e-2, 2e-2) if loose else (1e-5, 1e-5)
    torch.testing.assert_close(our_loss, stock_loss, atol=1e-6, rtol=relative)
    assert our_grads.keys() == stock_grads.keys() and our_grads
    for parameter in stock_grads:
        scale = stock_grads[parameter].abs().max().item()
        torch.testing.assert_close(our_grads[parameter].float(), stock_grads[parameter].float(),
                                   atol=grad_tolerance * max(scale, 1e-3), rtol=relative, msg=parameter)
    assert our_metrics.keys() == stock_metrics.keys()
    for metric in stock_metrics:
        assert our_metrics[metric] == pytest.approx(stock_metrics[metric], rel=relative, abs=1e-7, nan_ok=True), metric
    return our_loss, our_grads


def _pair(name, model_dir, other_model_dir, tokenizer, tmp_path, **options):
    """(stock TRL's trainer, ours), built alike (the same LoRA initialization too), and a batch from stock's."""
    build, stock_class, our_class = CASES[name][:3]
    trainers = []
    for implementation, cls in (("stock", stock_class), ("ours", our_class)):
        torch.manual_seed(0)
        trainers.append(build(cls, model_dir, other_model_dir, tokenizer, tmp_path / implementation, **options))
    return (*trainers, _batch(trainers[0], name))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_one_step_equals_stock_trl_on_logitless_head(name, model_dir, other_model_dir, tokenizer, tmp_path):
    build, _, our_class, options, changed = CASES[name]
    stock, ours, inputs = _pair(name, model_dir, other_model_dir, tokenizer, tmp_path, **options)
    our_loss, our_grads = _assert_one_step_equals_stock_trl(name, stock, ours, inputs)

    # the option that selects the loss changes it, on the batch that trainer makes (RLOO folds its advantages into
    # it); RLOO's loss is 0 on policy whatever they are (leave-one-out advantages sum to 0), not its gradient
    other = build(our_class, model_dir, other_model_dir, tokenizer, tmp_path / "changed", **options | changed)
    changed_loss, changed_grads, _ = _one_step(other, _batch(other, name))
    moved = max((changed_grads[p] - our_grads[p]).abs().max().item() / max(our_grads[p].abs().max().item(), 1e-12)
                for p in our_grads)
    assert abs(changed_loss.item() - our_loss.item()) > 1e-4 * max(1.0, abs(our_loss.item())) or moved > 1e-3


def test_a_model_whose_head_logitless_cannot_read_is_refused_when_the_trainer_is_built(model_dir, tokenizer,
                                                                                       tmp_path):
    """A policy (SFT) or a reference model (DPO) whose forward halves its logits, which no config says: refused in one
    line naming its class and TRL's own trainer, which takes it."""
    refusal = (r"^model: logitless cannot score HalvedLogitsQwen2 from its hidden states: its own forward's log-probs "
               r"and entropies differ from those of the head logitless reads by up to [0-9.e-]+ \(8 positions "
               r"checked\); TRL's own trl.{} scores it with its own forward$")
    with pytest.raises(UnreadableHead, match=refusal.format("SFTTrainer")):
        _sft(ours_trl.SFTTrainer, halved_logits_qwen2(), None, tokenizer, tmp_path / "sft")
    _sft(trl.SFTTrainer, halved_logits_qwen2(), None, tokenizer, tmp_path / "stock")
    data = Dataset.from_dict({"prompt": PROMPTS, "chosen": COMPLETIONS, "rejected": OTHERS})
    with pytest.raises(UnreadableHead, match=refusal.format("DPOTrainer")):
        ours_trl.DPOTrainer(model=model_dir, ref_model=halved_logits_qwen2(), train_dataset=data,
                            args=trl.DPOConfig(str(tmp_path / "dpo"), **COMMON), processing_class=tokenizer)


def test_distillation_refuses_a_teacher_whose_head_reads_a_transformed_hidden_state(model_dir, tokenizer, tmp_path):
    """TRL's distillation reads the body's last hidden state and the whole output embedding: a BERT-style teacher,
    whose head transforms its hidden states first, is refused when the trainer is built."""
    from transformers import BertConfig, BertLMHeadModel

    teacher = BertLMHeadModel(BertConfig(vocab_size=151936, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                         intermediate_size=64, is_decoder=True))
    with pytest.raises(UnreadableHead, match=r"^teacher_model: TRL's DistillationTrainer reads the body's last hidden "
                                             r"state and whole output embedding of BertLMHeadModel, whose head is "
                                             r"transformed; logitless cannot distill it$"):
        _distill(ours_trl.DistillationTrainer, model_dir, teacher, tokenizer, tmp_path)


def test_rloo_rewards_read_completion_logits_from_the_old_log_prob_pass(model_dir, other_model_dir, tokenizer,
                                                                          tmp_path):
    """RLOO's reward functions get the rows the policy scored each completion token from, without another pass of
    the body: RLOO scores the old log-probs before the rewards, and those hidden states are the ones kept."""
    seen = {"rows": 0}

    def confidence(completions, completion_ids, completion_logits, completion_logprobs, **kwargs):
        for ids, rows, log_probs in zip(completion_ids, completion_logits, completion_logprobs):
            assert rows.shape == (len(ids), trainer.model.config.vocab_size)
            torch.testing.assert_close(torch.log_softmax(rows[:], -1)[torch.arange(len(ids)), ids], log_probs,
                                       atol=1e-5, rtol=0)
            seen["rows"] += len(ids)
        return [float(log_probs.mean()) for log_probs in completion_logprobs]

    config = trl.RLOOConfig(str(tmp_path), **COMMON, num_generations=2, max_completion_length=8)
    trainer = ours_trl.RLOOTrainer(model=model_dir, reward_funcs=confidence, args=config, processing_class=tokenizer,
                                   train_dataset=Dataset.from_dict({"prompt": PROMPTS}))
    with _counted(trl_utils._ChunkedLogProbFunction, "apply") as trl_calls:
        trainer.train()
    assert seen["rows"] > 0 and trl_calls.call_count == 0
    passes = [entry["logitless/reward_body_passes"] for entry in trainer.state.log_history
              if "logitless/reward_body_passes" in entry]
    assert passes == [0.0]


@pytest.mark.slow
@pytest.mark.parametrize("setup", ["lora", "bf16"])
@pytest.mark.parametrize("name", ["sft", "dpo", "kto", "rloo", "distill"])
def test_lora_and_bf16_steps_equal_stock_trl(name, setup, model_dir, other_model_dir, tokenizer, tmp_path):
    """LoRA (a frozen head: no head gradient; DPO and KTO score their reference with the adapters off) in fp32, and
    TRL's bf16 mixed precision (autocast around the body and the head alike)."""
    from peft import LoraConfig

    options = dict(CASES[name][3])
    if setup == "lora":
        options["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    else:
        options["bf16"] = True
    stock, ours, inputs = _pair(name, model_dir, other_model_dir, tokenizer, tmp_path, **options)
    _, grads = _assert_one_step_equals_stock_trl(name, stock, ours, inputs, loose=setup == "bf16")
    if setup == "lora":
        assert grads and all("lora_" in parameter for parameter in grads)


def test_ddp_looks_for_unused_parameters_only_where_a_step_can_leave_some(tmp_path):
    """Every DDP rank warned that find_unused_parameters=True found none: off for a dense text model, given whole or
    by directory; on (transformers' default) for a mixture of experts or a model with a vision tower; never changed
    where the user set it."""
    from types import SimpleNamespace

    from transformers import LlavaConfig, MixtralConfig

    from logitless.trl.ddp import every_parameter_used, set_find_unused_parameters

    dense = tiny_qwen2(seed=0)
    assert every_parameter_used(dense)
    assert not every_parameter_used(SimpleNamespace(config=MixtralConfig(num_local_experts=4)))
    assert not every_parameter_used(SimpleNamespace(config=LlavaConfig()))
    assert not every_parameter_used(str(tmp_path))  # a directory without a config.json

    class Trainer:
        def __init__(self, model, args=None):
            pass

    for given, expected in ((None, False), (True, True), (False, False)):
        config = SimpleNamespace(ddp_find_unused_parameters=given)
        set_find_unused_parameters(Trainer, object(), (dense,), {"args": config})
        assert config.ddp_find_unused_parameters is expected
    moe = SimpleNamespace(ddp_find_unused_parameters=None)
    set_find_unused_parameters(Trainer, object(), (SimpleNamespace(config=MixtralConfig(num_local_experts=4)),),
                               {"args": moe})
    assert moe.ddp_find_unused_parameters is None
