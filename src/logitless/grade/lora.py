"""Optional LoRA (through peft): train low-rank adapters on the policy's linear layers instead of every weight."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch


def with_lora(model, rank: int, alpha: float, target_modules, seed: int):
    """``model`` wrapped by peft with LoRA adapters of ``rank`` (the only trainable parameters), initialized
    from ``seed`` (not from the global random state, so a run is reproducible)."""
    try:
        from peft import LoraConfig, get_peft_model
        from peft.utils.error import PeftError
    except ImportError:
        raise ValueError("lora_rank: LoRA needs the peft package (pip install peft), or lora_rank 0") from None
    settings = LoraConfig(r=rank, lora_alpha=alpha, target_modules=target_modules, lora_dropout=0.0,
                          task_type="CAUSAL_LM")
    with warnings.catch_warnings(), torch.random.fork_rng(devices=[]):
        # peft reads a transformers attribute that transformers 5 deprecates
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        torch.manual_seed(seed)
        try:
            return get_peft_model(model, settings)
        except PeftError as err:  # no module matches target_modules
            linear = sorted({name.rpartition(".")[2] for name, module in model.named_modules()
                             if isinstance(module, torch.nn.Linear)})
            raise ValueError(f"lora_target_modules: {str(err).strip().splitlines()[0]} (this model's linear "
                             f"modules: {', '.join(linear)}; a string is a regular expression for the full "
                             f"module name)") from None


def base_of(model):
    """The Hugging Face model under a peft wrapper (its layers carry the adapters), or the model itself."""
    return model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model


def load_adapter(model, directory: str | Path) -> None:
    """Load adapter weights saved by ``model.save_pretrained(directory)`` into the peft ``model``, in place."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    set_peft_model_state_dict(model, load_file(str(Path(directory) / "adapter_model.safetensors")))
