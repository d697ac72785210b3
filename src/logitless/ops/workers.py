"""Threads that share out the vocabulary blocks of a CPU op's row chunk: the one-pass schedule's parallelism.

A CPU op made of many block-sized steps (a block's matmul, then a few elementwise passes over it) would run
each step as its own parallel region of PyTorch's intra-op threads: thousands of regions per op, each ending in
a barrier. On a busy machine, where another process holds a core, every region waits at its barrier for the
thread that was descheduled (a scheduler time slice at a time), and the op's time grows several-fold while one
large matmul's barely grows. Here the blocks are tasks instead: each of ``torch.get_num_threads()`` worker
threads runs whole blocks with a single intra-op thread (no region, no barrier inside a block) and takes the
next block as soon as it is done, so a thread that gets less of the CPU simply does fewer blocks.

Each worker runs without gradient recording (the op computes its gradients itself). The workers start once per
thread count (the pool is kept) and again in a forked child. `block_workers` gives None where they would not
pay or not apply: one thread, a device other than the CPU, an autocast region (whose state is the caller
thread's), or a call from inside a worker.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

import torch

_POOLS: dict[int, ThreadPoolExecutor] = {}  # thread count -> its workers
_LOCAL = threading.local()  # .worker: this thread is one of the workers


def _single_threaded() -> None:
    """A worker's setup: one intra-op thread, no gradient recording."""
    torch.get_num_threads()  # the thread's own lazy setup first, which would otherwise overwrite the count below
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    _LOCAL.worker = True


def _pool(count: int) -> ThreadPoolExecutor:
    pool = _POOLS.get(count)
    if pool is None:
        pool = ThreadPoolExecutor(count, thread_name_prefix="logitless-blocks", initializer=_single_threaded)
        started = threading.Barrier(count)
        for task in [pool.submit(started.wait) for _ in range(count)]:  # every worker started and set up
            task.result()
        torch.set_num_threads(count)  # the count new threads start with, which each worker's setup changed
        _POOLS[count] = pool
    return pool


os.register_at_fork(after_in_child=_POOLS.clear)  # a forked child has none of its parent's threads


class BlockWorkers:
    """``map(fn, items)``: ``fn`` over ``items`` on the workers, each item taken by the first idle one; the
    results in the items' order."""

    def __init__(self, pool: ThreadPoolExecutor):
        self.pool = pool

    def map(self, fn: Callable, items: Iterable) -> list:
        return list(self.pool.map(fn, items))


def block_workers(device: torch.device, num_blocks: int) -> BlockWorkers | None:
    """The workers for an op of ``num_blocks`` vocabulary blocks per row chunk on ``device``, called from this
    thread; None where the blocks should run one after another in this thread."""
    count = torch.get_num_threads()
    if (device.type != "cpu" or count < 2 or num_blocks < 2 or getattr(_LOCAL, "worker", False)
            or torch.is_autocast_enabled("cpu")):
        return None
    return BlockWorkers(_pool(count))
