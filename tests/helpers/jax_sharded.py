"""Run by tests/jax/test_jax_sharded.py in a fresh process with four host CPU devices: the fused ops with the vocabulary
(the weight's rows) sharded over a mesh axis, with and without the tokens sharded over another, against the same
step on one device, on meshes whose axes are `AxisType.Explicit` (the layout in the arrays' types) and
`AxisType.Auto` (the layout given by `jax.jit`'s ``in_shardings``, which XLA partitions); and the batch alone sharded
over an Auto mesh. Prints a JSON line: per case, the loss and gradient differences (fp32) and the gradients' scales,
the gradients' shardings, and the collectives and per-device temporaries of the program compiled for bf16 inputs
(where every op runs the two-pass schedule, on one device too)."""

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


def grpo_sequence(hidden, weight, bias, targets, mask, advantages, old_log_probs, ref_log_probs, **_):
    """A GRPO loss whose terms need every token first (sequence-level ratios, the entropy bonus): the per-token
    log-probs and entropies of the two passes, then the objective on them."""
    return fused_grpo_loss(hidden, weight, targets, mask, advantages, bias=bias, old_log_probs=old_log_probs,
                           ref_log_probs=ref_log_probs, beta=0.04, loss_type="sapo",
                           importance_sampling_level="sequence", entropy_coef=0.01)[0]


def jsd(hidden, weight, bias, mask, teacher_hidden, teacher_weight, **_):
    divergence = fused_linear_jsd(hidden, weight, teacher_hidden, teacher_weight, bias_s=bias, beta=0.3, mask=mask)
    return divergence.sum() / mask.sum()


MESHES = {  # name -> (devices, axis sizes, axis names, the token axis or None)
    "vocab over 2": (2, (2,), ("model",), None),
    "vocab over 4": (4, (4,), ("model",), None),
    "tokens over 2, vocab over 2": (4, (2, 2), ("data", "model"), "data"),
}
LOSSES = {  # name -> (loss, the meshes it runs on with explicit axes, and with auto axes)
    "cross_entropy": (cross_entropy, ("vocab over 2", "vocab over 4"),
                      ("vocab over 2", "vocab over 4", "tokens over 2, vocab over 2")),
    "grpo": (grpo, ("vocab over 4",), ("vocab over 4",)),
    "grpo_sequence": (grpo_sequence, ("vocab over 4",), ()),
    "jsd": (jsd, ("tokens over 2, vocab over 2",), ("tokens over 2, vocab over 2",)),
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


def step(loss, in_shardings=None):
    """jit(value_and_grad) in hidden, weight and bias; the GRPO loss reads its ids where the mask keeps them."""
    def value(hidden, weight, bias, arrays):
        arrays = (dict(arrays, targets=jnp.where(arrays["mask"] > 0, arrays["targets"], 0))
                  if loss in (grpo, grpo_sequence) else arrays)
        return loss(hidden, weight, bias, **arrays)

    program = jax.value_and_grad(value, argnums=(0, 1, 2))
    return jax.jit(program) if in_shardings is None else jax.jit(program, in_shardings=in_shardings)


def collectives(compiled) -> dict:
    """The collectives of a compiled program: how many of each, and the largest result of an all-gather."""
    text = compiled.as_text()
    found = {name: len(re.findall(rf"\b{name}(-start)?\(", text)) for name in ("all-gather", "all-reduce")}
    gathered = [int(np.prod([int(d) for d in shape.split(",") if d])) for shape in
                re.findall(r"= \w+\[([\d,]*)\][^=]*\ball-gather(?:-start)?\(", text)]
    return dict(found, largest_gather=max(gathered, default=0))


HEAD_ARRAYS = ("hidden", "weight", "bias", "teacher_hidden", "teacher_weight")  # bf16 in the memory measurement
VOCAB_SHARDED = ("weight", "bias", "teacher_weight")


def spec(name: str, token_axis=None) -> PartitionSpec:
    """Where an input lies: the weights' vocabulary over "model", the rest's first axis over ``token_axis``."""
    return PartitionSpec("model" if name in VOCAB_SHARDED else token_axis)


def in_shardings(arrays: dict, token_axis=None) -> tuple:
    """`jax.jit`'s ``in_shardings`` of a step (hidden, weight, bias, the rest), as `spec` lays the inputs out."""
    rest = {name: spec(name, token_axis) for name in arrays if name not in ("hidden", "weight", "bias")}
    return (*(spec(name, token_axis) for name in ("hidden", "weight", "bias")), rest)


def laid_out(arrays: dict, mesh=None, token_axis=None, bf16: bool = False) -> dict:
    """The inputs placed on ``mesh`` as `spec` says (without a mesh, as given), or with ``bf16`` their shapes only,
    the heads' arrays in bf16 (lowered, never allocated)."""
    def sharding(name):
        return None if mesh is None else NamedSharding(mesh, spec(name, token_axis))

    if bf16:
        return {name: jax.ShapeDtypeStruct(value.shape, jnp.bfloat16 if name in HEAD_ARRAYS else value.dtype,
                                           sharding=sharding(name)) for name, value in arrays.items()}
    return {name: value if mesh is None else jax.device_put(value, sharding(name)) for name, value in arrays.items()}


def run(program, arrays: dict, compile_only: bool = False):
    """program(hidden, weight, bias, the rest): its value and gradients, or compiled only."""
    rest = {name: value for name, value in arrays.items() if name not in ("hidden", "weight", "bias")}
    if compile_only:
        return program.lower(arrays["hidden"], arrays["weight"], arrays["bias"], rest).compile()
    return program(arrays["hidden"], arrays["weight"], arrays["bias"], rest)


def differences(value, grads, expected) -> dict:
    """The loss's and each gradient's largest difference to the one-device ``expected`` (value, gradients)."""
    expected_value, expected_grads = expected
    return {"loss_diff": abs(float(value) - float(expected_value)),
            "grad_diffs": [float(np.abs(np.asarray(g) - np.asarray(e)).max()) for g, e in zip(grads, expected_grads)]}


def sharded(loss, mesh_name: str, axis_type: AxisType, arrays: dict, expected) -> dict:
    """One loss's step on a mesh: with `AxisType.Explicit` axes on arrays placed as `spec` says (the layout in their
    types), with `AxisType.Auto` axes on arrays laid out by `jax.jit`'s ``in_shardings`` (as MaxText and Tunix lay
    out theirs); its differences to the one-device run, and what the program compiled for bf16 inputs holds and
    moves."""
    count, sizes, names, token_axis = MESHES[mesh_name]
    mesh = jax.make_mesh(sizes, names, (axis_type,) * len(sizes), devices=jax.devices()[:count])
    with jax.set_mesh(mesh):
        if axis_type == AxisType.Explicit:
            program = step(loss)
            value, grads = run(program, laid_out(arrays, mesh, token_axis))
            in_bf16 = run(program, laid_out(arrays, mesh, token_axis, bf16=True), compile_only=True)
        else:
            program = step(loss, in_shardings(arrays, token_axis))
            value, grads = run(program, arrays)
            in_bf16 = run(program, laid_out(arrays, bf16=True), compile_only=True)
    return {"shards": count, **differences(value, grads, expected),
            "grad_specs": [str(tuple(g.sharding.spec) + (None,) * (g.ndim - len(g.sharding.spec))) for g in grads],
            "temp_bytes": int(in_bf16.memory_analysis().temp_size_in_bytes), **collectives(in_bf16)}


AXIS_TYPES = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}


