"""`logitless.tunix`: Tunix 0.1.7 switched onto the fused head scores tiny Tunix models of every family as stock Tunix
does (log-probs, entropy, the GRPO and PPO losses and the DPO, ORPO, PEFT and distillation trainers' losses with their
metrics and gradients, one step of each learner, GRPO and PPO included), to the rounding of fp32 (of bf16 where stock
rounds a bf16 model's logits), and the compiled GRPO step loses the logits' share of its temporaries."""

import contextlib
import functools
import re
import subprocess
import sys

import numpy as np
import pytest

import jax
import jax.numpy as jnp

EPS = float(np.finfo(np.float32).eps)
try:  # without Tunix, the `tunix` fixture fails each test, saying how to get it
    from logitless.bench.tunix_learners import (EOS, FAMILIES, PAD, SFT_LEARNERS, grpo_config, grpo_loss_step,
                                                kept_gradients, logged_metrics, lora_qwen2, on_policy_example,
                                                rl_learner_step, sequence_batch, tiny_family, tiny_qwen2, token_batch,
                                                train_step)
except ImportError:
    pass


@pytest.fixture(scope="module")
def tunix():
    """The Tunix modules the tests use and `logitless.tunix`; without Tunix every test fails, saying how to get it."""
    try:
        from flax import nnx
        from tunix.models.qwen2 import model as qwen2
        from tunix.rl import algo_core, common
        from tunix.rl.grpo import grpo_learner

        import logitless.tunix as switch
    except ImportError as err:
        pytest.fail(f"Tunix is not installed ({err}): pip install 'logitless[tunix]'",
                    pytrace=False)
    return dict(nnx=nnx, qwen2=qwen2, algo_core=algo_core, common=common, grpo_learner=grpo_learner, switch=switch)


@pytest.fixture(autouse=True)
def _stock_tunix_after_each_test():
    yield
    if "logitless.tunix" in sys.modules:
        sys.modules["logitless.tunix"].use_stock_head()


def assert_rounding(got, expected, roundings, what, eps=EPS, scale=None):
    """``got`` equals ``expected`` within ``roundings`` roundings (``eps``: fp32's unless told) of ``scale``, by
    default the largest of the values expected (all 0: exactly)."""
    got, expected = np.asarray(got, np.float64), np.asarray(expected, np.float64)
    scale = max(float(np.abs(expected).max()) if scale is None else scale, float(np.finfo(np.float32).tiny))
    error = float(np.abs(got - expected).max())
    print(f"{what}: {error / (eps * scale):.2f} roundings of {scale:.3g}")  # what `pytest -s` shows, measured
    assert error <= roundings * eps * scale, f"{what}: max error {error:.3g} > {roundings} x eps x {scale:.3g}"


@pytest.mark.parametrize("tied, temperature, packed", [(False, 1.0, False), (False, 0.7, False), (True, 0.7, False),
                                                       (True, 0.0, False), (False, 0.9, True)],
                         ids=["lm_head", "lm_head-temperature", "tied-temperature", "tied-temperature-0", "packed"])
def test_switched_scoring_equals_tunix(tunix, tied, temperature, packed):
    """`compute_per_token_logps` against Tunix's: log-probs (B, C), the entropy Tunix's losses take of its logits,
    with and without packing (whose padded front position Tunix scores 0 and entropy log V), and a temperature
    Tunix leaves out at 0 and 1."""
    nnx, common, algo_core, switch = tunix["nnx"], tunix["common"], tunix["algo_core"], tunix["switch"]
    vocab = 1000
    graphdef, state = nnx.split(tiny_qwen2(vocab, tied))
    prompt_ids, completion_ids = token_batch(vocab)
    packing = {}
    if packed:  # one packed row per sequence: the prompt is empty, the positions and segments given
        completion_ids = jnp.concatenate([prompt_ids, completion_ids], axis=1)
        prompt_ids = prompt_ids[:, :0]
        packing = dict(segment_ids=(completion_ids != PAD).astype(jnp.int32),
                       segment_positions=jnp.broadcast_to(jnp.arange(completion_ids.shape[1]), completion_ids.shape))
    arguments = (graphdef, state, prompt_ids, completion_ids, PAD, EOS)
    stock_log_probs, stock_logits = common.compute_per_token_logps(*arguments, return_logits=True,
                                                                   temperature=temperature, **packing)
    log_probs, token_entropy = switch.compute_per_token_logps(*arguments, return_logits=True, temperature=temperature,
                                                              **packing)
    assert log_probs.shape == stock_log_probs.shape == completion_ids.shape and log_probs.dtype == jnp.float32
    assert isinstance(token_entropy, switch.TokenEntropy)
    assert_rounding(log_probs, stock_log_probs, 16, "log-probs")
    stock_entropy = algo_core.compute_entropy_from_logits(stock_logits)
    assert_rounding(switch.compute_entropy_from_logits(token_entropy), stock_entropy, 16, "entropy")
    assert_rounding(switch.compute_entropy_from_logits(stock_logits), stock_entropy, 0, "Tunix's logits' entropy")
    assert float(stock_entropy.min()) > 0.1  # spread distributions: the entropy is compared where it is not ~0
    only_log_probs = switch.compute_per_token_logps(*arguments, temperature=temperature, **packing)
    assert_rounding(only_log_probs, log_probs, 4, "log-probs without the entropy")
    if packed:
        assert float(jnp.abs(log_probs[:, 0]).max()) == 0.0
        np.testing.assert_allclose(token_entropy.entropy[:, 0], np.log(vocab), rtol=4 * EPS)


