"""The first-use check that logitless reads a model's head as the model's own forward computes its logits.

`logitless.hf` reads the structures transformers' causal LMs are known to have; what else a model's forward does to
its logits no config says. So before logitless scores a model from its hidden states, `check_head` scores a few
positions both ways, the fused log-probs and entropies (`logitless.hf`'s head and hidden states) against the model's
own forward (its logits, log-softmax), and refuses a model where they differ, in one line naming its class and the
way around it. The check runs once per model object (its verdict is kept on the model), in eval mode, without
gradient, with autocast off (also the autocast Accelerate wraps a forward in for mixed precision) and the random
number generators untouched, and leaves every module's train/eval flag as it found it.

A sharded model (FSDP2, tensor parallelism: a DTensor head; DeepSpeed ZeRO-3: a partitioned one) is not run: its
own forward would gather the head. Then its class must be one of transformers' whose tiny random model the sweep
(`tests/helpers/model_sweep.py`) found equal to its own forward, `CHECKED_CLASSES`; another is refused, unless it was
checked on the same model object before it was sharded (the verdict stays on the object).
"""

from __future__ import annotations

import torch

from logitless.hf import final_hidden_states, head_structure, lm_head_of, vocabulary_rows
from logitless.ops.fused import fused_linear_logprobs

PROBE_TOKENS = 8  # the positions scored both ways
_VERDICT = "_logitless_head_verdict"  # on a checked model: None (its head is read as its forward computes) or why not
_SPECIAL_IDS = ("token_id", "token_index", "token_ids")  # config attributes naming ids the probe does not feed
# the ways around a refusal the library's callers name
REFERENCE_IMPL = "impl='reference' scores it with its own forward (its (B, T, V) logits)"
OWN_FORWARD = "get_response_log_probs(..., impl='reference') scores it with its own forward"

# transformers' causal LM classes whose tiny random model, built from the default config of each model type that
# uses it, scores equal to its own forward through logitless's head (tests/helpers/model_sweep.py, docs/models.md): a
# sharded model of one of these classes is read without running it.
CHECKED_CLASSES = frozenset("""
AfmoeForCausalLM Apertus1p5TextForCausalLM ApertusForCausalLM ArceeForCausalLM AriaTextForCausalLM
BailingHybridForCausalLM BambaForCausalLM BartForCausalLM BeamForCausalLM BertGenerationDecoder BertLMHeadModel
BigBirdForCausalLM BigBirdPegasusForCausalLM BioGptForCausalLM BitNetForCausalLM BlenderbotForCausalLM
BlenderbotSmallForCausalLM BloomForCausalLM CTRLLMHeadModel CamembertForCausalLM CodeGenForCausalLM
Cohere2ForCausalLM Cohere2MoeForCausalLM CohereForCausalLM CpmAntForCausalLM CwmForCausalLM Data2VecTextForCausalLM
DeepseekV4ForCausalLM DiffLlamaForCausalLM DogeForCausalLM DoryForCausalLM ElectraForCausalLM Emu3ForCausalLM
Ernie4_5ForCausalLM Ernie4_5_MoeForCausalLM ErnieForCausalLM Exaone4ForCausalLM ExaoneMoeForCausalLM
FalconForCausalLM FalconH1ForCausalLM FalconMambaForCausalLM FlexOlmoForCausalLM FlintForCausalLM FuyuForCausalLM
GPT2LMHeadModel GPTBigCodeForCausalLM GPTJForCausalLM GPTNeoForCausalLM GPTNeoXForCausalLM
GPTNeoXJapaneseForCausalLM Gemma2ForCausalLM Gemma3ForCausalLM Gemma3ForConditionalGeneration GemmaForCausalLM
GitForCausalLM Glm4ForCausalLM Glm4MoeForCausalLM Glm4MoeLiteForCausalLM GlmForCausalLM
GotOcr2ForConditionalGeneration GptOssForCausalLM GraniteForCausalLM GraniteMoeForCausalLM
GraniteMoeHybridForCausalLM GraniteMoeSWAForCausalLM GraniteMoeSharedForCausalLM GraniteSWAForCausalLM
HYV3ForCausalLM HeliumForCausalLM HrmTextForCausalLM HyperCLOVAXForCausalLM Inkling2ForCausalLM
Inkling2LoopForCausalLM InklingForCausalLM Jais2ForCausalLM JambaForCausalLM JetMoeForCausalLM
KimiLinearForCausalLM Kolibri1ForCausalLM LagunaForCausalLM LaraMiniForCausalLM Lfm2ForCausalLM Lfm3ForCausalLM
Llama4ForCausalLM LlamaForCausalLM MBartForCausalLM Mamba2ForCausalLM MambaForCausalLM MarianForCausalLM
MegatronBertForCausalLM MellumForCausalLM MiMoV2FlashForCausalLM MiniMaxForCausalLM MiniMaxM2ForCausalLM
MiniMaxM3VLForCausalLM Ministral3ForCausalLM MistralForCausalLM MixtralForCausalLM MllamaForCausalLM
ModernBertDecoderForCausalLM MoshiForCausalLM MossTranscribeDiarizeForConditionalGeneration MptForCausalLM
MvpForCausalLM NanoChatForCausalLM NemotronHForCausalLM OPTForCausalLM Olmo2ForCausalLM Olmo3ForCausalLM
OlmoForCausalLM OlmoHybridForCausalLM OlmoeForCausalLM OpenAIGPTLMHeadModel PLBartForCausalLM PegasusForCausalLM
PersimmonForCausalLM Phi3ForCausalLM Phi4MultimodalForCausalLM PhiForCausalLM PhimoeForCausalLM
ProphetNetForCausalLM Qwen2ForCausalLM Qwen2MoeForCausalLM Qwen3ForCausalLM Qwen3MoeForCausalLM
Qwen3NextForCausalLM Qwen3_5ForCausalLM Qwen3_5MoeForCausalLM Qwen4ExpForCausalLM RecurrentGemmaForCausalLM
RemBertForCausalLM RoCBertForCausalLM RoFormerForCausalLM RobertaForCausalLM RobertaPreLayerNormForCausalLM
RwkvForCausalLM SeedOssForCausalLM SmolLM3ForCausalLM SolarOpenForCausalLM StableLmForCausalLM
Starcoder2ForCausalLM TrOCRForCausalLM VaultGemmaForCausalLM WhisperForCausalLM XGLMForCausalLM
XLMRobertaForCausalLM XLMRobertaXLForCausalLM XLMWithLMHeadModel XLNetLMHeadModel ZayaForCausalLM
""".split())


