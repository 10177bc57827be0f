"""What the package reads off a model's modules and config: its logit post-processing, its norm and MLP classes,
its feed-forward blocks and routers. The per-family facts behind these tables are the family records
(ulysses_train/families.py: adding a family means adding a record there, after its exactness test); what the package
knows about each token mixer (attention, Gated DeltaNet, ...) is in model/mixers/.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ulysses_train.families import BALANCE, FAMILIES, NO_LOSS, family_of, types_where
from ulysses_train.model.text_head import register_text_heads

register_text_heads()  # before anything looks a model up in AutoModelForCausalLM (text_head.py)

SUPPORTED_EXAMPLES = "e.g. Qwen3, Qwen3-MoE, Qwen3.5, Llama, Cohere, Granite, Gemma 3, GPT-OSS"
"""How messages name what is supported: decoder-only causal LMs built into transformers whose layers are full
or sliding-window causal attention and whose logits are `hidden @ lm_head.T`, scaled and soft-capped as
LOGIT_SCALES says."""

LOGIT_SCALES = {t: family.logit_scale for family in FAMILIES if family.logit_scale for t in family.model_types}
"""Model types whose causal-LM head scales the logits by a config value: (key, multiply | divide), from the family
records (families.py). The loss computes `hidden @ lm_head.T` itself, so it applies these (model/loss.py); the same
key on another model type is refused, since what that model does with it has not been checked against its
transformers forward."""
SOFTCAP_KEY = "final_logit_softcapping"
SOFTCAP_TYPES = types_where(lambda family: family.logit_softcap)
"""Text-model types whose head applies `cap * tanh(logits / cap)` with SOFTCAP_KEY (after any scale), from the family
records. These families also have sliding-window layers (model/mixers/attention.py); the key on any other type is
refused."""


@dataclass(frozen=True)
class LogitTransform:
    """What a model's head does to `hidden @ lm_head.T` before the softmax: `cap * tanh(scale * z / cap)`."""

    scale: float = 1.0
    softcap: Optional[float] = None

    @property
    def identity(self) -> bool:
        return self.scale == 1.0 and not self.softcap


def logit_transform(hf_config) -> LogitTransform:
    """The model's LogitTransform, read exactly as transformers' heads apply it: Cohere multiplies by `logit_scale`
    and Granite divides by `logits_scaling` whatever their value, Gemma caps whenever SOFTCAP_KEY is not None. A value
    the head would apply is applied (a negative scale or cap too: `cap * tanh(z / cap)` is even in the cap) or
    refused, never dropped: ValueError, one line, for a value that is not a finite number, that leaves transformers'
    head nothing to learn (a scale or cap of 0 makes every logit 0; dividing by 0 makes them infinite), or that
    sits on a type whose head does not read it (LOGIT_SCALES, SOFTCAP_TYPES)."""
    text = text_config(hf_config)
    known = LOGIT_SCALES.get(text.model_type)
    scale = 1.0
    for key in ("logit_scale", "logits_scaling"):
        value = getattr(text, key, None)
        if known is not None and known[0] == key:
            use = "multiplies the logits by" if known[1] == "multiply" else "divides the logits by"
            value = _head_number(text.model_type, key, value, use, "1.0 (no scale)")
            scale = value if known[1] == "multiply" else 1.0 / value
        elif value not in (None, 1, 1.0):
            raise ValueError(f"model type {text.model_type!r} sets {key}={value}, a logit post-processing the loss "
                             f"does not know for this architecture, which is not supported")
    softcap = getattr(text, SOFTCAP_KEY, None)
    if text.model_type in SOFTCAP_TYPES:
        if softcap is not None:
            softcap = _head_number(text.model_type, SOFTCAP_KEY, softcap, "soft-caps the logits at", "null (no cap)")
    elif softcap:
        raise ValueError(f"model type {text.model_type!r} sets {SOFTCAP_KEY}={softcap}, a logit post-processing the "
                         f"loss does not know for this architecture, which is not supported")
    else:
        softcap = None  # a head that never reads the key: 0 or null there changes nothing
    return LogitTransform(float(scale), softcap)


def _head_number(model_type: str, key: str, value, use: str, neutral: str) -> float:
    """`value` of a head key transformers applies as it is: a finite, non-zero number, else ValueError naming the
    key, what transformers' head would compute with it, and the value that leaves the logits as they are."""
    import math

    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"model type {model_type!r} sets {key}={value!r}, which its head {use}: it must be a finite "
                         f"number (fix: {key}: {neutral})")
    if value == 0:
        raise ValueError(f"model type {model_type!r} sets {key}={value}, with which transformers' head makes every "
                         f"logit 0 or infinite: nothing can be trained (fix: {key}: {neutral})")
    return float(value)