@pytest.mark.parametrize("family", [family for family in FAMILIES if family != "qwen2"])
def test_every_tunix_family_is_scored_as_stock_tunix_scores_it(tunix, family):
    """Each model family Tunix 0.1.7 ships, tied or not, with Gemma's final soft cap (which the switch applies in
    the fused head, not after it) and Gemma 4's casts: the log-probs and entropy equal Tunix's, at a temperature."""
    nnx, common, algo_core, switch = tunix["nnx"], tunix["common"], tunix["algo_core"], tunix["switch"]
    graphdef, state = nnx.split(tiny_family(family))
    prompt_ids, completion_ids = token_batch(1000)
    arguments = (graphdef, state, prompt_ids, completion_ids, PAD, EOS)
    stock_log_probs, stock_logits = common.compute_per_token_logps(*arguments, return_logits=True, temperature=0.7)
    log_probs, token_entropy = switch.compute_per_token_logps(*arguments, return_logits=True, temperature=0.7)
    if family in ("gemma", "gemma4"):  # logits in the cap's bend (tanh(x) < 0.96 x): a head read without it differs
        assert 0.5 < 0.7 * float(jnp.abs(stock_logits).max()) <= 1.0
    assert_rounding(log_probs, stock_log_probs, 16, f"{family} log-probs")
    stock_entropy = algo_core.compute_entropy_from_logits(stock_logits)
    assert_rounding(switch.compute_entropy_from_logits(token_entropy), stock_entropy, 16, f"{family} entropy")
    assert float(stock_entropy.min()) > 0.1


