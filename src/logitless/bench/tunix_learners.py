"""Tiny Tunix 0.1.7 learners and the one jitted training step of each, as `logitless bench tunix` measures them and
tests/jax/test_tunix.py compares them: models of Tunix's families from a config (random weights, a language model's
spread of logits; a Qwen2 with qwix's LoRA), their token batches, Tunix's own DPO, ORPO, PEFT and logit-distillation
trainers on them, the value and gradient of Tunix's GRPO policy loss, and Tunix's own GRPO and PPO learners on an
`RLCluster` of tiny models on a mesh. Whether a step scores on the fused head is `logitless.tunix`'s switch at the
time the step is traced."""

from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tunix.models.qwen2 import model as qwen2
from tunix.rl import common
from tunix.rl.grpo import grpo_learner

import logitless.tunix as switch

PAD, EOS = 0, 2
SHAPE = dict(embed_dim=32, hidden_dim=64, num_heads=4, head_dim=8, num_kv_heads=2)  # of every tiny model's layers


def tiny_qwen2(vocab=1000, tied=False, seed=0, layers=1, **config):
    """A Tunix Qwen2 from a config (`SHAPE` unless ``config`` says otherwise), randomly initialized; its MLP (zeros
    at init) made random too, so that every parameter takes a gradient through every path."""
    settings = dict(SHAPE, rope_theta=10000, norm_eps=1e-6, **config)
    model = qwen2.Qwen2(qwen2.ModelConfig(num_layers=layers, vocab_size=vocab, use_tied_embedding=tied, **settings),
                        rngs=nnx.Rngs(seed))
    if tied:  # N(0, 1) embeddings make logits of ~50 and one-hot softmaxes: scaled to a language model's spread
        model.embedder.input_embedding[...] = 0.05 * model.embedder.input_embedding[...]
    key = jax.random.key(seed + 100)
    for layer in model.layers:
        for linear in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
            key, draw = jax.random.split(key)
            linear.kernel[...] = 0.1 * jax.random.normal(draw, linear.kernel[...].shape, linear.kernel[...].dtype)
    return model


LORA_PROJECTIONS = ".*q_proj|.*k_proj|.*v_proj|.*o_proj|.*gate_proj|.*up_proj|.*down_proj"  # Qwen2's, as Tunix adapts


def lora_qwen2(vocab=1000, tied=False, provider=None):
    """`tiny_qwen2` wrapped by qwix with ``provider``: by default LoRA of rank 2 on every attention and MLP projection,
    its B matrices random (zeros at init), so that the adapters change every log-prob."""
    import qwix

    provider = provider or qwix.LoraProvider(module_path=LORA_PROJECTIONS, rank=2, alpha=4.0,
                                             lora_b_initializer=jax.nn.initializers.normal(0.1))
    base = tiny_qwen2(vocab, tied)
    return qwix.quantize_model(base, provider, rngs=nnx.Rngs(0), **base.get_model_input())


FAMILIES = ("qwen2", "qwen3", "llama3", "llama3-tied", "gemma", "gemma3", "gemma4")  # `tiny_family`'s


