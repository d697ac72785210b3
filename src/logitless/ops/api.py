"""The implementations behind every op's ``impl``: a registry of objects whose methods are the steps the public ops
(`fused.py`, `two_heads.py`) are made of, and for each ``impl`` the chain of them to try in order.

The steps, on checked, flat inputs on this rank (a head sharded on the vocabulary as its local shard, or gathered
whole for an implementation with ``whole_vocabulary``):

* ``token_stats(head, hidden (N, H), targets (N,), *, need_entropy, need_mean_log_prob, extras, sizes)``:
  (log_probs, entropy, mean_log_prob, extras by name), (N,) each, the first three differentiable (the entropy and
  mean log-prob zeros unless asked for);
* ``loss(head, hidden, targets, token_loss, *, need_entropy, need_mean_log_prob, sizes, loss_inputs)``: a loss that is
  a sum of per-token terms of those statistics, (loss, log_probs, entropy or None), the statistics without a graph;
* ``kl(head_p, hidden_p, head_q, hidden_q, sizes)``: KL(p || q) (N,); ``jsd(head_s, hidden_s, head_t, hidden_t,
  beta, sizes)``: (the generalized JSD (N,), the student's entropy (N,) without gradient).

An implementation without a step does not run it, and one that does not run a call raises `base.CannotRunHere`: the
next of the chain runs it.

* ``"reference"``: `materialized.Materialized`, the whole (N, V) logits;
* ``"chunked"``: `one_pass.OnePass` (a loss known at forward time, where one pass pays: a CPU, an fp32 weight), then
  `blocks.Blocks`' two passes with the PyTorch block math;
* ``"triton"``: `blocks.Blocks`' two passes with the Triton kernels, on CUDA (or anywhere under ``TRITON_INTERPRET=1``)
  for fp32 block logits;
* ``"auto"``: the Triton kernels first where they run and are wanted (``LOGITLESS_TRITON``: ``auto``, the default, on
  CUDA; ``1`` wherever they can run, which with TRITON_INTERPRET=1 includes the CPU; ``0`` never), and not on a device
  where a kernel failed (`fallback.py`: they then give way to the PyTorch blocks), then "chunked"'s chain.
"""

from __future__ import annotations

import dataclasses
import torch

from logitless._checks import check_impl, switch_setting
from logitless.ops.base import CannotRunHere
from logitless.ops.blocks import Blocks
from logitless.ops.fallback import failed_on
from logitless.ops.materialized import Materialized
from logitless.ops.one_pass import OnePass

CHUNKED, TRITON = Blocks("chunked"), Blocks("triton", triton=True)
IMPLEMENTATIONS = {"reference": (Materialized(),), "chunked": (OnePass(), CHUNKED), "triton": (TRITON,)}


def implementations(impl: str, device: torch.device, dtype: torch.dtype) -> tuple:
    """The chain of implementations that runs an op for ``impl`` on ``device`` with ``dtype`` statistics (see the
    module docstring). A named one that cannot run here is a ValueError naming ``impl``."""
    check_impl(impl)
    if impl != "auto":
        for chosen in IMPLEMENTATIONS[impl]:
            reason = chosen.unusable(device, dtype)
            if reason is not None:
                raise ValueError(f"impl: {reason}")
        return IMPLEMENTATIONS[impl]
    setting = switch_setting("LOGITLESS_TRITON")
    wanted = setting == "1" or (setting == "auto" and device.type == "cuda")
    if wanted and TRITON.unusable(device, dtype) is None and failed_on(device) is None:
        return (dataclasses.replace(TRITON, falls_back=True), *IMPLEMENTATIONS["chunked"])
    return IMPLEMENTATIONS["chunked"]


def first_that_runs(chain: tuple, step: str, *args, **kwargs):
    """The step named ``step`` (``"token_stats"``...) of ``args`` and ``kwargs``, by the first implementation of
    ``chain`` that has it and runs it (raises no `CannotRunHere`)."""
    able = [getattr(chosen, step) for chosen in chain if hasattr(chosen, step)]
    for run in able[:-1]:
        try:
            return run(*args, **kwargs)
        except CannotRunHere:
            continue
    return able[-1](*args, **kwargs)
