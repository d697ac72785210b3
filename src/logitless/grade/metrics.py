"""Per-step metrics of the GRADE trainers and the GRPO baseline: stable names, null where a method has none."""

from __future__ import annotations

import resource

import torch

# Every step of every method logs exactly these keys (None where a quantity does not apply).
METRIC_NAMES = ("step", "reward", "kl", "loss", "grad_norm", "tau", "topk_tail_mass", "max_soft_weight", "step_s",
                "peak_mb", "skipped")  # skipped: the step's loss or gradient was not finite (on_nonfinite="skip")


def peak_mb(device: torch.device) -> float:
    """The process's peak memory so far, MB: CUDA max_memory_allocated, else the peak resident set (ru_maxrss).

    Never reset here, so a benchmark measuring around the trainer is not disturbed.
    """
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KB


def step_metrics(**values) -> dict:
    """A metrics row with every name in METRIC_NAMES (missing ones None); rejects unknown names."""
    unknown = set(values) - set(METRIC_NAMES)
    if unknown:
        raise KeyError(f"unknown metric names {sorted(unknown)}")
    return {name: values.get(name) for name in METRIC_NAMES}