def tiny_family(family, vocab=1000, seed=0):
    """A one-layer Tunix model of ``family`` (one of `FAMILIES`) from a config (random weights, its zero-initialized
    matrices (the MLPs') made random too, so that every parameter takes a gradient; its head scaled to a language
    model's spread of logits; Gemma's and Gemma 4's final soft cap 1, which bends logits of that size)."""
    from tunix.models.gemma import model as gemma
    from tunix.models.gemma3 import model as gemma3
    from tunix.models.gemma4 import model as gemma4
    from tunix.models.llama3 import model as llama3
    from tunix.models.qwen3 import model as qwen3

    shape = dict(num_layers=1, **SHAPE)
    rope = dict(rope_theta=10000, norm_eps=1e-6)
    build = {
        "qwen2": lambda: qwen2.Qwen2(qwen2.ModelConfig(vocab_size=vocab, **rope, **shape), rngs=nnx.Rngs(seed)),
        "llama3": lambda: llama3.Llama3(llama3.ModelConfig(vocab_size=vocab, **rope, **shape), rngs=nnx.Rngs(seed)),
        "llama3-tied": lambda: llama3.Llama3(llama3.ModelConfig(vocab_size=vocab, weight_tying=True, **rope, **shape),
                                             rngs=nnx.Rngs(seed)),
        "qwen3": lambda: qwen3.Qwen3(qwen3.ModelConfig(vocab_size=vocab, **rope, **shape), rngs=nnx.Rngs(seed)),
        "gemma": lambda: gemma.Gemma(gemma.ModelConfig(
            num_embed=vocab, final_logit_softcap=1.0, use_post_attn_norm=True, use_post_ffw_norm=True,
            attention_types=(gemma.AttentionType.GLOBAL,), **shape), rngs=nnx.Rngs(seed)),
        "gemma3": lambda: gemma3.Gemma3(gemma3.ModelConfig(num_embed=vocab, sliding_window_size=8,
                                                           param_dtype=jnp.float32, **shape), rngs=nnx.Rngs(seed)),
        "gemma4": lambda: gemma4.Gemma4(gemma4.ModelConfig(num_embed=vocab, sliding_window_size=8,
                                                           final_logit_softcap=1.0, **shape), rngs=nnx.Rngs(seed)),
    }
    model = build[family]()
    key = jax.random.key(seed + 100)
    for _, variable in nnx.iter_graph(model):
        if isinstance(variable, nnx.Param) and variable[...].ndim >= 2 and not jnp.any(variable[...]):
            key, draw = jax.random.split(key)
            variable[...] = 0.1 * jax.random.normal(draw, variable[...].shape, variable[...].dtype)
    embedding = model.embedder.input_embedding
    embedding[...] = 0.05 * embedding[...] / max(float(jnp.std(embedding[...])), 1e-6)
    if hasattr(model, "lm_head"):
        model.lm_head.w[...] = 0.15 * model.lm_head.w[...] / max(float(jnp.std(model.lm_head.w[...])), 1e-6)
    return model


def token_batch(vocab, batch=4, prompt=6, completion=5, seed=0):
    """Prompt ids (B, P), left-padded, and completion ids (B, C), right-padded, as a Tunix rollout hands them
    (the first prompt and the second completion, or with one sequence its own, are the padded ones)."""
    rng = np.random.default_rng(seed)
    prompt_ids = rng.integers(3, vocab, (batch, prompt))
    prompt_ids[0, :2] = PAD
    completion_ids = rng.integers(3, vocab, (batch, completion))
    completion_ids[min(1, batch - 1), 3:] = PAD
    return jnp.asarray(prompt_ids), jnp.asarray(completion_ids)


def kept_gradients(learning_rate=1e-2):
    """SGD that keeps the last gradient in its state, where a test reads it after Tunix's step."""

    def init(params):
        return {"grads": jax.tree.map(jnp.zeros_like, params)}

    def update(grads, state, params=None):
        return jax.tree.map(lambda grad: -learning_rate * grad, grads), {"grads": grads}

    return optax.GradientTransformation(init, update)


def grpo_loss_step(model, example, config, loss_name="grpo", wrt=...):
    """The jitted value and gradient of Tunix's registered policy loss ``loss_name`` of ``model`` on ``example`` (a
    GRPO `TrainExample`), taken with respect to the model's variables that the filter ``wrt`` selects (by default its
    whole state; Tunix trains a LoRA model's `nnx.LoRAParam` only): (step, state); ``step(state)`` returns
    ((loss, metrics), gradients)."""
    loss_fn = grpo_learner.function_registry.get_policy_loss_fn(loss_name)
    graphdef, state, frozen = nnx.split(model, wrt, ...)

    def loss(state):
        return loss_fn(nnx.merge(graphdef, state, frozen), example, algo_config=config, pad_id=PAD, eos_id=EOS)

    return jax.jit(jax.value_and_grad(loss, has_aux=True)), state


