"""Peak memory of a piece of work, as a user would see it.

CPU: the process's peak resident set (VmHWM), reset just before the work through
/proc/self/clear_refs, minus the resident set at that moment. CUDA: torch.cuda.max_memory_allocated
after a reset, minus what was allocated before.
"""

from __future__ import annotations

import gc
from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")


def _status_kb(field: str) -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not found in {_STATUS}")


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a CUDA GPU); nothing to wait for on a CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PeakMemory:
    """``with PeakMemory(device) as peak: work()`` then ``peak.megabytes``: the peak beyond the start."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.megabytes = float("nan")

    def __enter__(self):
        gc.collect()
        synchronize(self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        else:
            Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current VmRSS
            self._start = _status_kb("VmRSS") * 1024
        return self

    def __exit__(self, *exc):
        synchronize(self.device)
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            peak = _status_kb("VmHWM") * 1024
        self.megabytes = (peak - self._start) / 2**20
        return False