class UnreadableHead(ValueError):
    """A model whose logits logitless cannot compute from its hidden states as its own forward does."""


def check_head(model, way_around: str, name: str = "model") -> None:
    """Raise `UnreadableHead` (one line: ``name``, the model's class, why, and ``way_around``) unless the fused
    log-probs of ``model`` equal its own forward's; the first call checks, later ones read the verdict kept on it."""
    if not hasattr(model, _VERDICT):
        sharding = _sharding(model)
        verdict = _probe(model) if sharding is None else _unprobed(model, sharding)
        setattr(model, _VERDICT, verdict)
    verdict = getattr(model, _VERDICT)
    if verdict is not None:
        raise UnreadableHead(f"{name}: logitless cannot score {model_class(model).__name__} from its hidden states: "
                             f"{verdict}; {way_around}")


def _sharding(model) -> str | None:
    """How ``model``'s parameters are split across processes (None: they are not), in words."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    output_embedding = model.get_output_embeddings()
    weight = getattr(output_embedding, "weight", None)
    if isinstance(weight, DTensor):
        return "sharded as a DTensor (FSDP2 or tensor parallelism)"
    if hasattr(weight, "ds_status"):
        return "partitioned by DeepSpeed ZeRO-3"
    if any(isinstance(module, FSDPModule) for module in model.modules()):
        return "in a model sharded by FSDP2"
    return None


def model_class(model) -> type:
    """The class of ``model`` (of a PEFT model's base model) before FSDP2 wrapped it (``FSDPQwen2ForCausalLM``)."""
    from torch.distributed.fsdp import FSDPModule

    model = model.get_base_model() if hasattr(model, "get_base_model") else model
    return next(cls for cls in type(model).__mro__ if not issubclass(cls, FSDPModule))


def _unprobed(model, sharding: str) -> str | None:
    cls = model_class(model)
    if "padded vocabulary" in head_structure(model):
        return f"its head is {sharding}, and its unpadded rows would be gathered to read them"
    if cls.__module__.startswith("transformers.") and cls.__name__ in CHECKED_CLASSES:
        return None
    return (f"its head is {sharding}, so its own forward, which would gather it, is not run to check the head, "
            f"and {cls.__name__} is not a class logitless has checked (call logitless.hf_probe.check_head on the model "
            "before it is sharded)")


def probe_ids(model) -> torch.Tensor:
    """(1, PROBE_TOKENS) token ids spread over the vocabulary (the ids both the input embedding and the logits have),
    none that the config names (special tokens, image placeholders), on the input embedding's device."""
    embedding = model.get_input_embeddings().weight
    vocabulary = min(embedding.shape[0], vocabulary_rows(model))
    special = set()
    for config in (model.config, model.config.get_text_config()):
        for attribute, value in vars(config).items():
            if attribute.endswith(_SPECIAL_IDS):
                special.update(value if isinstance(value, (list, tuple)) else [value])
    stride = max(1, vocabulary // (PROBE_TOKENS + 1))
    ids = []
    for step in range(vocabulary):
        token = (stride * (step + 1) + step // PROBE_TOKENS) % vocabulary
        if token not in special and token not in ids:
            ids.append(token)
        if len(ids) == PROBE_TOKENS:
            break
    return torch.tensor([ids], dtype=torch.long, device=embedding.device)


def _probe(model) -> str | None:
    """Why the fused log-probs of ``model`` differ from its own forward's on `probe_ids` (None: they agree)."""
    try:
        input_ids = probe_ids(model)  # (1, T)
    except (NotImplementedError, AttributeError, TypeError) as err:
        return f"its input embedding cannot be read ({_first_line(err)})"
    targets = input_ids.roll(-1, dims=1)  # (1, T): each position scores the next probe token
    device = input_ids.device
    flags = {module: module.training for module in model.modules()}
    rng_devices = [device] if device.type == "cuda" else []
    try:
        with (torch.no_grad(), torch.random.fork_rng(devices=rng_devices), torch.autocast(device.type, enabled=False)):
            model.eval()
            try:
                # the forward under Accelerate's mixed-precision wrapper (TRL's bf16=True), where it has one: the
                # check compares the model's own arithmetic, in the dtype it was built in, not an autocast's roundings
                own_forward = getattr(model, "_original_forward", model)
                logits = own_forward(input_ids=input_ids, use_cache=False).logits  # (1, T, V)
            except Exception as err:  # any failure of the model's own forward: there is nothing to check against
                return f"its own forward fails on {PROBE_TOKENS} token ids ({_first_line(err)})"
            try:
                head = lm_head_of(model)
                hidden = final_hidden_states(model, input_ids)  # (1, T, H)
            except (TypeError, ValueError, AttributeError, RuntimeError) as err:
                return f"its head or body cannot be read ({_first_line(err)})"
            return _difference(logits, hidden, head, targets)
    finally:
        for module, training in flags.items():
            module.training = training


def _difference(logits: torch.Tensor, hidden: torch.Tensor, head, targets: torch.Tensor) -> str | None:
    """Why the fused log-probs and entropies of (``hidden``, ``head``) at ``targets`` are not the model's own
    ``logits``' (None: they agree to the rounding of the lowest precision involved)."""
    if logits.shape[-1] != head.weight.shape[0]:
        return f"its forward gives {logits.shape[-1]} logits per token, its head has {head.weight.shape[0]} rows"
    if hidden.shape[-1] != head.weight.shape[1]:
        return (f"its head reads {head.weight.shape[1]}-wide hidden states, its body gives "
                f"{hidden.shape[-1]}-wide ones")
    hidden = hidden.to(head.weight.device, head.weight.dtype)  # as the TRL seam reads a head cast to fp32
    fused, entropy = fused_linear_logprobs(hidden, targets=targets.to(hidden.device), head=head,
                                           return_token_entropy=True)  # (1, T) each
    # the own logits' log-softmax in fp64 on the CPU (fp32's sum over a large vocabulary rounds by ~1e-4)
    own_log_probs = torch.log_softmax(logits.detach().cpu().double(), dim=-1)  # (1, T, V)
    own = own_log_probs.gather(-1, targets.cpu()[..., None])[..., 0]  # (1, T)
    own_entropy = torch.special.entr(own_log_probs.exp()).sum(-1)  # (1, T); a -inf logit adds 0
    gaps = torch.cat([fused.cpu().double() - own, entropy.cpu().double() - own_entropy])
    gap = gaps.abs().max().item()  # NaN where either side is: refused
    epsilon = max(torch.finfo(dtype).eps for dtype in (logits.dtype, hidden.dtype, head.weight.dtype))
    tolerance = 1e-4 + 4 * epsilon * (1 + logits.float().abs().max().item())  # the rounding of the own logits
    if gap <= tolerance:  # False for NaN
        return None
    return (f"its own forward's log-probs and entropies differ from those of the head logitless reads by up to "
            f"{gap:.2g} ({PROBE_TOKENS} positions checked)")


def _first_line(err: Exception) -> str:
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__