def on_policy_example(vocab, batch=4, prompt=6, completion=5):
    """A GRPO `TrainExample` on-policy (no old or reference log-probs), every advantage 1."""
    prompt_ids, completion_ids = token_batch(vocab, batch, prompt, completion)
    return grpo_learner.TrainExample(
        prompt_ids=prompt_ids, prompt_mask=prompt_ids != PAD, completion_ids=completion_ids,
        completion_mask=completion_ids != PAD, advantages=jnp.ones(batch), ref_per_token_logps=None,
        old_per_token_logps=None)


def grpo_config():
    """Tunix's GRPO config without the KL term, at temperature 1 (which the learner sets from its rollout's)."""
    config = grpo_learner.GRPOConfig(num_generations=2, beta=0.0)
    config.temperature = 1.0
    return config


def preference_batch(vocab, batch=2, prompt=6, completion=5, seed=0):
    """DPO's tokenized input: prompts (B, P) left-padded, chosen and rejected completions (B, C) right-padded."""
    prompt_ids, chosen_ids = token_batch(vocab, batch, prompt, completion, seed)
    rejected_ids = token_batch(vocab, batch, prompt, completion, seed + 1)[1]
    return dict(prompt_ids=prompt_ids, prompt_mask=prompt_ids != PAD, chosen_ids=chosen_ids,
                chosen_mask=chosen_ids != PAD, rejected_ids=rejected_ids, rejected_mask=rejected_ids != PAD)


