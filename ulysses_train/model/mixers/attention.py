"""Causal softmax attention as a token mixer: full, sliding-window and with attention sinks (GPT-OSS).

Under Ulysses one all-to-all trades each rank's slice of the sequence (all heads) for the whole sequence of
heads/sp heads; the kernel runs over the whole sequence; one all-to-all brings the slice back. DeepSpeed's wrapper
(`UlyssesSPAttentionHF`) does both exchanges around the kernel by replacing the kernel's entry in transformers'
attention registry (register_ulysses_attention), so this mixer is installed *before* the model is built: each
attention layer looks its kernel up at build time. The kernels: SDPA (model/attention.py, its priority), or
FlashAttention 4 (model/fa4.py: windows, sinks and documents); which kernel takes a model's windows and packed
documents is checked with the attention implementation (model/loading.py check_window_attention,
check_document_attention).

Multi-head latent attention (MLA: DeepSeek-V3, Kimi K2 and Moonlight, which are `deepseek_v3`, DeepSeek-V2,
LongCat-Flash, Kimi Linear's full-attention layers) expands a shared low-rank latent into per-head keys and values
inside the layer, so the kernel sees ordinary heads, but q and k heads are qk_nope + qk_rope wide and v heads
v_head_dim wide. DeepSpeed's wrapper assumes one head width (the config's `head_dim`: there only the rotary part)
and refuses them. Under sp each such layer (LATENT_ATTENTION_CLASSES) looks its kernel up under ULYSSES_LATENT
instead (install_attention, after the build), which exchanges q, k and v of their own widths in one all-to-all
(SequenceParallel.to_head_shards), runs the model's own kernel over the whole sequence and brings the output back.
RoPE is applied inside the layer before the kernel, on the slice's own positions, so the exchange carries rotated
q and k; the layer's softmax scale (DeepSeek's YaRN mscale) is passed through as it is."""
from __future__ import annotations

import copy
from typing import Optional

from ulysses_train.model.mixers.protocol import HeadCounts, Mixer, layer_types_of
from ulysses_train.model.swap import stock_class

ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
"""Layer types (transformers' `layer_types`) that train exactly under Ulysses: after the all-to-all each rank
holds the whole sequence for its heads, so a sliding-window layer sees every key its window needs and only the
kernel must know the window (fa4.py). Others (chunked attention) are refused (mixers.check_layer_types)."""


def ulysses_head_problems(heads: int, kv_heads: int, sp: int) -> list[str]:
    """What stops Ulysses from splitting these heads over sp ranks: "query" when sp does not divide the query
    heads (each rank gets heads/sp of them), "kv" when sp neither divides the KV heads nor is a multiple of
    them (they are split the same way, or each one replicated when sp is a multiple). Empty when sp works."""
    return ([] if heads % sp == 0 else ["query"]) + ([] if kv_heads % sp == 0 or sp % kv_heads == 0 else ["kv"])


def attention_head_units(text) -> dict:
    """{"query heads", "kv heads"} of the model's attention layers; {} for a model without any (a pure recurrent
    stack: every layer_types entry some other mixer's)."""
    if not any(kind in ATTENTION_LAYER_TYPES for kind in layer_types_of(text)):
        return {}
    heads = text.num_attention_heads
    return {"query heads": heads, "kv heads": getattr(text, "num_key_value_heads", None) or heads}


def attention_sp_problem(counts: HeadCounts, sp: int, key: str) -> Optional[str]:
    """Why sp cannot split the attention heads (ulysses_head_problems), as the first half of a refusal."""
    units = counts.of("attention")
    query, kv = units["query heads"], units["kv heads"]
    problems = ulysses_head_problems(query, kv, sp)
    if "query" in problems:
        return (f"the model has {query} query heads, not divisible by {key}={sp}; Ulysses gives each rank "
                f"heads/sp heads")
    if "kv" in problems:
        return (f"the model has {kv} KV heads and {key}={sp}: sp must divide the KV heads or be a multiple "
                f"of them (then KV heads are replicated)")
    return None


def register_ulysses_attention(hf_config, attn_implementation: str, sp: int):
    """Route the model's attention through DeepSpeed's Ulysses all-to-all; returns the mpu (None for sp=1).

    Must run before the model is built: DeepSpeed replaces the `attn_implementation` entry of transformers'
    attention registry with its wrapper, so every layer built afterwards reaches it. It also makes the sp process
    groups every other mixer exchanges over (the mpu's sequence-parallel group).
    """
    if sp == 1:
        return None
    from types import SimpleNamespace

    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    hf_config._attn_implementation = attn_implementation
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=SimpleNamespace(config=hf_config),
        core_attn_implementation=attn_implementation,
        sequence_parallel_size=sp,
        micro_batch_size=1,
        seq_length_is_variable=True,
    )
    # DeepSpeed's entry replaced the kernel's under its key (ALL_ATTENTION_FUNCTIONS[key]); it is wrapped in turn
    ALL_ATTENTION_FUNCTIONS[attn_implementation] = with_slice_positions(ALL_ATTENTION_FUNCTIONS[attn_implementation])
    return mpu


SLICE_POSITIONS: dict = {}
"""The position ids of the slice the decoder is running (its forward's `position_ids`), kept by the pre-hook
remember_slice_positions installs, for with_slice_positions."""


