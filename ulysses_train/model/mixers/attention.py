"""Causal softmax attention as a token mixer: full, sliding-window and with attention sinks (GPT-OSS).

Under Ulysses one all-to-all trades each rank's slice of the sequence (all heads) for the whole sequence of
heads/sp heads; the kernel runs over the whole sequence; one all-to-all brings the slice back. DeepSpeed's wrapper
(`UlyssesSPAttentionHF`) does both exchanges around the kernel by replacing the kernel's entry in transformers'
attention registry (register_ulysses_attention), so this mixer is installed *before* the model is built: each
attention layer looks its kernel up at build time. The kernels: SDPA (model/attention.py, its priority), or
FlashAttention 4 (model/fa4.py: windows, sinks and documents); which kernel takes a model's windows and packed
documents is checked with the attention implementation (model/attention_checks.py check_window_attention,
check_document_attention).

Attention layers whose heads DeepSpeed's wrapper cannot take (MLA's q/k and v of different widths, Gemma 4's per-layer
head widths and KV heads) are exchanged by their own all-to-all instead (attention_exchange.py)."""
from __future__ import annotations

from typing import Optional

import torch

from ulysses_train.model.architecture import attention_heads_of, decoder_of, layer_configs, text_config
from ulysses_train.model.mixers.protocol import HeadCounts, Mixer, layer_types_of
from ulysses_train.model.mixers.attention_exchange import (ATTENTION_LAYER_TYPES, OWN_EXCHANGE_CLASSES,
                                                            route_own_exchange)
from ulysses_train.model.mixers.head_chunks import chunk_problem



def ulysses_head_problems(heads: int, kv_heads: int, sp: int) -> list[str]:
    """What stops Ulysses from splitting these heads over sp ranks: "query" when sp does not divide the query
    heads (each rank gets heads/sp of them), "kv" when sp neither divides the KV heads nor is a multiple of
    them (they are split the same way, or each one replicated when sp is a multiple). Empty when sp works."""
    return ([] if heads % sp == 0 else ["query"]) + ([] if kv_heads % sp == 0 or sp % kv_heads == 0 else ["kv"])


def attention_head_units(text) -> dict:
    """{"query heads", "kv heads"} of the model's attention layers; where the KV heads differ by layer type (Gemma 4's
    global layers: architecture.layer_configs) one "kv heads (<layer type>)" unit per type instead; {} for a model
    without attention layers (a pure recurrent stack: every layer_types entry some other mixer's)."""
    kinds = layer_types_of(text)
    per_type = {}
    for kind, layer in zip(kinds, layer_configs(text)):
        if kind in ATTENTION_LAYER_TYPES:
            per_type.setdefault(kind, attention_heads_of(layer)[:2])
    if not per_type:
        return {}
    heads = next(iter(per_type.values()))[0]
    kv_counts = {kind: kv for kind, (_, kv) in per_type.items()}
    if len(set(kv_counts.values())) == 1:
        return {"query heads": heads, "kv heads": next(iter(kv_counts.values()))}
    return {"query heads": heads, **{f"kv heads ({kind})": kv for kind, kv in kv_counts.items()}}


def attention_sp_problem(counts: HeadCounts, sp: int, key: str) -> Optional[str]:
    """Why sp cannot split the attention heads (ulysses_head_problems), as the first half of a refusal."""
    units = counts.of("attention")
    query = units["query heads"]
    for unit, kv in units.items():
        problems = ulysses_head_problems(query, kv, sp) if unit.startswith("kv heads") else []
        if "query" in problems:
            return (f"the model has {query} query heads, not divisible by {key}={sp}; Ulysses gives each rank "
                    f"heads/sp heads")
        if "kv" in problems:
            where = unit.removeprefix("kv heads").strip(" ()")
            return (f"the model has {kv} KV heads{' in its ' + where + ' layers' if where else ''} and {key}={sp}: "
                    f"sp must divide the KV heads or be a multiple of them (then KV heads are replicated)")
    return None


def untested_exchange_problem(hf_config, sp: int, key: str = "parallel.sequence_parallel_size") -> Optional[str]:
    """Why a model type without a family record (tried under model.allow_untested_family) cannot be exchanged at
    this sp, or None: DeepSpeed's Ulysses wrapper takes one head width, and only the records' attention classes
    (Family.own_exchange) go through the package's own exchange, so q/k and v heads of different widths (MLA, as
    `deepseek_v2`) or head widths that differ by layer would end in the wrapper's assertion at the first step."""
    from ulysses_train.families import family_of

    text = text_config(hf_config)
    if sp == 1 or family_of(text.model_type) is not None:
        return None
    nope, rope, value = (getattr(text, k, None) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    width = (nope or 0) + (rope or 0) if nope else attention_heads_of(layer_configs(text)[0])[2]
    if value and value != width:
        kind = f"q/k heads {width} wide and v heads {value} wide"
    elif getattr(text, "is_heterogeneous", False):
        kind = "head widths or KV heads that differ by layer"
    else:
        return None
    return (f"model type {text.model_type!r} has no family record and its attention has {kind}, which DeepSpeed's "
            f"Ulysses wrapper cannot exchange (it takes one width; the package's own exchange serves recorded "
            f"families only). Fix: {key}=1 to try it without sequence parallelism, or a family that trains")


def attention_chunk_problem(counts: HeadCounts, sp: int, chunks: int) -> Optional[str]:
    """Why `chunks` head chunks (model.attention_head_chunks) cannot split the heads each rank runs in every
    attention layer kind (head_chunks.chunk_problem); None when they can, or the model has no attention."""
    units = counts.of("attention")
    if not units or chunks == 1:
        return None
    query = units["query heads"]
    return next((problem for unit, kv in units.items() if unit.startswith("kv heads")
                 for problem in [chunk_problem(query, kv, sp, chunks)] if problem), None)


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
        model_name_or_path=SimpleNamespace(config=homogeneous_view(hf_config)),
        core_attn_implementation=attn_implementation,
        sequence_parallel_size=sp,
        micro_batch_size=1,
        seq_length_is_variable=True,
    )
    # DeepSpeed's entry replaced the kernel's under its key (ALL_ATTENTION_FUNCTIONS[key]); it is wrapped in turn
    ALL_ATTENTION_FUNCTIONS[attn_implementation] = with_slice_positions(ALL_ATTENTION_FUNCTIONS[attn_implementation])
    return mpu


