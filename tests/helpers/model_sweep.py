"""Every causal LM type transformers ships (`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`), built tiny from its default config
with random weights, scored by `get_response_log_probs` (the fused log-probs, which check the model's head first)
against its own forward (logits, log-softmax, gather). Each type is equal (to `ATOL`), refused in one line
(`UnreadableHead`), or does not build here (its tiny config or its own forward fails); anything else is a bug.

    PYTHONPATH=src python tests/helpers/model_sweep.py

prints each type's outcome and the counts (docs/models.md), and the classes of the equal types, which
`logitless.hf_probe.CHECKED_CLASSES` lists. `tests/library/test_model_sweep.py` runs the same, one case per type, in one
process.
"""

from __future__ import annotations

import collections
import sys
import warnings
from typing import NamedTuple

import torch

VOCABULARY = 211
ATOL = 1e-5
# Sizes a tiny model takes, for whichever of these integer fields a config (or any config inside it) has.
TINY = {
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "num_decoder_layers",
                     "encoder_layers"), 2),
    **dict.fromkeys(("hidden_size", "n_embd", "d_model", "dim", "embed_dim", "embedding_size", "attention_hidden_size"),
                    64),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "n_inner", "decoder_ffn_dim", "encoder_ffn_dim", "d_ff"), 128),
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size"), 32),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "decoder_attention_heads", "encoder_attention_heads"),
                    4),
    "num_key_value_heads": 2, "head_dim": 16, "rotary_dim": 8,
    "num_heads": 8, "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_ssm": 128,
    "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts"), 4), "num_experts_per_tok": 2,
    "vocab_size": VOCABULARY,
}
OUTCOMES = ("equal", "refused", "does not build here")


class Outcome(NamedTuple):
    kind: str  # one of OUTCOMES, or "different" / "error" (a bug)
    detail: str
    model_class: str = ""  # the causal LM's class, where it builds


def model_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _shrink(config) -> None:
    from transformers import PretrainedConfig

    for name, value in TINY.items():
        if isinstance(getattr(config, name, None), int) and not isinstance(getattr(config, name), bool):
            try:
                setattr(config, name, value)
            except (AttributeError, NotImplementedError):  # a field the config derives from others
                pass
    for name, value in list(vars(config).items()):
        if name.endswith("token_id") and isinstance(value, int) and value >= VOCABULARY:
            setattr(config, name, VOCABULARY - 1 - len(name) % 7)  # distinct ids inside the tiny vocabulary
        if isinstance(value, PretrainedConfig):
            _shrink(value)
    if hasattr(config, "is_decoder"):
        config.is_decoder = True  # encoder-decoder families' causal LMs score left to right


def tiny_model(model_type: str, **overrides):
    """The causal LM of ``model_type``, built tiny from its default config (with ``overrides`` of its fields) with
    random weights (seed 0), in eval mode; an exception where it does not build."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type)
    _shrink(config)
    for name, value in overrides.items():
        setattr(config, name, value)
    with torch.device("meta"):
        parameters = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    if parameters > 30_000_000:
        raise ValueError(f"{parameters / 1e6:.0f}M parameters at the tiny sizes")
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def _first_line(err: Exception) -> str:
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0][:160]}" if lines else type(err).__name__


def outcome(model_type: str) -> Outcome:
    """How `get_response_log_probs` scores the tiny ``model_type`` against its own forward."""
    from logitless import get_response_log_probs
    from logitless.hf_probe import UnreadableHead

    input_ids = torch.randint(3, VOCABULARY - 11, (2, 7), generator=torch.Generator().manual_seed(0))
    labels = input_ids.roll(-1, dims=1)
    try:
        model = tiny_model(model_type)
        with torch.no_grad():
            logits = model(input_ids=input_ids, use_cache=False).logits.float()  # (2, 7, V)
    except Exception as err:  # a tiny config transformers' defaults cannot make, or a forward that needs more inputs
        return Outcome("does not build here", _first_line(err))
    own = torch.log_softmax(logits, dim=-1).gather(-1, labels[..., None])[..., 0]  # (2, 7)
    name = type(model).__name__
    try:
        with torch.no_grad():
            fused = get_response_log_probs(model, input_ids, labels)["log_probs"]
    except UnreadableHead as err:
        return Outcome("refused" if "\n" not in str(err) else "error", str(err), name)
    except Exception as err:
        return Outcome("error", _first_line(err), name)
    gap = (fused - own).abs().max().item()
    return Outcome("equal" if gap <= ATOL else "different", f"max |log-prob difference| {gap:.1e}", name)


def main() -> int:
    warnings.filterwarnings("ignore")
    from transformers.utils import logging

    logging.set_verbosity_error()
    results = {}
    for model_type in model_types():
        results[model_type] = outcome(model_type)
        print(f"{model_type:28} {results[model_type].kind:20} {results[model_type].detail}", flush=True)
    counts = collections.Counter(result.kind for result in results.values())
    print(f"{len(results)} causal LM types: " + ", ".join(f"{counts[kind]} {kind}" for kind in sorted(counts)))
    print("classes of the equal types (hf_probe.CHECKED_CLASSES):",
          " ".join(sorted({result.model_class for result in results.values() if result.kind == "equal"})))
    return 0 if set(counts) <= set(OUTCOMES) else 1


if __name__ == "__main__":
    sys.exit(main())