@pytest.mark.parametrize("tied", [False, True], ids=["lm_head", "tied"])
def test_a_bf16_model_is_scored_as_stock_tunix_scores_it_to_bf16_logits_rounding(tunix, tied):
    """A Qwen2 with bf16 weights and activations: the fused op multiplies the bf16 hidden states and weight with fp32
    accumulation and keeps its logits in fp32, where Tunix rounds its head's logits to bf16 first; the log-probs and
    entropy differ from Tunix's by at most that rounding (a wrong head, a temperature left out, differs by far more)."""
    nnx, common, algo_core, switch, qwen2 = (tunix[name] for name in ("nnx", "common", "algo_core", "switch", "qwen2"))
    config = qwen2.ModelConfig(num_layers=1, vocab_size=1000, embed_dim=32, hidden_dim=64, num_heads=4, head_dim=8,
                               num_kv_heads=2, rope_theta=10000, norm_eps=1e-6, use_tied_embedding=tied,
                               dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    model = qwen2.Qwen2(config, rngs=nnx.Rngs(0))
    if tied:
        model.embedder.input_embedding[...] = 0.05 * model.embedder.input_embedding[...]
    graphdef, state = nnx.split(model)
    arguments = (graphdef, state, *token_batch(1000), PAD, EOS)
    stock_log_probs, stock_logits = common.compute_per_token_logps(*arguments, return_logits=True, temperature=0.7)
    log_probs, token_entropy = switch.compute_per_token_logps(*arguments, return_logits=True, temperature=0.7)
    rounding = 2 * float(jnp.finfo(jnp.bfloat16).eps) * float(jnp.abs(stock_logits).max())  # of the largest logit
    assert float(jnp.abs(log_probs - stock_log_probs).max()) <= rounding
    entropy = switch.compute_entropy_from_logits(token_entropy)
    assert float(jnp.abs(entropy - algo_core.compute_entropy_from_logits(stock_logits)).max()) <= rounding
    assert log_probs.dtype == jnp.float32 and float(jnp.abs(log_probs - stock_log_probs).max()) > 0  # bf16 ran


def grpo_example(tunix, vocab, seed=0, old=True):
    """A GRPO `TrainExample` (B=4, P=6, C=5) with the reference's and the old policy's log-probs near the policy's."""
    prompt_ids, completion_ids = token_batch(vocab, seed=seed)
    rng = np.random.default_rng(seed + 1)
    near = lambda: jnp.asarray(-rng.uniform(0.5, 9.0, completion_ids.shape), jnp.float32)  # noqa: E731
    return tunix["grpo_learner"].TrainExample(
        prompt_ids=prompt_ids, prompt_mask=prompt_ids != PAD, completion_ids=completion_ids,
        completion_mask=completion_ids != PAD, advantages=jnp.asarray(rng.standard_normal(4), jnp.float32),
        ref_per_token_logps=near(), old_per_token_logps=near() if old else None)


def loss_step(tunix, loss_name, model, example, config, wrt=...):
    """Tunix's registered policy loss ``loss_name`` of ``model`` on ``example``, jitted afresh (a jitted step keeps
    the scoring it was first traced with): (loss, metrics, gradients w.r.t. the variables ``wrt`` selects, the step's
    program)."""
    step, state = grpo_loss_step(model, example, config, loss_name, wrt)
    (value, metrics), grads = step(state)
    return value, metrics, grads, step.lower(state).as_text()


def assert_equal_steps(stock, switched, logits_type, metric_scales=None):
    """Two `loss_step` results: the same loss, metrics and gradients to fp32 rounding (a metric in ``metric_scales``
    {name: scale} of that scale, where it is the difference of values that large), and the stock program holds the
    logits (``logits_type``, e.g. "tensor<4x11x1000xf32>", or a pattern of what is made of them) where the switched
    one holds none."""
    (stock_loss, stock_metrics, stock_grads, stock_program), (loss, metrics, grads, program) = stock, switched
    logits = logits_type if isinstance(logits_type, re.Pattern) else re.compile(re.escape(logits_type))
    assert logits.search(stock_program) and not logits.search(program)
    assert_rounding(loss, stock_loss, 16, "loss")
    assert set(metrics) == set(stock_metrics)
    for name in metrics:
        assert_rounding(metrics[name], stock_metrics[name], 16, name, scale=(metric_scales or {}).get(name))
    assert len(assert_equal_gradients(grads, stock_grads)) >= 10


def assert_equal_gradients(grads, stock_grads, roundings=64, eps=EPS):
    """Each parameter's gradient equals stock Tunix's within ``roundings`` roundings (``eps``: fp32's unless told) of
    its largest value, and none is 0; a gradient that is 0 but for rounding (below ``roundings`` fp32 roundings of the
    model's largest gradient: the loss does not depend on that parameter, as a one-layer Gemma 4's on the scale of
    its layer's output, which the final norm divides away) within as many roundings of the model's largest gradient.
    Returns the gradients of the parameters {path: (switched, stock)}."""
    flat, stock_flat = (dict(jax.tree_util.tree_leaves_with_path(g)) for g in (grads, stock_grads))
    assert flat.keys() == stock_flat.keys()
    largest = max(float(jnp.abs(grad).max()) for grad in stock_flat.values())
    for path, grad in flat.items():
        own = float(jnp.abs(stock_flat[path]).max())
        assert own > 0, jax.tree_util.keystr(path)
        scale = own if own > roundings * EPS * largest else largest
        assert_rounding(grad, stock_flat[path], roundings, "gradient " + jax.tree_util.keystr(path), eps, scale)
    return {path: (grad, stock_flat[path]) for path, grad in flat.items()}


def grpo_loss_config(tunix, loss_algo="grpo", loss_agg_mode="token-mean"):
    """Tunix's GRPO config of the loss tests: the KL to the reference (beta 0.04), epsilon 0.1, temperature 0.8."""
    config = tunix["grpo_learner"].GRPOConfig(num_generations=2, beta=0.04, loss_algo=loss_algo,
                                              loss_agg_mode=loss_agg_mode, epsilon=0.1)
    config.temperature = 0.8  # the learner sets it from the rollout's
    return config


def ppo_loss_inputs(tunix, vocab):
    """Tunix's PPO policy loss's config (an entropy bonus, a KL) and a `TrainExample` with an advantage per token."""
    from types import SimpleNamespace

    config = SimpleNamespace(epsilon_low=0.2, epsilon_high=0.28, entropy_coef=0.05, kl_coef=0.05, kl_clamp_value=None)
    example = grpo_example(tunix, vocab, seed=3)
    return config, example.replace(advantages=jnp.asarray(np.random.default_rng(4).standard_normal((4, 5)),
                                                           jnp.float32))


@pytest.mark.slow
@pytest.mark.parametrize("tied, loss_algo, loss_agg_mode, old", [
    (False, "grpo", "token-mean", True), (True, "gspo-token", "sequence-mean-token-mean", False)],
    ids=["lm_head-grpo", "tied-gspo-on-policy"])
def test_grpo_loss_metrics_and_gradients_equal_tunix(tunix, tied, loss_algo, loss_agg_mode, old):
    """Tunix's GRPO loss (the KL to the reference, a temperature) runs unchanged on the switched scoring: its loss,
    every metric (the entropy included) and the gradient of every parameter equal stock Tunix's."""
    config = grpo_loss_config(tunix, loss_algo, loss_agg_mode)
    model, example = tiny_qwen2(1000, tied), grpo_example(tunix, 1000, old=old)
    stock = loss_step(tunix, "grpo", model, example, config)
    with tunix["switch"].use_fused_head():
        switched = loss_step(tunix, "grpo", model, example, config)
    assert "entropy" in switched[1]
    assert_equal_steps(stock, switched, "tensor<4x11x1000xf32>")  # (B, P + C, V)


@pytest.mark.slow
def test_ppo_policy_loss_with_an_entropy_bonus_equals_tunix(tunix):
    """Tunix's PPO policy loss reads the entropy through the same two functions, and with ``entropy_coef`` it is part
    of the loss: the entropy's gradient, through the fused op's, equals Tunix's from its logits."""
    config, example = ppo_loss_inputs(tunix, 1000)
    model = tiny_qwen2(1000)
    stock = loss_step(tunix, "ppo", model, example, config)
    with tunix["switch"].use_fused_head():
        switched = loss_step(tunix, "ppo", model, example, config)
    assert "loss/entropy" in switched[1]
    assert_equal_steps(stock, switched, "tensor<4x11x1000xf32>")


@pytest.mark.slow
@pytest.mark.parametrize("family", [family for family in FAMILIES if family != "qwen2"])
def test_the_grpo_and_ppo_losses_equal_tunix_on_every_family(tunix, family):
    """Each other model family Tunix ships (Llama3 tied and not, Gemma's and Gemma 4's logits in their soft cap's
    bend): Tunix's GRPO loss (the KL to the reference, off policy, a temperature) and its PPO policy loss with an
    entropy bonus, switched, have stock Tunix's loss, metrics and gradient of every parameter."""
    vocab = 257
    model = tiny_family(family, vocab)
    ppo_config, ppo_example = ppo_loss_inputs(tunix, vocab)
    for loss_name, config, example in (("grpo", grpo_loss_config(tunix), grpo_example(tunix, vocab)),
                                       ("ppo", ppo_config, ppo_example)):
        stock = loss_step(tunix, loss_name, model, example, config)
        with tunix["switch"].use_fused_head():
            switched = loss_step(tunix, loss_name, model, example, config)
        assert_equal_steps(stock, switched, f"tensor<4x11x{vocab}xf32>")


def replaced_by_the_switch(tunix):
    """Every function of Tunix's that the switch replaces, where Tunix looks it up, and its replacement:
    [(owner, attribute, replacement)]."""
    from tunix.distillation.strategies import logit
    from tunix.sft import peft_trainer

    import logitless.tunix_distillation as distillation

    common, algo_core, switch = tunix["common"], tunix["algo_core"], tunix["switch"]
    return [(common, "compute_per_token_logps", switch.compute_per_token_logps),
            (algo_core, "compute_entropy_from_logits", switch.compute_entropy_from_logits),
            (common, "get_per_token_logps", switch.get_per_token_logps),
            (peft_trainer, "_default_loss_fn", switch.default_loss_fn),
            *((logit.LogitStrategy, name, getattr(distillation, name))
              for name in ("get_student_outputs", "get_teacher_outputs", "compute_loss", "compute_eval_loss"))]


def test_the_switch_replaces_tunixs_functions_once_and_gives_them_back(tunix):
    """Each function replaced while the switch is on, and Tunix's own after (a method LogitStrategy inherits
    inherited again); a PEFT trainer made before the switch (which took Tunix's default loss then) takes the
    replacement, and gives it back."""
    from tunix.sft import peft_trainer as peft

    switch = tunix["switch"]
    seams = replaced_by_the_switch(tunix)
    current = lambda: [vars(owner).get(name, "inherited") for owner, name, _ in seams]  # noqa: E731
    stock = current()
    trainer = peft.PeftTrainer(tiny_qwen2(64), kept_gradients(), peft.TrainingConfig(eval_every_n_steps=1))
    assert not switch.fused_head_in_use() and stock.count("inherited") == 2
    with switch.use_fused_head():
        switch.use_fused_head()  # a second call changes nothing
        assert switch.fused_head_in_use()
        assert current() == [ours for _, _, ours in seams]
        assert trainer.loss_fn is trainer.eval_loss_fn is switch.default_loss_fn
    assert current() == stock
    assert trainer.loss_fn is trainer.eval_loss_fn is peft._default_loss_fn
    switch.use_fused_head()
    switch.use_stock_head()
    switch.use_stock_head()
    assert current() == stock


def test_another_tunix_signature_another_model_and_no_tunix_are_refused_by_name(tunix, monkeypatch):
    nnx, common, switch = tunix["nnx"], tunix["common"], tunix["switch"]
    monkeypatch.setattr(common, "compute_per_token_logps", lambda graphdef, state, prompt_tokens: None)
    with pytest.raises(RuntimeError, match="Tunix 0.1.7"):
        switch.use_fused_head()
    monkeypatch.undo()

    class NotQwen2(nnx.Module):
        def __init__(self):
            self.weight = nnx.Param(jnp.zeros((3, 3)))

    graphdef, state = nnx.split(NotQwen2())
    prompt_ids, completion_ids = token_batch(50)
    with pytest.raises(TypeError, match=r"^model: logitless.tunix scores Tunix's Qwen2, Qwen3, Llama3, Gemma, Gemma3, "
                                        r"Gemma4, got .*NotQwen2\n"):
        switch.compute_per_token_logps(graphdef, state, prompt_ids, completion_ids, PAD, EOS)

    without_tunix = "import sys; sys.modules['tunix'] = None; import logitless.tunix"
    done = subprocess.run([sys.executable, "-c", without_tunix], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1] == ("ImportError: logitless.tunix needs Tunix: "
                                                     "pip install 'logitless[tunix]'")


def test_a_switch_after_a_step_compiled_takes_effect_at_the_next_step(tunix):
    """A Tunix trainer that compiled its step with Tunix's scoring, switched: its next step is traced again and scores
    on the fused head (the op runs in it), and switched back, the step after that on Tunix's own; never a step that
    keeps the scoring it was compiled with."""
    import optax
    from tunix.sft import peft_trainer

    nnx, common, switch = tunix["nnx"], tunix["common"], tunix["switch"]

    def loss_fn(model, prompt_ids, completion_ids):
        graphdef, state = nnx.split(model)
        return -common.compute_per_token_logps(graphdef, state, prompt_ids, completion_ids, PAD, EOS,
                                               stop_gradient=False).mean()

    trainer = peft_trainer.PeftTrainer(tiny_qwen2(64), optax.sgd(1e-2),
                                       peft_trainer.TrainingConfig(eval_every_n_steps=100, max_steps=1))
    trainer = trainer.with_loss_fn(loss_fn)
    prompt_ids, completion_ids = token_batch(64)
    batches = [dict(prompt_ids=prompt_ids, completion_ids=completion_ids)] * 3
    calls, stock_calls = [], []  # the fused op's and Tunix's scoring's, each counted when a step is traced
    fused_op, stock = switch.fused_linear_logprobs, common.compute_per_token_logps

    @functools.wraps(stock)
    def counted_stock(*args, **kwargs):
        stock_calls.append(1)
        return stock(*args, **kwargs)

    switch.fused_linear_logprobs = lambda *args, **kwargs: calls.append(1) or fused_op(*args, **kwargs)
    common.compute_per_token_logps = counted_stock
    try:
        trainer.train(batches[:1])  # compiled with Tunix's scoring
        assert (len(calls), len(stock_calls)) == (0, 1)
        switch.use_fused_head()
        trainer.config.max_steps = 2
        trainer.train(batches[:2])  # the second batch
        assert (len(calls), len(stock_calls)) == (1, 1)  # traced once more, on the fused head
        switch.use_stock_head()
        trainer.config.max_steps = 3
        trainer.train(batches)
        assert (len(calls), len(stock_calls)) == (1, 2) and trainer.train_steps == 3  # and again, on Tunix's
    finally:
        switch.fused_linear_logprobs, common.compute_per_token_logps = fused_op, stock


def one_device_mesh():
    return jax.make_mesh((1, 1), ("fsdp", "tp"), (jax.sharding.AxisType.Auto,) * 2)


def assert_equal_learner_steps(stock, switched):
    """Two `rl_learner_step` results: the same logged metrics to 16 fp32 roundings, gradients and the parameters the
    step changed to 64 (a zero-initialized bias, after the step, is its update alone, which carries its gradient's
    rounding); the fused op traced for the reference's scoring and the policy's loss, not by stock's."""
    (stock_logged, stock_grads, stock_params, stock_moved, stock_calls) = stock
    (logged, grads, params, moved, calls) = switched
    assert stock_moved and moved
    assert stock_calls == 0 and calls >= 2  # traced once for the reference, once for the policy's loss
    assert logged.keys() == stock_logged.keys()
    for key, values in logged.items():
        assert_rounding(values, stock_logged[key], 16, "/".join(key))
    assert_equal_gradients(grads, stock_grads)
    for (path, value), stock_value in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(stock_params)):
        assert_rounding(value, stock_value, 64, "parameter " + jax.tree_util.keystr(path))