def with_slice_positions(ulysses_attention):
    """DeepSpeed's Ulysses entry requires `position_ids` in every attention call (it all-gathers them into the whole
    sequence's). Most families pass them down to their attention layers; Granite 4.0-H's model keeps them (its layers
    get rotary tables or none). This entry hands the slice's own positions (SLICE_POSITIONS) where a call lacks them,
    and changes nothing where it has them."""
    def attention(module, query, key, value, attention_mask, **kwargs):
        if kwargs.get("position_ids") is None and "ids" in SLICE_POSITIONS:
            kwargs["position_ids"] = SLICE_POSITIONS["ids"]
        return ulysses_attention(module, query, key, value, attention_mask, **kwargs)
    return attention


def remember_slice_positions(model, sequence_parallel) -> None:
    """After the build, under sp: the decoder's forward keeps its `position_ids` in SLICE_POSITIONS (the entry
    above reads them). Nothing to change without sp."""
    if sequence_parallel.size == 1:
        return

    def keep(module, args, kwargs):
        SLICE_POSITIONS["ids"] = kwargs.get("position_ids")
    model.get_decoder().register_forward_pre_hook(keep, with_kwargs=True)


LATENT_ATTENTION_CLASSES = ("DeepseekV3Attention", "DeepseekV2Attention", "LongcatFlashMLA", "KimiLinearAttention")
"""Attention modules whose q/k heads and v heads differ in width (MLA: module docstring), routed through
ULYSSES_LATENT under sp."""
ULYSSES_LATENT = "ulysses_latent_attention"
"""The attention-registry key of the MLA exchange (latent_attention); each MLA layer's own config copy names it."""


def latent_attention(module, query, key, value, attention_mask, **kwargs):
    """An attention-registry entry for MLA under sp: query and key [B, H, t, dqk], value [B, H, t, dv] of this
    rank's slice in; the whole sequence of H/sp heads through the model's kernel (`module.core_attention`); the
    output [B, t, H, dv] of the slice back. The slice's mask is dropped (causal over the whole sequence, documents
    from `cu_seq_lens_q`), as DeepSpeed's wrapper does; so are the slice's position ids (RoPE, where the layer has
    it, was applied before the kernel)."""
    sequence_parallel = module.sequence_parallel
    q, k, v = sequence_parallel.to_head_shards([x.transpose(1, 2) for x in (query, key, value)])
    kwargs.pop("position_ids", None)
    out, _ = module.core_attention(module, *(x.transpose(1, 2) for x in (q, k, v)), None, **kwargs)
    return sequence_parallel.to_sequence_shards(out), None


def route_latent_attention(model, sequence_parallel) -> int:
    """Under sp, point every MLA layer at ULYSSES_LATENT (its own copy of the config names it) with the kernel the
    model was built with; returns how many layers changed."""
    from transformers import AttentionInterface

    under_sp = sequence_parallel.size > 1
    layers = [m for m in model.modules() if stock_class(m).__name__ in LATENT_ATTENTION_CLASSES] if under_sp else []
    if layers:
        AttentionInterface.register(ULYSSES_LATENT, latent_attention)
    for layer in layers:
        layer.core_attention = AttentionInterface._global_mapping[layer.config._attn_implementation]
        layer.sequence_parallel = sequence_parallel
        layer.config = copy.copy(layer.config)
        layer.config._attn_implementation = ULYSSES_LATENT
    return len(layers)


def install_attention(model, sequence_parallel, variant: str = "") -> Optional[str]:
    """After the build: the slice positions' hook and the MLA layers' own exchange (both under sp only); the
    `model changes:` phrase for the MLA layers (None: none changed). Attention has no kernel variants: `variant`
    is ""."""
    remember_slice_positions(model, sequence_parallel)
    latent = route_latent_attention(model, sequence_parallel)
    return f"{latent} MLA layers exchanging q, k and v of their own widths" if latent else None


def attention_phrase(attn_implementation: str, sp: int) -> str:
    """What the `model changes:` line says of attention (installed before the build: register_ulysses_attention)."""
    return f"attention {attn_implementation}" + (f" inside the Ulysses all-to-all (sp={sp})" if sp > 1 else "")


def no_kernel_check(hf_config, seq_length: int, cuda: bool) -> None:
    """Attention's kernel checks need the attention implementation, so they run with it (module docstring)."""


ATTENTION = Mixer(
    name="attention",
    layer_types=ATTENTION_LAYER_TYPES,
    model_types=None,
    module_classes=LATENT_ATTENTION_CLASSES,
    head_units=attention_head_units,
    sp_problem=attention_sp_problem,
    sp_rule="sp divides the query heads (each rank runs heads/sp of them over the whole sequence) and divides the "
            "KV heads or is a multiple of them (DeepSpeed then replicates each KV head)",
    check_kernels=no_kernel_check,
    install=install_attention,
    document_restarts="the kernel's variable-length form: `cu_seq_lens` of the whole sequence (every rank holds "
                      "every document whole after the all-to-all), position ids restarting at each document",
    planned=True,
    planner_terms="planner/layer.py attention_saved_per_token, attention_backward_extra_per_token, "
                  "attention_forward_per_token (q/k and v head widths apart: MLA), attention_exchange_width (q; "
                  "MLA: q, k and v in one message); FLOPs: model/flops.py attention_forward_flops (4 x width per "
                  "attended pair, windows from mixers.layer_windows)",
)
