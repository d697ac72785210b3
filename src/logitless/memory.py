"""Peak memory of a piece of work, as a user would see it: the one definition every measurement uses (the
benchmarks around a step, GRADE's ``peak_mb`` metric of each step).

CPU: the process's peak resident set (VmHWM), reset just before the work through /proc/self/clear_refs,
minus the resident set at that moment. CUDA: torch.cuda.max_memory_allocated after a reset, minus what was
allocated before. Measurements nest: one that starts inside another first hands the outer one the peak so far,
and hands it its own at the end, so a trainer measuring each of its steps does not hide a step's peak from a
benchmark measuring around it.
"""

from __future__ import annotations

import gc
from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")
_ACTIVE: list[PeakMemory] = []  # the measurements under way, outermost first


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

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.megabytes = float("nan")
        self._start = self._peak = 0

    def _high_water(self) -> int:
        """Bytes: the peak since the last reset."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return _status_kb("VmHWM") * 1024

    def _hand_outward(self, peak: int) -> None:
        for outer in _ACTIVE:
            if outer.device == self.device:
                outer._peak = max(outer._peak, peak)

    def __enter__(self):
        gc.collect()
        synchronize(self.device)
        self._hand_outward(self._high_water())
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        else:
            Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current VmRSS
            self._start = _status_kb("VmRSS") * 1024
        self._peak = self._start
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc):
        synchronize(self.device)
        _ACTIVE.remove(self)
        self._peak = max(self._peak, self._high_water())
        self._hand_outward(self._peak)
        self.megabytes = (self._peak - self._start) / 2**20
        return False