@pytest.mark.slow
def test_one_grpo_learner_step_equals_stock_tunix(tunix):
    """Tunix's own GRPOLearner, one step (sampling, rewards, the reference's log-probs, the loss, the update): with the
    switch, the same logged metrics (loss, kl, pg_clipfrac, grad_norm, the rewards and lengths), gradients and
    parameters as stock Tunix, the fused op having scored the reference's tokens and the policy's."""
    stock, switched = (rl_learner_step("grpo", one_device_mesh(), fused) for fused in (False, True))
    assert {("actor", "train", name) for name in ("loss", "kl", "pg_clipfrac", "grad_norm")} <= switched[0].keys()
    assert_equal_learner_steps(stock, switched)


@pytest.mark.slow
def test_one_ppo_learner_step_with_an_entropy_bonus_equals_stock_tunix(tunix):
    """Tunix's own PpoLearner, one step (sampling, rewards, the reference's and the old policy's log-probs, the
    critic's values and GAE, the policy's loss with ``entropy_coef`` 0.05, the policy's and the critic's updates):
    with the switch, the same logged metrics (the policy's loss, entropy, pg_clipfrac and grad_norm, the critic's,
    the rewards, advantages, returns and values), policy gradients and parameters as stock Tunix, the entropy's
    gradient through the fused op's."""
    stock, switched = (rl_learner_step("ppo", one_device_mesh(), fused) for fused in (False, True))
    assert {("actor", "train", name) for name in ("loss", "loss/entropy", "pg_clipfrac", "grad_norm")} | {
        ("critic", "train", name) for name in ("loss", "vpred_mean")} <= switched[0].keys()
    assert_equal_learner_steps(stock, switched)


