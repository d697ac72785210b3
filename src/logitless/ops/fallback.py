"""Triton kernels that give way to the PyTorch block math when they cannot run on the user's GPU.

A kernel is compiled the first time it is launched, on the user's machine: an architecture, a driver or a Triton
release the kernels were not built for can refuse it (a compile error, a tile that needs more shared memory than
the chip has, a launch the driver rejects). When "auto" chose the Triton kernels, `FallingBack` runs each block
function's PyTorch twin instead, for that call and, on that device, every later one (`implementation` then picks
the PyTorch blocks there), and says so once, naming the kernel, the device and the compiler's message. Both compute
the same block math, so the run goes on with the same numbers. ``impl="triton"``, asked for by name, gets the
kernels alone and their error.
"""

from __future__ import annotations

import logging
from types import ModuleType, SimpleNamespace

import torch

logger = logging.getLogger(__name__)
_FAILED: dict[str, str] = {}  # device -> the failure that turned the Triton kernels off there


def failed_on(device: torch.device) -> str | None:
    """Why the Triton kernels were turned off on ``device`` (None while they run)."""
    return _FAILED.get(str(device))


def _is_kernel_failure(error: Exception) -> bool:
    """A failure to compile or launch a kernel (Triton's own errors, the driver's RuntimeError), not a wrong argument
    of ours (ValueError, TypeError), which must surface."""
    return type(error).__module__.startswith("triton") or type(error) is RuntimeError


class FallingBack:
    """The block functions of ``triton_kernels``, each of which runs its twin in ``pytorch`` (the ``PYTORCH_BLOCKS``
    of an accumulator module: the same names and signatures) once a kernel has failed on the device of its first
    tensor argument."""

    def __init__(self, triton_kernels: ModuleType, pytorch: SimpleNamespace):
        self._triton, self._pytorch = triton_kernels, pytorch

    def __getattr__(self, name: str):
        kernel, twin = getattr(self._triton, name), getattr(self._pytorch, name)

        def run(*args, **kwargs):
            device = next(str(arg.device) for arg in (*args, *kwargs.values()) if isinstance(arg, torch.Tensor))
            if device in _FAILED:
                return twin(*args, **kwargs)
            try:
                return kernel(*args, **kwargs)
            except Exception as error:  # sorted by _is_kernel_failure: the rest is raised again
                if not _is_kernel_failure(error):
                    raise
                message = " ".join(str(error).split())[:500]
                _FAILED[device] = f"the Triton kernel of {name} failed on {device}: {type(error).__name__}: {message}"
                logger.warning(f"logitless: {_FAILED[device]}; the PyTorch block math runs instead, for this call "
                               "and every later one on this device (impl='triton' would raise)")
            return twin(*args, **kwargs)

        return run