def homogeneous_view(hf_config):
    """The config as DeepSpeed's registration reads it (one head width, one KV head count): the config itself, or
    a stand-in with the first layer's (attention_heads_of) for a config with per-layer head widths (Gemma 4; no
    layer of such a model calls DeepSpeed's wrapper: each is exchanged by its own all-to-all, attention_exchange.py)
    and for one whose `head_dim` is null (Mixtral's: hidden / heads), which DeepSpeed would read as a width."""
    from types import SimpleNamespace

    text = text_config(hf_config)
    if not getattr(text, "is_heterogeneous", False) and getattr(text, "head_dim", None):
        return hf_config
    heads, kv_heads, width = attention_heads_of(layer_configs(text)[0])
    shape = SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=width,
                            num_hidden_layers=text.num_hidden_layers, hidden_size=text.hidden_size)
    return SimpleNamespace(_attn_implementation=hf_config._attn_implementation, get_text_config=lambda: shape)


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
    """After the build, under sp or where a layer reads positions of its own (PositionsAsCache): the decoder's
    forward keeps its `position_ids` in SLICE_POSITIONS (the entry above reads them)."""
    if sequence_parallel.size == 1 and not tuned_layers(model):
        return

    def keep(module, args, kwargs):
        SLICE_POSITIONS["ids"] = kwargs.get("position_ids")
    decoder_of(model).register_forward_pre_hook(keep, with_kwargs=True)


class PositionsAsCache:
    """What a Llama 4 NoPE layer's temperature tuning is handed as its cache: its forward scales each query by
    `log1p(floor((position + 1) / floor_scale)) * attn_scale + 1`, with positions `arange(tokens) + cache
    .get_seq_length()`, the slice's own indices, not the sequence's (nor each packed document's). This stand-in
    answers get_seq_length with the decoder's position ids minus those indices, so the positions are the ones the
    run gives RoPE (the sequence's, restarting at each document), and gives keys and values back as they are from
    update (no cache is kept)."""

    def __init__(self, position_ids):
        self.position_ids = position_ids

    def get_seq_length(self, layer_idx: int = 0):
        positions = self.position_ids[0]
        return positions - torch.arange(positions.shape[0], device=positions.device)

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        return key_states, value_states


def tuned_layers(model) -> list:
    """Attention layers that scale their queries by position (Llama 4's NoPE layers: attn_temperature_tuning)."""
    return [m for m in model.modules() if getattr(m, "attn_temperature_tuning", False)
            and not getattr(m, "use_rope", True)]


def cache_parameter(module) -> str:
    """The name the module's forward takes its cache under: `cache` (transformers >= 5.24), else `past_key_values`
    or `past_key_value` (older releases, the GPU image's 5.17 among them)."""
    import inspect

    names = inspect.signature(type(module).forward).parameters
    return next((name for name in ("cache", "past_key_values", "past_key_value") if name in names), "cache")


def hand_positions(module, args, kwargs):
    """A tuned layer's forward pre-hook: its cache argument becomes PositionsAsCache of the decoder's positions."""
    name = module.positions_cache_name
    if kwargs.get(name) is None and SLICE_POSITIONS.get("ids") is not None:
        kwargs = {**kwargs, name: PositionsAsCache(SLICE_POSITIONS["ids"])}
    return args, kwargs


def install_attention(model, sequence_parallel, variant: str = "") -> Optional[str]:
    """After the build: the slice positions' hook and the own exchange of the layers DeepSpeed's wrapper cannot take
    (attention_exchange.py; both under sp only); the `model changes:` phrase for those layers (None: none changed). Attention has no kernel variants: `variant`
    is ""."""
    remember_slice_positions(model, sequence_parallel)
    for layer in tuned_layers(model):
        layer.positions_cache_name = cache_parameter(layer)
        layer.register_forward_pre_hook(hand_positions, with_kwargs=True)
    own = route_own_exchange(model, sequence_parallel)
    return f"{own} attention layers exchanging q, k and v of their own widths" if own else None


def attention_phrase(attn_implementation: str, sp: int) -> str:
    """What the `model changes:` line says of attention (installed before the build: register_ulysses_attention)."""
    return f"attention {attn_implementation}" + (f" inside the Ulysses all-to-all (sp={sp})" if sp > 1 else "")


def no_kernel_check(hf_config, seq_length: int, cuda: bool) -> None:
    """Attention's kernel checks need the attention implementation, so they run with it (module docstring)."""


ATTENTION = Mixer(
    name="attention",
    layer_types=ATTENTION_LAYER_TYPES,
    model_types=None,
    module_classes=OWN_EXCHANGE_CLASSES,
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