@pytest.mark.slow
def test_the_compiled_grpo_step_loses_the_logits_share_of_its_temporaries(tunix):
    """The jitted value-and-gradient of Tunix's GRPO loss on a Qwen2 with a 32,768-token vocabulary (B=4, P=8, C=24):
    stock Tunix's temporaries hold the fp32 logits of every position, prompt included, B (P + C) V 4 bytes, and
    what the softmax makes of them; switched, at most a quarter of that share is left, and the rest of the step
    (the body's activations and gradients) is the same size."""
    switch = tunix["switch"]
    vocab, batch, prompt, completion = 32768, 4, 8, 24
    model, example = tiny_qwen2(vocab, layers=1), on_policy_example(vocab, batch, prompt, completion)

    def temp_bytes():
        step, state = grpo_loss_step(model, example, grpo_config())
        return step.lower(state).compile().memory_analysis().temp_size_in_bytes

    stock = temp_bytes()
    with switch.use_fused_head():
        fused = temp_bytes()
    logits_bytes = batch * (prompt + completion) * vocab * 4
    assert stock > 2 * logits_bytes  # the logits, and their softmax and gradient, are most of stock's step
    assert fused <= stock - 0.75 * logits_bytes, (stock, fused, logits_bytes)
    print(f"compiled temporaries: stock {stock:,} B, switched {fused:,} B, logits {logits_bytes:,} B")


def trainer_step(tunix, make_trainer, fused: bool):
    """One step of the Tunix trainer that ``make_trainer()`` makes, with its input: (every logged metric, the step's
    gradients, the updated parameters, the text of the jitted train step's program)."""
    nnx, switch = tunix["nnx"], tunix["switch"]
    trainer, batch = make_trainer()  # made before the switch, which it then follows
    with switch.use_fused_head() if fused else contextlib.nullcontext():
        trainer.train([batch])
        step, inputs = train_step(trainer, batch)
        program = step.func.lower(*step.args, inputs).as_text()
        loss = trainer.loss_fn(trainer.model, **trainer.gen_model_input_fn(inputs))  # after the step
    logged = logged_metrics(trainer.metrics_logger)
    if isinstance(loss, tuple):  # the loss's metrics, which the distillation trainer does not log
        logged.update({("aux", name): np.asarray(value, np.float64) for name, value in loss[1].items()})
    return logged, trainer.optimizer.opt_state, nnx.state(trainer.model, nnx.Param), program


