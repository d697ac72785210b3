"""Run by tests/jax/test_tunix_sharded.py in a fresh process with four host CPU devices: a tiny Tunix Qwen2 (tied and
untied head) laid out by its own sharding config on a mesh of Tunix's axes, fsdp x tp = 2 x 2 (`AxisType.Auto`, the
vocabulary over tp), and Tunix's scoring and GRPO loss called under ``with mesh:`` as Tunix's ``RLCluster`` and
trainers call them, stock against switched; and one step of Tunix's own GRPOLearner with every ``RLCluster`` role on
that mesh. Prints a JSON line: per head, the largest differences to stock in fp32 roundings of the largest value
expected, the head weight's gradient's sharding, and for each program (the scoring, the GRPO step) stock and switched,
what `program_report` reads: the logits, the collectives and what they gather, the arrays as large as the whole weight,
the per-device temporaries; for the learner step, `learner_report`'s."""

import os
import re

# must precede the first jax import: the host platform's device count is fixed when the backend starts
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import contextlib  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec  # noqa: E402
from tunix.rl import algo_core, common  # noqa: E402
from tunix.rl.grpo import grpo_learner  # noqa: E402

import logitless.tunix as switch  # noqa: E402
from logitless.bench.xla_memory import memory_of  # noqa: E402
from logitless.bench.tunix_learners import (EOS, PAD, grpo_loss_step, rl_learner_step, tiny_qwen2,  # noqa: E402
                                            token_batch)

warnings.simplefilter("ignore", DeprecationWarning)  # Tunix enters its meshes with ``with mesh:``, which JAX deprecates
V, H = 4096, 32  # the vocabulary (two of the default blocks per device over tp = 2), the hidden size
EPS = float(np.finfo(np.float32).eps)
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


def tunix_mesh():
    """Tunix's mesh axes, as its examples and CLI make them: fsdp x tp over the four devices, axes Auto."""
    return jax.make_mesh((2, 2), ("fsdp", "tp"), (AxisType.Auto, AxisType.Auto))


def sharded_model(mesh, tied: bool):
    """The tiny Qwen2 laid out as Tunix lays out a model on its mesh (`RLCluster`'s loading of a model, the
    examples'): each parameter's partition spec from the config's ``shd_config`` (`nnx.get_partition_spec`), placed
    by `jax.device_put`. Returns (graphdef, state)."""
    with mesh:
        graphdef, state = nnx.split(tiny_qwen2(V, tied))
        shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec or PartitionSpec()),
                                 nnx.get_partition_spec(state))
        return graphdef, jax.device_put(state, shardings)


def head_weight(state, tied: bool):
    """The head's weight as stored: the tied embedding (V, H) or ``lm_head``'s (H, V)."""
    return state["embedder"]["input_embedding"] if tied else state["lm_head"]["w"]


def roundings(got, expected) -> float:
    """The largest difference, in fp32 roundings of the largest value expected."""
    got, expected = (np.asarray(value, np.float64) for value in (got, expected))
    return float(np.abs(got - expected).max()) / (EPS * max(float(np.abs(expected).max()), 1e-30))


BYTES = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "pred": 1}


