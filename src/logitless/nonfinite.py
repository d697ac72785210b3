"""Refusing poison: a training step whose loss or gradient is NaN or infinite is never applied.

`check_step` runs after backward and before the optimizer step. With ``policy="stop"`` (the
default) it raises `NonFiniteError`, so the run ends before the bad update and before any save;
with ``policy="skip"`` the step's gradients are dropped and the optimizer leaves the weights alone.
`logitless.trl.NonFiniteGuard` does the same inside a Hugging Face Trainer (TRL's trainers included).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from logitless._checks import check_choice

if TYPE_CHECKING:
    import torch

POLICIES = ("stop", "skip")


class NonFiniteError(RuntimeError):
    """A loss or gradient was NaN or infinite; the step was not applied and nothing was saved."""


def nonfinite_reason(model: torch.nn.Module, losses: Iterable[float] = ()) -> str | None:
    """What is not finite ("the loss is nan", "the gradient of lm_head.weight has nan or inf"), or None."""
    import torch

    for loss in losses:
        if not torch.isfinite(torch.as_tensor(loss)):
            return f"the loss is {float(loss)}"
    named = [(name, p.grad) for name, p in model.named_parameters() if p.grad is not None]
    if named and not bool(torch.stack([torch.isfinite(grad).all() for _, grad in named]).all()):
        name = next(name for name, grad in named if not bool(torch.isfinite(grad).all()))
        return f"the gradient of {name} has nan or inf"
    return None


def check_step(step: int, model: torch.nn.Module, losses: Iterable[float] = (), *, policy: str = "stop",
               advice: str = "") -> bool:
    """True when step ``step`` (1-based) may be applied; False when it must be skipped (its gradients are
    dropped); raises `NonFiniteError` under ``policy="stop"``. ``advice`` ends the error message."""
    check_choice("policy", policy, POLICIES)
    reason = nonfinite_reason(model, losses)
    if reason is None:
        return True
    if policy == "stop":
        raise NonFiniteError(f"step {step}: {reason}; stopped before the optimizer step, so nothing of this step "
                             f"was applied or saved. {advice}".strip())
    for parameter in model.parameters():
        parameter.grad = None  # torch optimizers leave a parameter without a gradient alone
    return False