@pytest.mark.slow
@pytest.mark.parametrize("learner", sorted(SFT_LEARNERS))
def test_one_step_of_each_sft_learner_equals_stock_tunix(tunix, learner):
    """Tunix's own DPO (a reference model, label smoothing), ORPO, PEFT and logit-distillation trainers, each made
    before the switch, one step on a tiny vocabulary (257): with the switch, the same logged metrics (and the
    distillation loss's own), gradients and parameters (the gradients' rounding times the learning rate) as stock
    Tunix (a metric that Tunix takes as a difference compared at the scale of what it subtracts: `difference_scales`).
    The step's program holds no (B, T, V) array where stock Tunix's holds the logits, except distillation's
    labels (B, T, V), which its labels function makes: nothing there takes a softmax over the vocabulary, and the
    teacher's logits are no input of the step. ``peft-lora``: the PEFT trainer on a LoRA policy (qwix's, on a Qwen2),
    which it trains the LoRA parameters of only."""
    vocab = 257
    make_trainer = functools.partial(SFT_LEARNERS[learner], vocab)
    stock_logged, stock_grads, stock_params, stock_program = trainer_step(tunix, make_trainer, fused=False)
    logged, grads, params, program = trainer_step(tunix, make_trainer, fused=True)
    vocabulary_arrays = re.compile(rf"tensor<\d+x\d+x{vocab}x\w+>")  # (B, T, V) in any dtype
    step_inputs = lambda program: program[program.index("@main("):].split("\n")[0]  # noqa: E731
    assert vocabulary_softmax(vocab).search(stock_program) and not vocabulary_softmax(vocab).search(program)
    if learner == "distillation":
        assert vocabulary_arrays.search(step_inputs(stock_program))  # the teacher's logits
        assert not vocabulary_arrays.search(step_inputs(program))
        assert {key[-1] for key in logged if key[0] == "aux"} == {"distill/soft_loss", "distill/hard_loss",
                                                             "distill/kl_div", "distill/teacher_loss"}
    else:
        assert vocabulary_arrays.search(stock_program) and not vocabulary_arrays.search(program)
    assert logged.keys() == stock_logged.keys() and len(logged) >= 2
    scales = difference_scales(learner, vocab, {key[-1]: values for key, values in stock_logged.items()
                                                if key[0] == "aux"})
    for key, values in logged.items():
        assert_rounding(values, stock_logged[key], 16, "/".join(key), scale=scales.get(key[-1]))
    assert len(assert_equal_gradients(grads, stock_grads)) >= 8
    for (path, value), stock_value in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(stock_params)):
        assert_rounding(value, stock_value, 16, "parameter " + jax.tree_util.keystr(path))


def difference_scales(learner, vocab, stock_metrics, completion=5):
    """The scale at which each metric of ``learner``'s loss that Tunix takes as a difference is compared, that of what
    it subtracts, {name: scale}: distillation's KL (and the soft loss, it times the temperature 2 squared) at the
    softened distributions' cross-entropies, about log V; DPO's and ORPO's (``stock_metrics``) at the summed log-probs
    of a completion of C = ``completion`` tokens, up to C log V (the odds ratio, their exponential, times itself)."""
    cross_entropy = float(np.log(vocab))
    if learner == "distillation":
        return {"distill/kl_div": cross_entropy, "distill/soft_loss": 2.0**2 * cross_entropy}
    if learner in ("dpo", "orpo"):
        return {name: completion * cross_entropy * (float(np.abs(value).max()) if name == "odds_ratio" else 1.0)
                for name, value in stock_metrics.items()}
    return {}


def vocabulary_softmax(vocab):
    """What takes a softmax over the vocabulary in a program: an exp, log or subtract of a (B, T, ``vocab``) array."""
    return re.compile(rf"stablehlo\.(exponential|log|subtract) .*tensor<\d+x\d+x{vocab}x")


def sft_loss_step(tunix, learner, family, vocab, fused: bool):
    """The jitted value and gradient of the loss of Tunix's own trainer for ``learner`` on a ``family``'s tiny models,
    on the input the trainer prepares (DPO's reference log-probs, distillation's teacher outputs, each scored by the
    head switched on or not): (loss, its metrics, the gradients of the trained model's parameters, the program)."""
    nnx, switch = tunix["nnx"], tunix["switch"]
    trainer, batch = SFT_LEARNERS[learner](vocab, family=family)  # made before the switch, which it then follows
    with switch.use_fused_head() if fused else contextlib.nullcontext():
        inputs = trainer.gen_model_input_fn(trainer._prepare_inputs(batch))
        settings = {name: value for name, value in inputs.items() if isinstance(value, (str, int, float))}  # DPO's
        inputs = {name: value for name, value in inputs.items() if name not in settings}
        graphdef, params, rest = nnx.split(trainer.model, nnx.Param, ...)

        def loss(params, inputs):
            value = trainer.loss_fn(nnx.merge(graphdef, params, rest), **inputs, **settings)
            return value if isinstance(value, tuple) else (value, {})

        step = jax.jit(jax.value_and_grad(loss, has_aux=True))
        (value, metrics), grads = step(params, inputs)
        program = step.lower(params, inputs).as_text()
    return value, metrics, grads, program


# each learner on two families, each family under at least one learner (the whole cross product is 26 compiled pairs,
# too many for the suite); distillation leaves out Gemma and Gemma 4, refused for their soft cap
SFT_LEARNER_FAMILIES = [("dpo", "qwen3"), ("dpo", "gemma"), ("orpo", "qwen2"), ("orpo", "gemma4"),
                        ("peft", "llama3"), ("peft", "gemma"), ("distillation", "llama3-tied"),
                        ("distillation", "gemma3")]


@pytest.mark.slow
@pytest.mark.parametrize("learner, family", SFT_LEARNER_FAMILIES)
def test_each_sft_learners_loss_equals_tunix_on_two_families(tunix, learner, family):
    """Tunix's own DPO (a reference model), ORPO, PEFT and logit-distillation (teacher and student of one family)
    trainers, every model family Tunix ships under one of them (`SFT_LEARNER_FAMILIES`), vocabulary 257: switched,
    the trainer's loss, its metrics and the gradient of every parameter equal stock Tunix's, and nothing in the step
    takes a softmax over the vocabulary (a metric that Tunix takes as a difference compared at the scale of what it
    subtracts: `difference_scales`)."""
    vocab = 257
    stock = sft_loss_step(tunix, learner, family, vocab, fused=False)
    switched = sft_loss_step(tunix, learner, family, vocab, fused=True)
    assert_equal_steps(stock, switched, vocabulary_softmax(vocab), difference_scales(learner, vocab, stock[1]))