def main() -> None:
    devices, arrays = jax.devices(), inputs()
    report, expected = {"devices": len(devices), "cases": {}}, {}
    for loss_name, (loss, *meshes) in LOSSES.items():
        program = step(loss)
        expected[loss_name] = run(program, laid_out(arrays))
        unsharded = run(program, laid_out(arrays, bf16=True), compile_only=True)  # the two-pass schedule in bf16
        report["cases"][loss_name] = {
            "unsharded_temp_bytes": int(unsharded.memory_analysis().temp_size_in_bytes),
            "loss": float(expected[loss_name][0]),
            "grad_scales": [float(np.abs(np.asarray(g)).max()) for g in expected[loss_name][1]],
            **{kind: {mesh_name: sharded(loss, mesh_name, axis_type, arrays, expected[loss_name])
                      for mesh_name in mesh_names}
               for (kind, axis_type), mesh_names in zip(AXIS_TYPES.items(), meshes)}}
    auto = jax.make_mesh((2,), ("batch",), (AxisType.Auto,), devices=devices[:2])  # XLA partitions the op
    batch = {name: jax.device_put(value, NamedSharding(auto, PartitionSpec("batch" if value.shape[0] == B else None)))
             for name, value in arrays.items()}
    with jax.set_mesh(auto):
        value, grads = run(step(grpo), batch)
    report["auto batch over 2"] = {**differences(value, grads, expected["grpo"]),
                                   "grad_hidden_devices": len(grads[0].sharding.device_set)}
    report["auto vocab over 4, GSPMD"] = without_shardy(arrays, expected["cross_entropy"])
    print(json.dumps(report))


def without_shardy(arrays: dict, expected) -> dict:
    """The cross-entropy's step on an Auto mesh, the vocabulary over 4, partitioned by GSPMD instead of Shardy
    (``jax_use_shardy_partitioner=False``), whose propagation asks the op where its results lie."""
    shardy = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", False)
    try:
        mesh = jax.make_mesh((4,), ("model",), (AxisType.Auto,))
        with jax.set_mesh(mesh):
            compiled = run(step(cross_entropy, in_shardings(arrays)), arrays, compile_only=True)
            value, grads = run(compiled, arrays)
    finally:
        jax.config.update("jax_use_shardy_partitioner", shardy)
    return {**differences(value, grads, expected), **collectives(compiled)}


if __name__ == "__main__":
    main()
