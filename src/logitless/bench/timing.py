"""Wall time of a training step or a piece of one, the work it queued on a GPU included."""

from __future__ import annotations

import time


def timed(function, seconds: list[float], device):
    """``function`` that adds its wall time to ``seconds[0]``, the work it queued on ``device`` included."""
    from logitless.memory import synchronize

    def timed_call(*args, **kwargs):
        synchronize(device)
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            synchronize(device)
            seconds[0] += time.perf_counter() - started
    return timed_call


def step_seconds(step, device) -> float:
    """Wall time of ``step()``: between two CUDA events on a GPU (the time of the work it queued there), else between
    two readings of the clock."""
    if device.type == "cuda":
        import torch

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000
    started = time.perf_counter()
    step()
    return time.perf_counter() - started