LLAMA_STYLE_RMSNORMS = ("Qwen3RMSNorm", "Qwen2RMSNorm", "LlamaRMSNorm", "MistralRMSNorm", "Qwen3MoeRMSNorm",
                        "GraniteMoeHybridRMSNorm", "GraniteRMSNorm", "SeedOssRMSNorm", "SmolLM3RMSNorm",
                        "ApertusRMSNorm", "Glm4MoeRMSNorm", "MiniMaxM2RMSNorm", "HunYuanMoEV1RMSNorm",
                        "Ernie4_5_MoeRMSNorm", "Exaone4RMSNorm", "KimiLinearRMSNorm", "BambaRMSNorm",
                        "DeepseekV3RMSNorm", "LongcatFlashRMSNorm", "MiMoV2FlashRMSNorm", "DeepseekV32RMSNorm",
                        "GlmMoeDsaRMSNorm", "HYV4RMSNorm", "Apertus1p5TextRMSNorm", "GraniteMoeRMSNorm",
                        "HYV3RMSNorm", "MiniCPM5MoeRMSNorm", "Ministral3RMSNorm", "MixtralRMSNorm", "Phi3RMSNorm",
                        "Dots3NoteRMSNorm", "Dots1RMSNorm", "Cohere2MoeRMSNorm", "LagunaRMSNorm", "Kolibri1RMSNorm",
                        "Glm5NextTextRMSNorm", "Glm5NextRMSNorm")
"""Norm classes computing `w * (x.float() * rsqrt(mean(x^2) + eps)).to(dtype)`, which the RMSNorm kernels
(rmsnorm.py) replace exactly (each forward is LlamaRMSNorm's line for line: tests/test_rmsnorm.py). Others (e.g. Gemma's, which scales by 1 + w) are left as they are."""

OFFSET_RMSNORMS = ("Qwen3_5RMSNorm", "Qwen3_5MoeRMSNorm", "Qwen3NextRMSNorm", "Gemma3RMSNorm")
"""Norm classes computing `(x.float() * rsqrt(mean(x^2) + eps) * (1 + w.float())).to(dtype)`: everything in fp32,
one cast at the end. Liger's RMSNorm with offset 1 and its `gemma` casting computes exactly this (rmsnorm.py)."""

SWIGLU_MLPS = ("LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP", "Qwen3MoeMLP", "Qwen3_5MLP", "Qwen3_5MoeMLP",
               "Qwen3NextMLP", "OlmoHybridMLP")
"""MLP classes whose forward is exactly `down_proj(act_fn(gate_proj(x)) * up_proj(x))` (read in transformers 5.17 and
5.24); with a SiLU activation, Liger's SiLU-and-multiply kernel computes it (swiglu.py)."""

DENSE_MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
"""The projections of a dense `down(act(gate(x)) * up(x))` MLP, a form TiledMLP tiles (tiling.py)."""

UNGATED_MLP_PROJECTIONS = ("up_proj", "down_proj")
"""The projections of an ungated `down(act(up(x)))` MLP (Nemotron-H's relu² `NemotronHMLP`, its shared expert),
the other form TiledMLP tiles: per token like the gated one, so tiles of the sequence compute what one call does."""


FUSED_GATED_MLP_PROJECTIONS = ("input_linear", "output_linear")
"""The projections of a `output(act(a) * b)` MLP whose a and b are the two halves of one projection's output
(GraniteMoeShared's and Granite 4.0-H's `shared_mlp`): per token, a form TiledMLP tiles."""

FEED_FORWARD_NAMES = ("mlp", "feed_forward", "block_sparse_moe", "shared_mlp")
"""Where decoder layers keep the feed-forward modules they call on the post-attention norm's output: `mlp` in most
families, `feed_forward` in Bamba, and in GraniteMoeShared and Granite 4.0-H the experts (`block_sparse_moe`) beside
a `shared_mlp`, both run on the same input and their outputs added."""


def is_dense_mlp(module) -> bool:
    """Whether `module` is a dense MLP of a form TiledMLP tiles: gated (DENSE_MLP_PROJECTIONS), ungated
    (UNGATED_MLP_PROJECTIONS, without a gate) or fused gated (FUSED_GATED_MLP_PROJECTIONS). The one definition
    tiling.py and the planner's counts read."""
    if all(hasattr(module, n) for n in DENSE_MLP_PROJECTIONS):
        return True
    if all(hasattr(module, n) for n in FUSED_GATED_MLP_PROJECTIONS):
        return True
    return all(hasattr(module, n) for n in UNGATED_MLP_PROJECTIONS) and not hasattr(module, "gate_proj")