def sequence_batch(vocab, batch=2, length=11, seed=0):
    """A PEFT trainer's input: ids (B, L) with the positions and causal mask of their padding."""
    prompt_ids, completion_ids = token_batch(vocab, batch, length - length // 2, length // 2, seed)
    input_tokens = jnp.concatenate([prompt_ids, completion_ids], axis=1)
    mask = input_tokens != PAD
    return dict(input_tokens=input_tokens, input_mask=mask, positions=common.build_positions_from_mask(mask),
                attention_mask=common.make_causal_attn_mask(mask))


def dpo_trainer(vocab, batch=2, length=11, family=None, algorithm="dpo"):
    """Tunix's DPOTrainer: DPO against a reference model (label smoothing 0.1) or ORPO, of a ``family``'s model
    (`tiny_family`; by default a tied Qwen2 for DPO, a Llama3 for ORPO); and its input, B prompts of L - L // 2 tokens
    with chosen and rejected completions of L // 2."""
    from tunix.sft.dpo import dpo_trainer as dpo

    config = dpo.DPOTrainingConfig(algorithm=algorithm, beta=0.1, lambda_orpo=0.2, label_smoothing=0.1,
                                   eval_every_n_steps=100, max_steps=1)
    if family is None and algorithm == "dpo":
        model, reference = tiny_qwen2(vocab, tied=True), tiny_qwen2(vocab, tied=True, seed=1)
    else:
        model = tiny_family(family or "llama3", vocab)
        reference = tiny_family(family, vocab, seed=1) if algorithm == "dpo" else None
    inputs = preference_batch(vocab, batch, length - length // 2, length // 2)
    return dpo.DPOTrainer(model, reference, kept_gradients(), config), inputs


def peft_trainer(vocab, batch=2, length=11, family=None, model=None):
    """Tunix's PeftTrainer with its default loss (the cross-entropy of every next token) on ``model``, by default a
    ``family``'s (`tiny_family`, a Gemma3 unless told); and its input, B sequences of L tokens."""
    from tunix.sft import peft_trainer as peft

    model = tiny_family(family or "gemma3", vocab) if model is None else model
    trainer = peft.PeftTrainer(model, kept_gradients(),
                               peft.TrainingConfig(eval_every_n_steps=100, max_steps=1))
    return trainer, sequence_batch(vocab, batch, length)


def distillation_trainer(vocab, batch=2, length=11, family=None):
    """Tunix's DistillationTrainer with a LogitStrategy (temperature 2, alpha 0.3, Tunix's one-hot labels of the
    next tokens) between two models of a ``family`` (`tiny_family`; by default from a Qwen3 teacher to an untied
    Qwen2 student); and its input, B sequences of L tokens."""
    from tunix.distillation import distillation_trainer as distillation
    from tunix.distillation import strategies

    def forward(model, input_tokens, input_mask, positions, attention_mask):  # as Tunix's examples write it
        logits, _ = model(input_tokens, positions, None, attention_mask)
        return logits[:, :-1, :]

    def labels(input_tokens, input_mask, positions, attention_mask):
        return jax.nn.one_hot(input_tokens[:, 1:], vocab) * input_mask[:, 1:, None]  # (B, L - 1, V)

    strategy = strategies.LogitStrategy(forward, forward, labels, temperature=2.0, alpha=0.3)
    student = tiny_qwen2(vocab) if family is None else tiny_family(family, vocab)
    teacher = tiny_family("qwen3", vocab) if family is None else tiny_family(family, vocab, seed=1)
    trainer = distillation.DistillationTrainer(student, teacher, strategy,
                                               kept_gradients(), distillation.TrainingConfig(eval_every_n_steps=100,
                                                                                             max_steps=1))
    inputs = sequence_batch(vocab, batch, length)
    trainer = trainer.with_gen_model_input_fn(lambda x: {
        name: inputs[name] for name in ("input_tokens", "input_mask", "positions", "attention_mask")})
    return trainer, distillation.TrainingInput(input_tokens=inputs["input_tokens"], input_mask=inputs["input_mask"])


SFT_LEARNERS = {"distillation": distillation_trainer,
                "dpo": functools.partial(dpo_trainer, algorithm="dpo"),
                "orpo": functools.partial(dpo_trainer, algorithm="orpo"),
                "peft": peft_trainer,  # each (vocab, batch=2, length=11, family=its own) -> (trainer, its input)
                "peft-lora": lambda vocab, batch=2, length=11: peft_trainer(vocab, batch, length,
                                                                            model=lora_qwen2(vocab))}


class IdTokenizer:
    """A tokenizer for Tunix's sampler: "t5 t9" <-> [5, 9]; 1 begins, `EOS` ends and `PAD` pads."""

    def encode(self, text, **kwargs):
        return [int(word[1:]) for word in str(text).split()]

    def decode(self, ids, **kwargs):
        return " ".join(f"t{int(i)}" for i in ids)

    def bos_id(self):
        return 1

    def eos_id(self):
        return EOS

    def pad_id(self):
        return PAD


class TinyCritic(nnx.Module):
    """A value model as Tunix's PPO reads one (`common.compute_score`): token ids (B, T) to a value per token
    (B, T, 1), here from each token's embedding alone."""

    def __init__(self, vocab, width=8, seed=2):
        rngs = nnx.Rngs(seed)
        self.embedding = nnx.Embed(vocab, width, rngs=rngs)
        self.value = nnx.Linear(width, 1, rngs=rngs)

    def __call__(self, ids, positions=None, cache=None, attention_mask=None, segment_ids=None):
        return self.value(self.embedding(ids))  # (B, T, 1)


RL_PROMPTS = {"prompts": np.array(["t5 t9 t11", "t7 t3"])}  # a batch of two prompts for `rl_learner`


def rl_learner(algorithm, mesh, vocab=64):
    """Tunix's own GRPOLearner (``algorithm="grpo"``, 2 generations a prompt) or PpoLearner (``"ppo"``: a
    `TinyCritic`, GAE, ``entropy_coef`` 0.05) for one step on tiny Qwen2s of ``vocab`` tokens: an `RLCluster` with
    every role on ``mesh`` (where it lays the models out by their ``shd_config``), the vanilla rollout (6 tokens at
    temperature 0.8), a reference model (``beta`` 0.04), `kept_gradients` SGD, a completion's length in characters
    / 20 its reward; to train on `RL_PROMPTS`: (learner, cluster, the policy as made, which the cluster copies to its
    mesh and trains the copy of: ``cluster.actor_trainer.model``)."""
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.ppo import ppo_learner
    from tunix.rl.rollout import base_rollout

    actor, reference = tiny_qwen2(vocab, layers=1, seed=0), tiny_qwen2(vocab, layers=1, seed=1)
    critic = TinyCritic(vocab) if algorithm == "ppo" else None
    cluster_config = rl_cluster_lib.ClusterConfig(
        role_to_mesh={role: mesh for role in rl_cluster_lib.Role}, rollout_engine="vanilla", offload_to_cpu=False,
        training_config=rl_cluster_lib.RLTrainingConfig(actor_optimizer=kept_gradients(),
                                                        critic_optimizer=kept_gradients(), eval_every_n_steps=100,
                                                        max_steps=1),
        rollout_config=base_rollout.RolloutConfig(max_tokens_to_generate=6, max_prompt_length=8, kv_cache_size=32,
                                                  temperature=0.8, seed=jax.random.key(3)))
    cluster = rl_cluster_lib.RLCluster(actor=actor, reference=reference, critic=critic, tokenizer=IdTokenizer(),
                                       cluster_config=cluster_config)
    rewards = lambda prompts, completions, **kwargs: [len(c) / 20 for c in completions]  # noqa: E731
    if algorithm == "ppo":
        config = ppo_learner.PPOConfig(beta=0.04, entropy_coef=0.05)
        return ppo_learner.PPOLearner(rl_cluster=cluster, ppo_config=config, reward_fns=rewards), cluster, actor
    config = grpo_learner.GRPOConfig(num_generations=2, beta=0.04)
    return grpo_learner.GRPOLearner(rl_cluster=cluster, algo_config=config, reward_fns=rewards), cluster, actor


def logged_metrics(*loggers) -> dict:
    """What Tunix's metrics loggers hold: {(prefix, mode, name): the values logged, fp64}."""
    return {(prefix, str(mode), name): np.asarray(values, np.float64) for logger in loggers
            for prefix, modes in logger._metrics.items() for mode, names in modes.items()
            for name, values in names.items()}


class LearnerStep(NamedTuple):
    logged: dict  # every metric logged: the policy's, the critic's, the cluster's (rewards, lengths, advantages)
    grads: object  # the policy's gradients, as the optimizer took them
    params: object  # the policy's parameters after the step, laid out on the mesh
    moved: bool  # whether the step changed the policy's parameters
    fused_calls: int  # how often the fused op was traced


def rl_learner_step(algorithm, mesh, fused: bool, vocab=64) -> LearnerStep:
    """One step of `rl_learner`'s learner, stock Tunix's or with `logitless.tunix`'s switch on."""
    learner, cluster, actor = rl_learner(algorithm, mesh, vocab)
    calls = []
    fused_op = switch.fused_linear_logprobs
    switch.fused_linear_logprobs = lambda *args, **kwargs: calls.append(1) or fused_op(*args, **kwargs)
    try:
        with switch.use_fused_head() if fused else contextlib.nullcontext():
            learner.train([RL_PROMPTS])
    finally:
        switch.fused_linear_logprobs = fused_op
    critic = [cluster.critic_trainer.metrics_logger] if algorithm == "ppo" else []
    params = nnx.state(cluster.actor_trainer.model, nnx.Param)
    moved = not all(map(np.array_equal, jax.tree.leaves(params), jax.tree.leaves(nnx.state(actor, nnx.Param))))
    return LearnerStep(logged_metrics(cluster.actor_trainer.metrics_logger, *critic, cluster._rl_metrics_logger),
                       cluster.actor_trainer.optimizer.opt_state["grads"], params, moved, len(calls))


def train_step(trainer, batch):
    """A Tunix trainer's jitted train step, traced afresh (with the scoring switched on now), and its prepared
    input: (step, inputs); ``step.func.lower(*step.args, inputs)`` lowers it, ``step(inputs)`` runs one step."""
    trainer.clear_jit_cache()
    step, _ = trainer.jit_train_and_eval_step(cache_nnx_graph=False)  # partial(nnx.jit(step), model, optimizer)
    return step, trainer._prepare_inputs(batch)
