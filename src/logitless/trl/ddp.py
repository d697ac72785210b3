"""DDP's ``find_unused_parameters`` set for the model being trained, as TRL's configs leave it to transformers.

transformers turns it on for any model trained without activation checkpointing, so every DDP launch of such a run
makes an extra pass over the autograd graph per step, and every rank warns "find_unused_parameters=True was
specified in DDP constructor, but did not find any unused parameters". A dense text-only causal LM trained through
the fused head uses every trainable parameter in every step, so for one the flag is off. It stays as transformers
sets it where a step may leave parameters without a gradient: a mixture of experts (an expert no token was routed
to) and a model with a vision tower (a text-only batch), where TRL itself turns it on; and wherever the user set it.
"""

from __future__ import annotations

import inspect

EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")  # config fields of MoEs


def every_parameter_used(model) -> bool:
    """Whether every trainable parameter of ``model`` (a transformers model, a PEFT model around one, or a model's hub
    id or directory, as TRL's trainers take it) takes part in every step: a dense model without a vision tower. A
    model whose config cannot be read counts as no."""
    if isinstance(model, str):
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(model)
        except (OSError, ValueError):
            return False
    else:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        config = getattr(base, "config", None)
        if config is None:
            return False
    values = config.to_dict()
    experts = any(isinstance(values.get(name), int) and values[name] > 1 for name in EXPERT_COUNTS)
    return not experts and "vision_config" not in values


def set_find_unused_parameters(trl_class: type, trainer, args: tuple, kwargs: dict) -> None:
    """Before ``trl_class.__init__(trainer, *args, **kwargs)``: turn its config's ``ddp_find_unused_parameters`` off
    for a model whose every parameter takes part in every step, unless it was set (see the module docstring)."""
    given = inspect.signature(trl_class.__init__).bind_partial(trainer, *args, **kwargs).arguments
    config = given.get("args")
    if getattr(config, "ddp_find_unused_parameters", False) is None and every_parameter_used(given.get("model")):
        config.ddp_find_unused_parameters = False