def feed_forward_blocks(layer) -> list:
    """A decoder layer's MLP and mixture-of-experts modules (FEED_FORWARD_NAMES), or where a layer holds one module
    that is a mixer, an MLP or experts (Nemotron-H's `mixer`), that module when it is a dense MLP (is_dense_mlp) or
    holds an `experts` bank; [] for a layer without any (Nemotron-H's Mamba2 and attention blocks)."""
    blocks = [getattr(layer, name) for name in FEED_FORWARD_NAMES if getattr(layer, name, None) is not None]
    if blocks:
        return blocks
    mixer = getattr(layer, "mixer", None)
    return [mixer] if mixer is not None and (is_dense_mlp(mixer) or hasattr(mixer, "experts")) else []

MLPS_RETURNING_ROUTER_SCORES = ("GptOssMLP", "Llama4TextMoe")
"""Mixture-of-experts blocks whose forward returns (hidden states, router scores) and whose layer drops the
scores: the tiled forward returns (hidden states, None) for them (tiling.py)."""

ROUTER_BALANCE_TYPES = types_where(lambda family: family.router_loss == BALANCE)
"""Mixture-of-experts model types whose causal-LM head, with `output_router_logits` on, adds
`router_aux_loss_coef` x transformers' `load_balancing_loss_func` over every router's logits of the sequence
(softmax, top-`num_experts_per_tok`, `E * sum_e f_e P_e`), from the family records. router_balance.py computes that
term exactly under sp; checked against each type's own transformers forward (tests/test_model_families.py,
test_linear_hybrids.py). Other types with a router loss are refused (their function may differ)."""
NO_ROUTER_LOSS_TYPES = types_where(lambda family: family.router_loss == NO_LOSS)
"""Mixture-of-experts model types whose causal-LM forward adds no router loss even with `output_router_logits` on
(Kimi Linear and Nemotron-H: sigmoid routers with grouped top-k; transformers' forward returns the router logits and
a loss that is the cross-entropy alone, in 5.17 and 5.25): the flag trains as it is, with a note (the `model
changes:` line), as there is nothing to reproduce."""


def router_of(model):
    """(router module class, index of the logits in its output tuple), or None for a model without routers. Every
    mixture-of-experts block of the model holds one such router. Read from transformers' own record of where a
    model's router logits come from (`_can_record_outputs["router_logits"]`); where a transformers version keeps
    no such record (5.17's Nemotron-H and Granite 4.0-H do not), the router is the module beside an `experts` bank
    with one weight row per expert (router_beside_experts), and the index None: router_logits_index finds them."""
    recorder = (getattr(model, "_can_record_outputs", None) or {}).get("router_logits")
    if recorder is None:
        router = router_beside_experts(model)
        return None if router is None else (router, None)
    if isinstance(recorder, type):
        return recorder, 0
    return recorder.target_class, recorder.index


def router_beside_experts(model):
    """The class of the module that sits beside a mixture-of-experts block's `experts` and holds a [experts,
    hidden] weight (the router's logits are hidden x its rows), or None. The weight's shape is read from
    `ds_shape` where ZeRO-3 has partitioned it."""
    import torch

    experts, _ = experts_per_token(model.config)
    if not experts:
        return None
    for block in model.modules():
        bank = getattr(block, "experts", None)
        if not isinstance(bank, torch.nn.Module):
            continue
        for child in block.children():
            weight = getattr(child, "weight", None)
            shape = tuple(getattr(weight, "ds_shape", None) or getattr(weight, "shape", ()))
            if child is not bank and len(shape) == 2 and shape[0] == experts:
                return type(child)
    return None


def router_logits_index(output: tuple, index, num_experts: int) -> int:
    """Where a router call's logits sit in its output: `index` from router_of, or where it is None, the floating
    output of one column per expert (the top-k weights have top-k columns, the chosen experts are integers)."""
    if index is not None:
        return index
    import torch

    return next(i for i, t in enumerate(output) if isinstance(t, torch.Tensor) and t.is_floating_point()
                and t.shape[-1] == num_experts)


EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
"""The config keys that count a mixture of experts' routed experts, under the families' names (the first set wins)."""
TOP_K_KEYS = ("num_experts_per_tok", "top_k_experts", "moe_topk", "moe_k")
"""The config keys of the experts each token is routed to, likewise."""


def first_set(text, keys: tuple):
    """The value of the first of `keys` the config sets (not None), or None."""
    return next((value for key in keys for value in [getattr(text, key, None)] if value is not None), None)


