"""`logitless.memory.PeakMemory`, the one measurement of peak memory: what the benchmarks measure around a step
and what GRADE logs as each step's ``peak_mb``."""

import re
import subprocess
import sys
from pathlib import Path

import torch

from logitless.memory import PeakMemory

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "logitless"


def _allocate(megabytes: int) -> None:
    """Hold ``megabytes`` resident for a moment: above glibc's largest mmap threshold (32 MB), so the block is
    fresh memory from the system whatever the process freed before, and the resident set grows by it."""
    block = torch.ones(megabytes * 2**20 // 4)
    block += 1


NESTED = """
import torch
from logitless.memory import PeakMemory

def allocate(megabytes):
    block = torch.ones(megabytes * 2**20 // 4)
    block += 1

with PeakMemory("cpu") as outer:
    allocate(192)
    with PeakMemory("cpu") as inner:
        allocate(64)
print(inner.megabytes, outer.megabytes)
"""


def test_a_measurement_sees_its_own_peak_and_hands_it_to_the_one_around_it():
    """In a fresh process, whose allocator has no freed memory to hand back instead of fresh pages (a long test
    session's may)."""
    done = subprocess.run([sys.executable, "-c", NESTED], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    inner, outer = map(float, done.stdout.split())
    assert 60 < inner < 120
    assert outer > 180  # the inner measurement's reset did not hide the 192 MB from the outer one


WITHOUT_PROC = """
import torch
from pathlib import Path
from logitless import memory

memory._CLEAR_REFS = Path("/no/such/clear_refs")  # as on macOS: the peak cannot be reset
with memory.PeakMemory("cpu") as peak:
    block = torch.ones(256 * 2**20 // 4)
    block += 1
print(peak.exact, peak.megabytes)
"""


def test_where_the_peak_cannot_be_reset_it_is_the_processs_peak_beyond_the_start():
    """`make demo` (GRADE logs each step's peak) failed off Linux, where /proc/self/clear_refs does not exist: there
    the process's peak since it began is measured (getrusage), beyond the resident set at the start: at least the
    work's own 256 MB, and more where the process was higher before (on Linux a child's getrusage counts its
    parent's resident set at the fork), which the measurement says by not being exact."""
    done = subprocess.run([sys.executable, "-c", WITHOUT_PROC], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    exact, megabytes = done.stdout.split()
    assert exact == "False" and float(megabytes) > 240, done.stdout


def test_each_grade_step_logs_its_own_peak():
    """A step's ``peak_mb`` is that step's: a later, smaller step does not report an earlier step's peak."""
    from grade_helpers import ByteTokenizer, byte_model
    from logitless.grade import GradeConfig, GumbelTrainerMemoryEfficient, TokenSetReward

    config = GradeConfig(max_new_tokens=2, batch_size=2, gumbel_topk=4)
    trainer = GumbelTrainerMemoryEfficient(byte_model(), TokenSetReward([97, 98]), config, tokenizer=ByteTokenizer())
    microbatch = trainer.microbatch

    def heavy_first_step(*args, **kwargs):
        if trainer.step == 0:
            _allocate(256)
        return microbatch(*args, **kwargs)

    trainer.microbatch = heavy_first_step
    with PeakMemory("cpu") as around:
        first, second = (trainer.train_step(["ab", "cd"])["peak_mb"] for _ in range(2))
    assert first > 250 > 100 > second
    assert around.megabytes > 250


def test_no_other_module_measures_peak_memory_its_own_way():
    counters = re.compile(r"ru_maxrss|VmHWM|max_memory_allocated|reset_peak_memory_stats")
    found = sorted(str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
                   if counters.search(path.read_text()))
    assert found == ["memory.py"]