@pytest.mark.parametrize("tied", [False, True], ids=["lm_head", "tied"])
def test_a_lora_policy_is_scored_as_stock_tunix_scores_it(tunix, tied):
    """A Qwen2 with qwix's LoRA on its attention and MLP (the head untouched by its rules), the adapters nonzero: the
    switched log-probs and entropy equal Tunix's, whose body runs under qwix's interception; the same model without
    its adapters scores otherwise (by far more than the rounding), so the body the switch ran had them."""
    nnx, common, algo_core, switch = tunix["nnx"], tunix["common"], tunix["algo_core"], tunix["switch"]
    vocab = 257
    model = lora_qwen2(vocab, tied)
    prompt_ids, completion_ids = token_batch(vocab)
    score = lambda scoring, model: scoring(*nnx.split(model), prompt_ids, completion_ids, PAD, EOS,  # noqa: E731
                                           return_logits=True, temperature=0.7)
    stock_log_probs, stock_logits = score(common.compute_per_token_logps, model)
    log_probs, token_entropy = score(switch.compute_per_token_logps, model)
    assert_rounding(log_probs, stock_log_probs, 16, "LoRA log-probs")
    stock_entropy = algo_core.compute_entropy_from_logits(stock_logits)
    assert_rounding(switch.compute_entropy_from_logits(token_entropy), stock_entropy, 16, "LoRA entropy")
    without_adapters, _ = score(common.compute_per_token_logps, tiny_qwen2(vocab, tied))
    assert float(jnp.abs(without_adapters - stock_log_probs).max()) > 1e4 * EPS * float(jnp.abs(stock_log_probs).max())


@pytest.mark.slow
def test_grpo_loss_of_a_lora_policy_equals_tunix_and_leaves_the_head_undifferentiated(tunix):
    """Tunix's GRPO loss (the KL to the reference, off policy) of a tied LoRA Qwen2, differentiated as Tunix trains
    it, with respect to its `nnx.LoRAParam` only: the loss, every metric and every LoRA parameter's gradient equal
    stock Tunix's. The head's weight (the input embedding), frozen, takes no gradient: no matmul of the switched step
    yields a (V, H) array, where the same step differentiating every parameter has one."""
    nnx = tunix["nnx"]
    vocab, hidden = 257, 32
    config = tunix["grpo_learner"].GRPOConfig(num_generations=2, beta=0.04, epsilon=0.1)
    config.temperature = 0.8
    model, example = lora_qwen2(vocab, tied=True), grpo_example(tunix, vocab)
    stock = loss_step(tunix, "grpo", model, example, config, nnx.LoRAParam)
    with tunix["switch"].use_fused_head():
        switched = loss_step(tunix, "grpo", model, example, config, nnx.LoRAParam)
        every_parameter_program = loss_step(tunix, "grpo", model, example, config)[3]
    assert_equal_steps(stock, switched, f"tensor<4x11x{vocab}xf32>")
    trained = {str(path[-2].key) for path, _ in jax.tree_util.tree_leaves_with_path(switched[2])}
    assert trained == {"w_lora_a", "w_lora_b", "kernel_lora_a", "kernel_lora_b"}  # the attention's and the MLP's
    head_gradient = re.compile(rf"stablehlo\.dot_general [^\n]*-> tensor<({vocab}x{hidden}|{hidden}x{vocab})xf32>")
    assert head_gradient.search(every_parameter_program) and not head_gradient.search(switched[3])


def test_a_qwix_model_whose_rules_reach_the_head_is_refused_in_one_line(tunix):
    """A qwix model whose provider has a rule matching the head's module path (LoRA on ``lm_head``; quantized
    training of every module, the tied embedding's ``decode`` included), whose logits the fused head would compute
    without it, and one whose provider the switch does not read (a subclass of qwix's), are refused in one line."""
    import qwix

    class OwnLora(qwix.LoraProvider):
        pass

    nnx, common, switch = tunix["nnx"], tunix["common"], tunix["switch"]
    tied = tiny_qwen2(257, tied=True)
    refused = {
        "LoraProvider's rule module_path='.*proj|lm_head' matches its head 'lm_head'":
            lora_qwen2(257, provider=qwix.LoraProvider(module_path=".*proj|lm_head", rank=2, alpha=4.0)),
        "QtProvider's rule module_path='.*' matches its head 'embedder'": qwix.quantize_model(
            tied, qwix.QtProvider([qwix.QtRule(module_path=".*", weight_qtype="int8")]), skip_nnx_init=True,
            **tied.get_model_input()),  # its rules are read without the first call, which makes its quantization state
        "logitless.tunix reads the rules of qwix's LoraProvider, PtqProvider, QtProvider, found OwnLora":
            lora_qwen2(257, provider=OwnLora(module_path=".*q_proj", rank=2, alpha=4.0)),
    }
    prompt_ids, completion_ids = token_batch(257)
    with switch.use_fused_head():
        for reason, model in refused.items():
            one_line = rf"^model: a Qwen2 wrapped by qwix is refused: (its )?{re.escape(reason)}[^\n]*"
            with pytest.raises(NotImplementedError, match=one_line + r"use_stock_head\(\) scores it"):
                common.compute_per_token_logps(*nnx.split(model), prompt_ids, completion_ids, PAD, EOS)


