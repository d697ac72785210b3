"""Per-step metrics of the GRADE trainers and the GRPO baseline: stable names, null where a method has none."""

from __future__ import annotations

# Every step of every method logs exactly these keys (None where a quantity does not apply).
METRIC_NAMES = ("step", "reward", "kl", "loss", "grad_norm", "tau", "topk_tail_mass", "max_soft_weight", "step_s",
                "peak_mb", "skipped")  # skipped: the step's loss or gradient was not finite (on_nonfinite="skip")
# peak_mb: the step's peak memory beyond what the process held when it started (`logitless.memory.PeakMemory`)


def step_metrics(**values) -> dict:
    """A metrics row with every name in METRIC_NAMES (missing ones None); rejects unknown names."""
    unknown = set(values) - set(METRIC_NAMES)
    if unknown:
        raise KeyError(f"unknown metric names {sorted(unknown)}")
    return {name: values.get(name) for name in METRIC_NAMES}
