"""Wall time of a piece of a training step, the work it queued on a GPU included."""

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