def test_distillation_the_fused_head_cannot_match_is_refused_or_left_to_tunix(tunix):
    """LogitStrategy switched: a forward function that changes the logits' values, and a head with a final soft cap
    (which bends the logits the cross-entropy on the labels sums), are refused by name; a strategy distilling the
    teacher's top k logits runs Tunix's own methods, on the logits."""
    from tunix.distillation import strategies

    switch, vocab = tunix["switch"], 64
    batch = sequence_batch(vocab)

    def forward(model, input_tokens, input_mask, positions, attention_mask):
        return model(input_tokens, positions, None, attention_mask)[0][:, :-1, :]

    def softened(model, **inputs):
        return forward(model, **inputs) / 2.0

    def labels(input_tokens, input_mask, positions, attention_mask):
        return jax.nn.one_hot(input_tokens[:, 1:], vocab) * input_mask[:, 1:, None]

    model = tiny_qwen2(vocab)
    with switch.use_fused_head():
        with pytest.raises(TypeError, match=r"^student_forward_fn: does more to the logits than slice their leading "
                                            r"axes \(div, slice\)"):
            strategies.LogitStrategy(softened, forward, labels).get_student_outputs(model, batch)
        capped = strategies.LogitStrategy(forward, forward, labels)
        gemma = tiny_family("gemma", vocab)
        with pytest.raises(NotImplementedError, match=r"^model: a final soft cap \(1.0\)"):
            capped.compute_loss(capped.get_student_outputs(gemma, batch), capped.get_teacher_outputs(gemma, batch),
                                labels(**batch))
        top_k = strategies.LogitStrategy(forward, forward, labels, distill_top_k=8)
        student, teacher = top_k.get_student_outputs(model, batch), top_k.get_teacher_outputs(model, batch)
        assert student.shape == (2, 10, vocab) and teacher.shape == (2, 10, vocab)  # Tunix's logits
        switched = top_k.compute_loss(student, teacher, labels(**batch))
    stock = top_k.compute_loss(student, teacher, labels(**batch))
    assert jax.tree.map(float, switched) == jax.tree.map(float, stock)


BF16_EPS = float(jnp.finfo(jnp.bfloat16).eps)


@pytest.mark.slow
def test_the_grpo_and_ppo_losses_of_a_bf16_model_equal_tunix_to_bf16_rounding(tunix):
    """A Qwen2 with bf16 weights and activations: Tunix's GRPO loss (the KL to the reference, off policy, a
    temperature) and PPO loss (an entropy bonus), switched, against stock Tunix's. The two run the same bf16 ops but
    where Tunix rounds its head's logits to bf16 (and, backward, their gradient) and the fused op keeps both in fp32:
    the paths differ by bf16 roundings where the fp32 tests' differ by fp32's, so each value is compared with the
    fp32 tests' counts of roundings (16 for the loss and metrics, 64 for a gradient) in bf16's epsilon."""
    vocab = 257
    model = tiny_qwen2(vocab, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    ppo_config, ppo_example = ppo_loss_inputs(tunix, vocab)
    for loss_name, config, example in (("grpo", grpo_loss_config(tunix), grpo_example(tunix, vocab)),
                                       ("ppo", ppo_config, ppo_example)):
        stock_loss, stock_metrics, stock_grads, stock_program = loss_step(tunix, loss_name, model, example, config)
        with tunix["switch"].use_fused_head():
            loss, metrics, grads, program = loss_step(tunix, loss_name, model, example, config)
        assert vocabulary_softmax(vocab).search(stock_program) and not vocabulary_softmax(vocab).search(program)
        assert_rounding(loss, stock_loss, 16, f"{loss_name} loss", BF16_EPS)
        assert set(metrics) == set(stock_metrics)
        for name in metrics:
            assert_rounding(metrics[name], stock_metrics[name], 16, name, BF16_EPS)
        assert {leaf.dtype for leaf in jax.tree.leaves(grads)} == {jnp.dtype(jnp.bfloat16)}
        assert len(assert_equal_gradients(grads, stock_grads, 64, BF16_EPS)) >= 10
        assert float(jnp.abs(loss - stock_loss)) > 0  # not the same arithmetic: bf16 rounded stock's logits


@pytest.mark.slow
def test_one_peft_step_of_a_bf16_model_equals_tunix_to_bf16_rounding(tunix):
    """Tunix's PeftTrainer (its default loss) on a bf16 Qwen2, one step: the logged metrics, the gradients and the
    updated bf16 parameters equal stock Tunix's, the values by the rounding of bf16 where stock rounds its logits (the
    counts of the fp32 tests in bf16's epsilon: 16 for a metric, 64 for a gradient), each parameter p - lr g by one
    bf16 rounding of it (the update is rounded into it) plus the learning rate lr times its gradient's bound."""
    from logitless.bench.tunix_learners import peft_trainer

    vocab = 257
    make_trainer = lambda: peft_trainer(vocab, model=tiny_qwen2(vocab, dtype=jnp.bfloat16,  # noqa: E731
                                                                param_dtype=jnp.bfloat16))
    stock_logged, stock_grads, stock_params, stock_program = trainer_step(tunix, make_trainer, fused=False)
    logged, grads, params, program = trainer_step(tunix, make_trainer, fused=True)
    assert vocabulary_softmax(vocab).search(stock_program) and not vocabulary_softmax(vocab).search(program)
    assert logged.keys() == stock_logged.keys() and len(logged) >= 2
    for key, values in logged.items():
        assert_rounding(values, stock_logged[key], 16, "/".join(key), BF16_EPS)
    gradients = assert_equal_gradients(grads, stock_grads, 64, BF16_EPS)  # {path: (switched, stock)}
    assert len(gradients) >= 8
    for (path, value), stock_value, (grad_path, (_, stock_grad)) in zip(
            jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(stock_params), gradients.items()):
        assert jax.tree_util.keystr(grad_path).endswith(jax.tree_util.keystr(path)) and value.dtype == jnp.bfloat16
        bound = float(jnp.abs(stock_value).max()) + 1e-2 * 64 * float(jnp.abs(stock_grad).max())
        assert_rounding(value, stock_value, 1, "parameter " + jax.tree_util.keystr(path), BF16_EPS, bound)