def program_report(lowered, compiled) -> dict:
    """What a program holds and moves per device: whether its lowered program (global shapes) holds the logits
    (B, P + C, V) or (B, C, V); in the compiled one (each device's shapes), each collective's count and the bytes of
    its results, the shapes the all-gathers make, the arrays with a whole vocabulary axis and at least V x H
    elements (the whole weight, or more), and the temporaries."""
    logits = re.findall(rf"tensor<4x(?:11|5)x{V}xf32>", lowered.as_text())
    text = compiled.as_text()
    moved = {name: [0, 0] for name in COLLECTIVES}  # name -> [count, bytes]
    for result, name in re.findall(rf"= (.*?) \b({'|'.join(COLLECTIVES)})(?:-start)?\(", text):
        moved[name][0] += 1
        moved[name][1] += sum(BYTES.get(dtype, 4) * int(np.prod([int(d) for d in dims.split(",") if d]))
                              for dtype, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", result))
    shapes = [[int(d) for d in dims.split(",") if d] for dims in re.findall(r"\b[a-z]+\d*\[([\d,]*)\]", text)]
    return {"logits": sorted(set(logits)), "collectives": moved,
            "gathered": sorted(set(re.findall(r"= (\w+\[[\d,]*\])\S* all-gather(?:-start)?\(", text))),
            "whole_weight_arrays": sum(1 for shape in shapes if V in shape and np.prod(shape) >= V * H),
            "temp_bytes": memory_of(compiled)["temp_size_in_bytes"]}


def scoring(graphdef, state, prompt_ids, completion_ids) -> tuple:
    """Tunix's ``compute_per_token_logps`` (whichever the switch puts there) at temperature 0.7, with the entropy
    its losses take: (log-probs, entropy, what its program holds and moves)."""
    arguments = dict(pad_id=PAD, eos_id=EOS, temperature=0.7, return_logits=True)
    lowered = common.compute_per_token_logps.lower(graphdef, state, prompt_ids, completion_ids, **arguments)
    compiled = lowered.compile()
    log_probs, logits = compiled(graphdef, state, prompt_ids, completion_ids)
    return log_probs, algo_core.compute_entropy_from_logits(logits), program_report(lowered, compiled)


def grpo_step(graphdef, state, example, config) -> tuple:
    """The value and gradient of Tunix's GRPO loss, jitted as its trainer jits its step (the parameters' shardings
    carried by the arrays): (loss, gradients, what its program holds and moves)."""
    step, _ = grpo_loss_step(nnx.merge(graphdef, state), example, config)
    lowered = step.lower(state)
    compiled = lowered.compile()
    (loss, _), grads = compiled(state)
    return loss, grads, program_report(lowered, compiled)


def run_head(mesh, tied: bool) -> dict:
    graphdef, state = sharded_model(mesh, tied)
    batch = NamedSharding(mesh, PartitionSpec("fsdp"))  # Tunix's data_sharding_axis
    prompt_ids, completion_ids = (jax.device_put(ids, batch) for ids in token_batch(V))
    rng = np.random.default_rng(1)
    near = lambda: jax.device_put(jnp.asarray(-rng.uniform(0.5, 9.0, completion_ids.shape), jnp.float32), batch)  # noqa: E731
    example = grpo_learner.TrainExample(
        prompt_ids=prompt_ids, prompt_mask=prompt_ids != PAD, completion_ids=completion_ids,
        completion_mask=completion_ids != PAD, advantages=jax.device_put(jnp.asarray(rng.standard_normal(4),
                                                                                     jnp.float32), batch),
        ref_per_token_logps=near(), old_per_token_logps=near())
    config = grpo_learner.GRPOConfig(num_generations=2, beta=0.04, epsilon=0.1)
    config.temperature = 0.8  # the learner sets it from the rollout's

    runs = {}
    for name, head in (("stock", contextlib.nullcontext), ("switched", switch.use_fused_head)):
        with head(), mesh:  # the mesh entered as Tunix's RLCluster enters a role's
            runs[name] = (*scoring(graphdef, state, prompt_ids, completion_ids),
                          *grpo_step(graphdef, state, example, config))
    (stock_lp, stock_entropy, stock_scoring, stock_loss, stock_grads, stock_step) = runs["stock"]
    (log_probs, entropy, scoring_program, loss, grads, step_program) = runs["switched"]
    flat, stock_flat = (dict(jax.tree_util.tree_leaves_with_path(g)) for g in (grads, stock_grads))
    weight_grad = head_weight(grads, tied)
    return {
        "weight_spec": str(head_weight(state, tied).sharding.spec),
        "weight_grad_spec": str(weight_grad.sharding.spec), "stock_weight_grad_spec":
            str(head_weight(stock_grads, tied).sharding.spec),
        "log_probs": roundings(log_probs, stock_lp), "entropy": roundings(entropy, stock_entropy),
        "loss": roundings(loss, stock_loss),
        "grads": {jax.tree_util.keystr(path): roundings(grad, stock_flat[path]) for path, grad in flat.items()},
        "zero_grads": [jax.tree_util.keystr(path) for path, grad in stock_flat.items() if not np.abs(grad).max()],
        "programs": {"scoring": {"stock": stock_scoring, "switched": scoring_program},
                     "grpo_step": {"stock": stock_step, "switched": step_program}}}


def learner_report(mesh) -> dict:
    """One step of Tunix's own GRPOLearner with every ``RLCluster`` role on ``mesh`` (`rl_learner_step`: the policy
    and the reference of V tokens laid out by ``RLCluster`` from their ``shd_config``, the vanilla rollout), stock
    against switched: the largest differences to stock, in fp32 roundings, of each logged metric, gradient and updated
    parameter; the head's weight's and its gradient's shardings after the step; whether each step moved the
    parameters, how often the fused op was traced, and the seconds both steps took."""
    started = time.perf_counter()
    stock, switched = (rl_learner_step("grpo", mesh, fused, V) for fused in (False, True))
    differences = {}
    for name in ("grads", "params"):
        expected = dict(jax.tree_util.tree_leaves_with_path(getattr(stock, name)))
        differences[name] = {jax.tree_util.keystr(path): roundings(value, expected[path])
                             for path, value in jax.tree_util.tree_leaves_with_path(getattr(switched, name))}
    return {"logged": {"/".join(key): roundings(values, stock.logged[key]) for key, values in switched.logged.items()},
            "stock_logged": sorted("/".join(key) for key in stock.logged), **differences,
            "weight_spec": str(head_weight(switched.params, tied=False).sharding.spec),
            "weight_grad_spec": str(head_weight(switched.grads, tied=False).sharding.spec),
            "moved": [stock.moved, switched.moved], "fused_calls": [stock.fused_calls, switched.fused_calls],
            "seconds": time.perf_counter() - started}


def main():
    started = time.perf_counter()
    mesh = tunix_mesh()
    report = {"devices": len(jax.devices()), "mesh": dict(mesh.shape),
              "heads": {("tied" if tied else "lm_head"): run_head(mesh, tied) for tied in (False, True)},
              "grpo_learner": learner_report(mesh)}
    report["seconds"] = time.perf_counter() - started
    print(json.dumps(report))


if __name__ == "__main__":
    main()
