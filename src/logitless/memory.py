"""Peak memory of a piece of work, as a user would see it: the one definition every measurement uses (the
benchmarks around a step, GRADE's ``peak_mb`` metric of each step).

CPU on Linux: the process's peak resident set (VmHWM), reset just before the work through /proc/self/clear_refs,
minus the resident set at that moment. Where the peak cannot be reset (macOS, or a Linux without clear_refs): the
process's peak resident set since it began (``getrusage``), minus the resident set at the start of the work
(psutil), which is the work's own peak whenever the work reaches the highest point of the process so far, and an
overestimate otherwise; ``PeakMemory.exact`` says which. CUDA: torch.cuda.max_memory_allocated after a reset,
minus what was allocated before. Measurements nest: one that starts inside another first hands the outer one the
peak so far, and hands it its own at the end, so a trainer measuring each of its steps does not hide a step's peak
from a benchmark measuring around it.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")  # writing "5" resets VmHWM to the current VmRSS (Linux)
_ACTIVE: list[PeakMemory] = []  # the measurements under way, outermost first


def _status_kb(field: str) -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not found in {_STATUS}")


def _resettable() -> bool:
    """Whether this process's peak resident set can be reset (Linux's clear_refs)."""
    return _CLEAR_REFS.exists() and _STATUS.exists()


def _process_peak_bytes() -> int:
    """The process's peak resident set since it began, in bytes (getrusage gives kB on Linux, bytes on macOS)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _resident_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a CUDA GPU); nothing to wait for on a CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PeakMemory:
    """``with PeakMemory(device) as peak: work()`` then ``peak.megabytes``: the peak beyond the start. ``exact``: the
    peak is the work's own (False where a CPU's peak cannot be reset: the process's peak since it began)."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.megabytes = float("nan")
        self.exact = self.device.type == "cuda" or _resettable()
        self._start = self._peak = 0

    def _high_water(self) -> int:
        """Bytes: the peak since the last reset (since the process began, where it cannot be reset)."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return _status_kb("VmHWM") * 1024 if self.exact else _process_peak_bytes()

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
        elif self.exact:
            _CLEAR_REFS.write_text("5")  # reset VmHWM to the current VmRSS
            self._start = _status_kb("VmRSS") * 1024
        else:
            self._start = _resident_bytes()
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
