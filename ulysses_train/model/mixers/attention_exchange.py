"""Attention layers whose heads DeepSpeed's Ulysses wrapper cannot take, exchanged by their own all-to-all.

DeepSpeed's wrapper (`UlyssesSPAttentionHF`) checks every call against one head width and one KV head count, the
config's. Two kinds of models break that:
- multi-head latent attention (MLA: DeepSeek-V3, Kimi K2 and Moonlight, which are `deepseek_v3`, LongCat-Flash,
  Kimi Linear's full-attention layers) expands a low-rank latent into per-head keys and values inside the layer:
  q and k heads are qk_nope + qk_rope wide, v heads v_head_dim, while the config's `head_dim` is only the rotary
  part;
- Gemma 4 gives its global layers their own head width (512 against the sliding layers' 256) and KV head count
  (keys equal to values, fewer heads): per-layer attributes (model/architecture.py layer_configs);
- MiMo-V2-Flash has v heads narrower than its q/k heads (128 against 192) and twice the KV heads in its sliding
  layers (which also have attention sinks) as in its full ones.

Under sp each such layer (OWN_EXCHANGE_CLASSES) looks its kernel up under ULYSSES_OWN instead (after the build:
route_own_exchange), which exchanges q, k and v of their own widths in one all-to-all
(SequenceParallel.to_head_shards: [B, t, H, d] -> [B, T, H/sp, d]), runs the model's own kernel over the whole
sequence of the rank's heads and brings the output back ([B, T, H/sp, dv] -> [B, t, H, dv]). KV heads fewer than
sp are first repeated in place (kv_for_ranks), so each rank receives the KV head its query heads read, and the
repeat's backward sums the copies' gradients. RoPE is applied inside the layer before the kernel, on the slice's own
positions, so the exchange carries rotated q and k; the layer's softmax scale (DeepSeek's YaRN mscale, Gemma 4's 1)
and its window are passed through as they are."""
from __future__ import annotations

import copy

import torch

from ulysses_train.families import own_exchange_classes
from ulysses_train.model.mixers.head_chunks import ChunkLayout, HeadChunkedAttention
from ulysses_train.model.mixers.protocol import module_layer_type
from ulysses_train.model.swap import stock_class

ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
"""Layer types (transformers' `layer_types`) that train exactly under Ulysses: after the all-to-all each rank
holds the whole sequence for its heads, so a sliding-window layer sees every key its window needs and only the
kernel must know the window (fa4.py), and a chunked layer (Llama 4) its chunks (fa4.chunk_bounds). Others are
refused (mixers.check_layer_types); a module of an attention class in a layer of another type (dots3's indexed
layers) is another mixer's."""
OWN_EXCHANGE_CLASSES = own_exchange_classes()
"""Attention modules exchanged by ULYSSES_OWN under sp (module docstring): each family record's own_exchange."""
ULYSSES_OWN = "ulysses_own_exchange"
"""The attention-registry key of the exchange (own_exchange_attention); each such layer's own config copy names
it."""


def kv_for_ranks(x: torch.Tensor, sp: int) -> torch.Tensor:
    """[B, t, kv, d] with each KV head repeated in place until the heads split over sp ranks: with kv < sp (sp a
    multiple of kv: the sp rule) rank r receives KV head r * kv // sp, the one its query heads read."""
    heads = x.shape[2]
    return x if heads % sp == 0 else x.repeat_interleave(sp // heads, dim=2)


class LocalGroups:
    """The layer as its kernel sees it on one rank: every attribute the layer's, but `num_key_value_groups` the
    rank's own (its query heads per KV head after the exchange), which transformers' kernels read to repeat KV."""

    def __init__(self, module, groups: int):
        self._module = module
        self.num_key_value_groups = groups

    def __getattr__(self, name):
        return getattr(self._module, name)


def own_exchange_attention(module, query, key, value, attention_mask, **kwargs):
    """An attention-registry entry under sp: query [B, H, t, dq], key [B, KV, t, dq] and value [B, KV, t, dv] of
    this rank's slice in; the whole sequence of H/sp query heads (and their KV heads) through the model's kernel
    (`module.core_attention`); the output [B, t, H, dv] of the slice back. The slice's mask is dropped (causal over
    the whole sequence, documents from `cu_seq_lens_q`, windows from the kernel's `sliding_window`), as DeepSpeed's
    wrapper does; so are the slice's position ids (RoPE, where the layer has it, was applied before the kernel).
    With `module.head_chunks` > 1 the heads go through in chunks, one at a time (head_chunks.py)."""
    sequence_parallel = module.sequence_parallel
    q = query.transpose(1, 2)
    k, v = (kv_for_ranks(x.transpose(1, 2), sequence_parallel.size) for x in (key, value))
    kwargs.pop("position_ids", None)
    sinks = kwargs.pop("s_aux", None)

    def attend(q, k, v, sinks):  # the whole sequence of the rank's heads: [B, T, heads/sp, d] in and out
        kernel_view = LocalGroups(module, q.shape[2] // k.shape[2])
        out, _ = module.core_attention(kernel_view, *(x.transpose(1, 2) for x in (q, k, v)), None,
                                       **kwargs, **({"s_aux": sinks} if sinks is not None else {}))
        return out

    chunks = getattr(module, "head_chunks", 1)
    if chunks == 1:
        return sequence_parallel.to_sequence_shards(attend(*sequence_parallel.to_head_shards([q, k, v]), sinks)), None
    layout = ChunkLayout(q.shape[2], k.shape[2], sequence_parallel.size, chunks)
    return HeadChunkedAttention.apply(attend, sequence_parallel, layout, q, k, v, sinks), None


def route_own_exchange(model, sequence_parallel, head_chunks: int = 1) -> int:
    """Point every layer of OWN_EXCHANGE_CLASSES under sp, and with head_chunks > 1 every attention layer (its
    heads then go through in chunks), at ULYSSES_OWN (its own copy of the config names it) with the kernel the model
    was built with; returns how many layers run through it. A layer routed before keeps its kernel and takes the
    new chunk count."""
    from transformers import AttentionInterface

    layers = [m for m in model.modules() if module_layer_type(m) in (None, *ATTENTION_LAYER_TYPES) and (
              head_chunks > 1 and is_attention_module(m)
              or sequence_parallel.size > 1 and stock_class(m).__name__ in OWN_EXCHANGE_CLASSES)]
    if layers:
        AttentionInterface.register(ULYSSES_OWN, own_exchange_attention)
    for layer in layers:
        layer.head_chunks = head_chunks
        if hasattr(layer, "core_attention"):
            continue
        layer.core_attention = AttentionInterface._global_mapping[layer.config._attn_implementation]
        layer.sequence_parallel = sequence_parallel
        layer.config = copy.copy(layer.config)
        layer.config._attn_implementation = ULYSSES_OWN
    return len(layers)


def is_attention_module(module) -> bool:
    """Whether a module is a causal attention layer of transformers' (what calls the attention registry): each
    family's sets `is_causal` and `num_key_value_groups`."""
    return getattr(module, "is_causal", False) is True and hasattr(module, "num_key_value_groups")
