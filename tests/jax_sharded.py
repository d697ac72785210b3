"""Run by tests/test_jax_sharded.py in a fresh process with two host CPU devices: `fused_grpo_loss` with the
batch sharded over both devices, against the same step on one device. Prints a JSON line of the differences."""

import os

# must precede the first jax import: the host platform's device count is fixed when the backend starts
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"

import json  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec  # noqa: E402

from logitless.jax import BlockSizes, fused_grpo_loss  # noqa: E402

B, T, H, V = 4, 6, 8, 37


def step(hidden, weight, completion_ids, completion_mask, advantages, old_logprobs, ref_logprobs):
    def loss(hidden, weight):
        return fused_grpo_loss(hidden, weight, completion_ids, completion_mask, advantages, old_logprobs=old_logprobs,
                               ref_logprobs=ref_logprobs, beta=0.04, loss_type="grpo",
                               block_sizes=BlockSizes(vocab=8, tokens=5))

    return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(hidden, weight)


def main() -> None:
    rng = np.random.default_rng(0)
    mask = np.ones((B, T), np.float32)
    mask[1, 4:] = 0
    inputs = dict(hidden=rng.standard_normal((B, T, H)).astype(np.float32),
                  weight=(rng.standard_normal((V, H)) * 0.3).astype(np.float32),
                  completion_ids=rng.integers(0, V, (B, T)).astype(np.int32), completion_mask=mask,
                  advantages=rng.standard_normal(B).astype(np.float32),
                  old_logprobs=(rng.standard_normal((B, T)) * 0.2 - 3.6).astype(np.float32),
                  ref_logprobs=(rng.standard_normal((B, T)) * 0.2 - 3.6).astype(np.float32))
    devices = jax.devices()
    single = {name: jax.device_put(value, devices[0]) for name, value in inputs.items()}
    (loss_1, metrics_1), grads_1 = jax.jit(step)(**single)
    report = {"devices": len(devices), "loss": float(loss_1),
              "grad_scales": [float(np.abs(np.asarray(g1)).max()) for g1 in grads_1]}
    for axis_type in (AxisType.Auto, AxisType.Explicit):  # GSPMD partitions the op / shard_map per shard
        mesh = jax.make_mesh((2,), ("batch",), (axis_type,), devices=devices)
        batch_sharded, replicated = NamedSharding(mesh, PartitionSpec("batch")), NamedSharding(mesh, PartitionSpec())
        sharded = {name: jax.device_put(value, replicated if name == "weight" else batch_sharded)
                   for name, value in inputs.items()}
        with jax.set_mesh(mesh):
            (loss, metrics), grads = jax.jit(step)(**sharded)
        report[str(axis_type)] = {
            "hidden_shards": len(sharded["hidden"].addressable_shards),
            "grad_hidden_devices": len(grads[0].sharding.device_set),
            "loss_diff": abs(float(loss) - float(loss_1)),
            "grad_diffs": [float(np.abs(np.asarray(g) - np.asarray(g1)).max()) for g, g1 in zip(grads, grads_1)],
            "metric_diffs": {k: abs(float(metrics[k]) - float(metrics_1[k])) for k in metrics}}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