def experts_per_token(hf_config) -> tuple[int, int]:
    """(experts, experts each token is routed to) of a mixture-of-experts config; (0, 0) for a dense one."""
    text = text_config(hf_config)
    experts = int(first_set(text, EXPERT_COUNT_KEYS) or 0)
    family = family_of(text.model_type)
    if family and family.experts_layer and family.experts_layer not in (getattr(text, "layer_types", None) or ()):
        return 0, 0  # its expert count has a default also in configs without an expert layer (Nemotron-H 8B)
    top_k = first_set(text, TOP_K_KEYS)
    if not experts or top_k is None:
        return 0, 0
    return experts, int(top_k[0] if isinstance(top_k, (list, tuple)) else top_k)


def text_config(hf_config):
    """The decoder's config: multimodal configs nest it (`get_text_config`), text-only ones are it."""
    return hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config


def decoder_of(causal_lm):
    """The decoder stack of a causal LM: transformers' `get_decoder()`, or the LM's `model` where that returns the
    LM itself (Llama4ForCausalLM names `language_model` as its base-model prefix but keeps its decoder as `model`)."""
    decoder = causal_lm.get_decoder()
    return causal_lm.model if decoder is causal_lm and hasattr(causal_lm, "model") else decoder


def causal_lm_on_meta(hf_config):
    """The causal LM built on the meta device (exact module tree and shapes, no memory, a few seconds), for
    counting and naming its layers (the planner's shape, LoRA's targets).

    Built from its class, not `AutoModelForCausalLM.from_config`: while a ZeRO-3 `HfDeepSpeedConfig` is alive
    (an engine built in this process), `from_config` enters DeepSpeed's `zero.Init`, which partitions every
    parameter by copying it, and a meta tensor has nothing to copy ("Cannot copy out of meta tensor")."""
    import torch
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    with torch.device("meta"):
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_config)](hf_config)


def saved_bytes_per_channel(module, channels: int, rows: int = 4) -> int:
    """Bytes per input channel a module saves for its backward when run on bf16 rows of `channels` (the trainer's
    GPU dtype): its saved tensors as big as the input, each counted once (an fp32 upcast saved by two ops is one
    tensor), measured by running it on the meta device (no memory) under autograd's saved-tensor hooks. What the
    planner reads off a norm it leaves as Hugging Face's module (planner/model_counts.py): Llama's and Qwen3's
    RMSNorm 6 (the fp32 upcast, the bf16 normalized rows), Gemma's 8 (normalized in fp32 before the scale), Gemma
    4's unscaled v norm 4. `module` must be on the meta device (causal_lm_on_meta)."""
    import torch

    x = torch.empty(rows, channels, device="meta", dtype=torch.bfloat16, requires_grad=True)
    kept = {}

    def pack(tensor):
        if tensor.numel() == rows * channels:
            kept[id(tensor)] = tensor  # held, so an id is never reused while counting
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        module(x)
    return sum(tensor.element_size() for tensor in kept.values())


def saved_bytes_per_row(module, row_shape: tuple) -> float:
    """Bytes a module saves for its backward per row of bf16 input [rows, *row_shape] (a token's hyper-connected
    streams: (streams, hidden)), each saved storage counted once (views of one tensor share it), measured on a CPU
    copy of the module (uninitialised: the sizes do not depend on the values) at 4 and 8 rows, so what does not grow
    with the rows (its weights) drops out. `module` may be on the meta device (causal_lm_on_meta)."""
    import copy

    import torch

    module = copy.deepcopy(module).to_empty(device="cpu")

    def saved(rows: int) -> int:
        x = torch.zeros(1, rows, *row_shape, dtype=torch.bfloat16, requires_grad=True)
        storages = {}

        def pack(tensor):
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            module(x)
        return sum(storages.values())

    return (saved(8) - saved(4)) / 4


def layer_configs(hf_config) -> list:
    """Each decoder layer's config: the layer's own view where the config sets attributes per layer (transformers'
    heterogeneous configs: Gemma 4's `per_layer_config` gives its full-attention layers their own `head_dim` and
    `num_key_value_heads`, and reading those on the whole config raises), else the text config for every layer."""
    text = text_config(hf_config)
    if getattr(text, "is_heterogeneous", False):
        return list(text.per_layer_config)
    return [text] * text.num_hidden_layers


def attention_heads_of(layer_config) -> tuple[int, int, int]:
    """(query heads, KV heads, head width) of one layer's config; the width of a config without `head_dim` is
    hidden / heads, and one without `num_key_value_heads` has as many KV heads as query heads."""
    heads = layer_config.num_attention_heads
    width = getattr(layer_config, "head_dim", None) or layer_config.hidden_size // heads
    return heads, getattr(layer_config, "num_key_value_heads", None) or heads, width
