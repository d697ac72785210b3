"""Run by tests/test_jax_sharded.py in a fresh process with four host CPU devices: the fused ops with the vocabulary
(the weight's rows) sharded over a mesh axis, with and without the tokens sharded over another, against the same
step on one device; and the batch sharded over an `AxisType.Auto` mesh, which XLA partitions. Prints a JSON line:
per case, the loss and gradient differences, the gradients' shardings, the collectives of the compiled program
and its per-device temporaries."""

import os
import re

# must precede the first jax import: the host platform's device count is fixed when the backend starts
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import json  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec  # noqa: E402

from logitless.jax import fused_grpo_loss, fused_linear_cross_entropy, fused_linear_jsd  # noqa: E402

B, T, H, V = 4, 8, 16, 16384  # the default blocks of 2048 columns: 8 vocabulary blocks on one device


def cross_entropy(hidden, weight, bias, targets, **_):
    return fused_linear_cross_entropy(hidden, weight, targets, bias=bias, label_smoothing=0.1, temperature=0.9)


def grpo(hidden, weight, bias, targets, mask, advantages, old_log_probs, ref_log_probs, **_):
    return fused_grpo_loss(hidden, weight, targets, mask, advantages, bias=bias, old_log_probs=old_log_probs,
                           ref_log_probs=ref_log_probs, beta=0.04, softcap=5.0)[0]


def jsd(hidden, weight, bias, mask, teacher_hidden, teacher_weight, **_):
    divergence = fused_linear_jsd(hidden, weight, teacher_hidden, teacher_weight, bias_s=bias, beta=0.3, mask=mask)
    return divergence.sum() / mask.sum()


LOSSES = {"cross_entropy": cross_entropy, "grpo": grpo, "jsd": jsd}
MESHES = {  # name -> (devices, axis sizes, axis names, the token axis or None)
    "vocab over 2": (2, (2,), ("model",), None),
    "vocab over 4": (4, (4,), ("model",), None),
    "tokens over 2, vocab over 2": (4, (2, 2), ("data", "model"), "data"),
}


def inputs() -> dict:
    rng = np.random.default_rng(0)
    mask = np.ones((B, T), np.float32)
    mask[1, 5:] = 0
    targets = rng.integers(0, V, (B, T)).astype(np.int32)
    return dict(hidden=rng.standard_normal((B, T, H)).astype(np.float32),
                weight=(rng.standard_normal((V, H)) * 0.3).astype(np.float32),
                bias=(rng.standard_normal(V) * 0.1).astype(np.float32),
                targets=np.where(mask > 0, targets, -100), mask=mask,
                advantages=rng.standard_normal(B).astype(np.float32),
                old_log_probs=(rng.standard_normal((B, T)) * 0.2 - 9.8).astype(np.float32),
                ref_log_probs=(rng.standard_normal((B, T)) * 0.2 - 9.8).astype(np.float32),
                teacher_hidden=rng.standard_normal((B, T, 2 * H)).astype(np.float32),
                teacher_weight=(rng.standard_normal((V, 2 * H)) * 0.3).astype(np.float32))


def step(loss):
    """jit(value_and_grad) in hidden, weight and bias; the GRPO loss reads its ids where the mask keeps them."""
    def value(hidden, weight, bias, arrays):
        arrays = dict(arrays, targets=jnp.where(arrays["mask"] > 0, arrays["targets"], 0)) if loss is grpo else arrays
        return loss(hidden, weight, bias, **arrays)

    return jax.jit(jax.value_and_grad(value, argnums=(0, 1, 2)))


def collectives(compiled) -> dict:
    """The collectives of a compiled program: how many of each, and the largest result of an all-gather."""
    text = compiled.as_text()
    found = {name: len(re.findall(rf"\b{name}(-start)?\(", text)) for name in ("all-gather", "all-reduce")}
    gathered = [int(np.prod([int(d) for d in shape.split(",") if d])) for shape in
                re.findall(r"= \w+\[([\d,]*)\][^=]*\ball-gather(?:-start)?\(", text)]
    return dict(found, largest_gather=max(gathered, default=0))


def main() -> None:
    devices, arrays = jax.devices(), inputs()
    report = {"devices": len(devices), "cases": {}}
    for loss_name, loss in LOSSES.items():
        one = {name: jax.device_put(value, devices[0]) for name, value in arrays.items()}
        program = step(loss)
        expected_loss, expected_grads = program(one.pop("hidden"), one.pop("weight"), one.pop("bias"), one)
        unsharded = program.lower(arrays["hidden"], arrays["weight"], arrays["bias"],
                                  {k: v for k, v in arrays.items() if k not in ("hidden", "weight", "bias")}).compile()
        report["cases"][loss_name] = {"unsharded_temp_bytes": int(unsharded.memory_analysis().temp_size_in_bytes),
                                      "grad_scales": [float(np.abs(np.asarray(g)).max()) for g in expected_grads]}
        for mesh_name, (count, sizes, names, token_axis) in MESHES.items():
            mesh = jax.make_mesh(sizes, names, (AxisType.Explicit,) * len(sizes), devices=devices[:count])

            def put(value, spec):
                return jax.device_put(value, NamedSharding(mesh, spec))

            tokens = PartitionSpec(token_axis)
            sharded = {name: put(value, tokens) for name, value in arrays.items()
                       if name not in ("weight", "bias", "teacher_weight", "advantages")}
            sharded.update(weight=put(arrays["weight"], PartitionSpec("model")),
                           bias=put(arrays["bias"], PartitionSpec("model")),
                           teacher_weight=put(arrays["teacher_weight"], PartitionSpec("model")),
                           advantages=put(arrays["advantages"], tokens))
            with jax.set_mesh(mesh):
                hidden, weight, bias = (sharded.pop(name) for name in ("hidden", "weight", "bias"))
                value, grads = program(hidden, weight, bias, sharded)
                compiled = program.lower(hidden, weight, bias, sharded).compile()
            report["cases"][loss_name][mesh_name] = {
                "shards": count, "loss_diff": abs(float(value) - float(expected_loss)),
                "grad_diffs": [float(np.abs(np.asarray(g) - np.asarray(e)).max()) for g, e in zip(grads, expected_grads)],
                "grad_specs": [str(tuple(g.sharding.spec)) for g in grads],
                "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes), **collectives(compiled)}
    auto = jax.make_mesh((2,), ("batch",), (AxisType.Auto,), devices=devices[:2])  # XLA partitions the op itself
    batch = {name: jax.device_put(value, NamedSharding(auto, PartitionSpec("batch" if value.shape[0] == B else None)))
             for name, value in arrays.items()}
    with jax.set_mesh(auto):
        value, grads = step(grpo)(batch.pop("hidden"), batch.pop("weight"), batch.pop("bias"), batch)
    one = {name: jax.device_put(value, devices[0]) for name, value in arrays.items()}
    expected_loss, expected_grads = step(grpo)(one.pop("hidden"), one.pop("weight"), one.pop("bias"), one)
    report["auto batch over 2"] = {"loss_diff": abs(float(value) - float(expected_loss)),
                                   "grad_diffs": [float(np.abs(np.asarray(g) - np.asarray(e)).max())
                                                  for g, e in zip(grads, expected_grads)],
                                   "grad_hidden_devices": len(grads[0].sharding.device_set)}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
