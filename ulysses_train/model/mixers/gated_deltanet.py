"""Gated DeltaNet layers (Qwen3.5, Qwen3.5-MoE, Qwen3-Next and OLMo-hybrid linear attention) under Ulysses, exactly.

A Gated DeltaNet layer is independent per head: its causal conv1d is depthwise (one filter per channel of q, k
and v) and its gated delta rule keeps one state per value head (each key head serves a group of consecutive
value heads). The sequence is the only coupling. So, as for attention, one all-to-all trades each rank's slice
of the sequence (all heads) for the whole sequence of `heads / sp` heads; the conv (the filters of those
channels) and the recurrence run over the whole sequence; one all-to-all brings back the slice with all heads,
and the gated RMSNorm and `out_proj` run on the slice. The projections (q, k, v, the output gate z, the per-head
`a` and `b` inputs of the decay and of beta) run on the slice before the exchange, which carries q, k, v, a and b
in one message. sp must divide the key heads (`key_head_sp_problem`; the registry's check_sp_splits_heads refuses
other sp with the allowed values): a rank's value heads then use only its own key heads.

The math is transformers' own: on CPU its torch functions (`causal_conv1d_fn`, `torch_chunk_gated_delta_rule`,
unwrapped from the hub-kernel decorator so nothing else is picked) run per document; on CUDA the
flash-linear-attention kernels (`fla` package: `chunk_gated_delta_rule`, `causal_conv1d`) by name, with
`cu_seqlens` for packed documents, never the O(T x chunk) torch loop. Document packing (`cu_seq_lens_q`, the
documents of the whole sequence, the same on every rank) restarts the conv and the recurrence at every document:
after the exchange each rank holds every document whole.

The conv filter is read directly (not through `conv1d`'s forward), so it is registered with ZeRO-3 as an external
parameter of the layer: gathered whenever the layer runs (forward, recompute, backward). Without sequence
parallelism the same forward runs with no exchange (so packed documents restart on CPU too, where transformers'
torch path refuses them).

The families differ only where the layer's own forward does (read from each transformers modeling file): how the
projections are laid out (local_projections: Qwen3.5's q|k|v in one matrix, Qwen3-Next's fused per key head,
OLMo-hybrid's separate `q_proj` ... `g_proj`), what the output norm and projection are called (output_modules), and
OLMo-hybrid's `allow_neg_eigval`, which doubles beta (range [0, 2]). The conv's channel order ([q | k | v]), the
decay `g`, the rule and the gated norm's math are the same in all of them."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

import ulysses_train.model.mixers.recurrent as recurrent
from ulysses_train.kernel_pins import INSTALL_LINE
from ulysses_train.families import linear_mixer_types
from ulysses_train.model.mixers.protocol import HeadCounts, Mixer
from ulysses_train.model.mixers.gated_deltanet_kernels import (GATED_DELTANET_VARIANTS, choose_gated_deltanet_kernel,
                                                              fused_gated_norm_forward)
from ulysses_train.model.swap import stock_class, swap_class
from ulysses_train.sequence_parallel import SequenceParallel

NAME = "gated_deltanet"
GATED_DELTANET_TYPES = linear_mixer_types(NAME)
"""Text-model types whose `linear_attention` layers are Gated DeltaNet (GATED_DELTANET_CLASSES), from the family
records (Family.linear_mixer), which train exactly under Ulysses (the whole sequence of a rank's heads after the
all-to-all). Other models' linear-attention layers (other recurrences) are refused (mixers.check_layer_types)."""
GATED_DELTANET_CLASSES = ("Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet", "Qwen3NextGatedDeltaNet",
                          "OlmoHybridGatedDeltaNet")
"""Their modules, whose forward this module replaces (checked against each one's transformers forward)."""


def check_linear_attention_kernels(hf_config, seq_length: int, cuda: bool) -> None:
    """Before the model loads: a GPU run of a Gated DeltaNet model past recurrent.TORCH_RULE_LIMIT tokens needs the
    flash-linear-attention kernels; with them, a Triton their backward accepts."""
    if not cuda or not GATED_DELTANET.in_model(hf_config):
        return
    if recurrent.fla_available():
        return recurrent.check_fla_backward()
    recurrent.check_torch_fallback_length("Gated DeltaNet (linear-attention)", seq_length, cuda, False,
                                          "the flash-linear-attention kernels (module fla) are",
                                          f"{INSTALL_LINE} (or pip install flash-linear-attention)")


def local_projections(self, hidden):
    """(q [B,t,K,dk], k [B,t,K,dk], v [B,t,V,dv], z [B,t,V,dv], b [B,t,V], a [B,t,V]) of this rank's slice, as
    the layer's own forward computes them (Qwen3-Next's fused, per-key-head-interleaved projections through its
    own `fix_query_key_value_ordering`; OLMo-hybrid's separate ones, its output gate `g_proj`)."""
    batch, length, _ = hidden.shape
    if hasattr(self, "in_proj_qkvz"):
        return self.fix_query_key_value_ordering(self.in_proj_qkvz(hidden), self.in_proj_ba(hidden))
    if hasattr(self, "g_proj"):
        q, k, v, z = (proj(hidden) for proj in (self.q_proj, self.k_proj, self.v_proj, self.g_proj))
        b, a = self.b_proj(hidden), self.a_proj(hidden)
    else:
        q, k, v = torch.split(self.in_proj_qkv(hidden), [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        z, b, a = self.in_proj_z(hidden), self.in_proj_b(hidden), self.in_proj_a(hidden)
    q, k = (x.reshape(batch, length, -1, self.head_k_dim) for x in (q, k))
    v, z = (x.reshape(batch, length, -1, self.head_v_dim) for x in (v, z))
    return q, k, v, z, b, a


def output_modules(self):
    """(the gated RMSNorm, the output projection) of the layer: `norm`, `out_proj` in Qwen3.5 and Qwen3-Next,
    `o_norm`, `o_proj` in OLMo-hybrid."""
    return (self.o_norm, self.o_proj) if hasattr(self, "o_norm") else (self.norm, self.out_proj)


def gated_delta_rule(module, q, k, v, g, beta, cu_seq_lens):
    """transformers' chunked gated delta rule (q, k L2-normalised in the kernel, scale 1/sqrt(dk)) with a fresh
    state at every document. q, k [B, T, K', dk], v [B, T, V', dv], g and beta [B, T, V']."""
    if recurrent.runs_fla(module):
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        cu = None if cu_seq_lens is None else cu_seq_lens.to(q.device, torch.long)
        return chunk_gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)[0]
    rule = recurrent.torch_function(module, "torch_chunk_gated_delta_rule")
    groups = v.shape[2] // q.shape[2]
    q, k = (x.repeat_interleave(groups, dim=2) if groups > 1 else x for x in (q, k))  # 5.17 repeats in the layer
    return recurrent.per_document(lambda *pieces: rule(*pieces[:3], g=pieces[3], beta=pieces[4],
                                                       use_qk_l2norm_in_kernel=True)[0], [q, k, v, g, beta], cu_seq_lens)


def ulysses_gated_deltanet_forward(self, hidden_states, cache=None, attention_mask=None, cache_params=None,
                                   **kwargs):
    """The layer's forward on this rank's slice of the sequence (module docstring). Training passes no attention
    mask (padding sits at the end of the sequence, after every real token of a causal layer) and no cache."""
    if cache is not None or cache_params is not None:
        raise RuntimeError("the Ulysses Gated DeltaNet forward is for training: no cache")
    batch, length, _ = hidden_states.shape
    sequence_parallel = recurrent.sequence_parallel_of(self)
    sp, rank = sequence_parallel.size, sequence_parallel.rank
    q, k, v, z, b, a = local_projections(self, hidden_states)  # [B, t, heads, d] / [B, t, value heads]
    q, k, v, b, a = sequence_parallel.to_head_shards([q, k, v, b, a])  # [B, T, heads/sp, d] / [B, T, V/sp]
    heads = slice(rank * self.num_v_heads // sp, (rank + 1) * self.num_v_heads // sp)
    cu_seq_lens = kwargs.get("cu_seq_lens_q")
    mixed = recurrent.side_by_side(q, k, v)  # [B, T, C/sp]: the rank's q | k | v channels
    channels = recurrent.local_channels((self.key_dim, self.key_dim, self.value_dim), rank, sp) if sp > 1 else None
    weight = recurrent.owned_filters(self.conv1d.weight.squeeze(1), channels)  # [C/sp, W]
    mixed = recurrent.causal_conv(self, mixed, weight, cu_seq_lens)
    q, k, v = torch.split(mixed, [x[0, 0].numel() for x in (q, k, v)], dim=-1)
    total = mixed.shape[1]
    q, k = (x.reshape(batch, total, -1, self.head_k_dim) for x in (q, k))  # [B, T, K/sp, dk]
    v = v.reshape(batch, total, -1, self.head_v_dim)  # [B, T, V/sp, dv]
    beta = b.sigmoid() * 2.0 if getattr(self, "allow_neg_eigval", False) else b.sigmoid()
    g = -self.A_log[heads].float().exp() * F.softplus(a.float() + self.dt_bias[heads])
    core = sequence_parallel.to_sequence_shards(gated_delta_rule(self, q, k, v, g, beta, cu_seq_lens))
    norm, out_proj = output_modules(self)
    core = norm(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))  # [B*t*V, dv]: per value head
    return out_proj(core.reshape(batch, length, -1))  # [B, t, V*dv] -> [B, t, hidden]


def gated_deltanets(model) -> list:
    return [m for m in model.modules() if stock_class(m).__name__ in GATED_DELTANET_CLASSES]


def apply_gated_deltanet_ulysses(model, sequence_parallel: SequenceParallel, variant: str) -> int:
    """Give every Gated DeltaNet layer the forward above (exchanging through `sequence_parallel`), its conv filter
    as a ZeRO-3 external parameter of the layer, the kernel variant chosen for the run (GATED_DELTANET_VARIANTS)
    and with fla's kernels its gated norm fla's fused kernel (gated_deltanet_kernels.py); returns how many layers
    changed."""
    layers = gated_deltanets(model)
    for layer in layers:
        swap_class(layer, "Ulysses", forward=ulysses_gated_deltanet_forward)
        layer.kernel_variant = variant
        if recurrent.runs_fla(layer):
            swap_class(output_modules(layer)[0], "Fused", forward=fused_gated_norm_forward)
        layer.sequence_parallel = sequence_parallel
        recurrent.register_direct_weights(layer, [layer.conv1d.weight])
    return len(layers)


def gated_deltanet_head_units(text) -> dict:
    """{"key heads", "value heads"} of the model's Gated DeltaNet layers; {} without any."""
    if not GATED_DELTANET.in_model(text):
        return {}
    return {"key heads": text.linear_num_key_heads, "value heads": text.linear_num_value_heads}


def gated_deltanet_planner_dims(text) -> dict:
    """The head widths the planner's Gated DeltaNet terms read (planner/linear_layer.py); {} without the layers."""
    if not GATED_DELTANET.in_model(text):
        return {}
    return {"key head dim": text.linear_key_head_dim, "value head dim": text.linear_value_head_dim}


def key_head_sp_problem(counts: HeadCounts, sp: int, key: str) -> Optional[str]:
    """Why sp cannot split the model's Gated DeltaNet heads, or None."""
    units = counts.of(GATED_DELTANET.name)
    if not units or units["key heads"] % sp == 0:
        return None
    return (f"the model's linear-attention (Gated DeltaNet) layers have {units['key heads']} key heads and "
            f"{units['value heads']} value heads, not divisible by {key}={sp}: each rank runs the whole sequence of "
            f"key_heads/sp key heads and their value heads")


def install_gated_deltanet(model, sequence_parallel: SequenceParallel, variant: str) -> Optional[str]:
    """apply_gated_deltanet_ulysses, as the `model changes:` line says it (None: no such layer)."""
    layers = apply_gated_deltanet_ulysses(model, sequence_parallel, variant)
    if not layers:
        return None
    return (f"{layers} Gated DeltaNet layers over the whole sequence of each rank's heads "
            f"({GATED_DELTANET_VARIANTS[variant]})")


GATED_DELTANET = Mixer(
    name=NAME,
    layer_types=("linear_attention",),
    model_types=GATED_DELTANET_TYPES,
    module_classes=GATED_DELTANET_CLASSES,
    head_units=gated_deltanet_head_units,
    planner_dims=gated_deltanet_planner_dims,
    sp_problem=key_head_sp_problem,
    sp_rule="sp divides the key heads: each rank runs the whole sequence of key_heads/sp key heads and the value "
            "heads they serve, so the value heads (a multiple of the key heads) split with them",
    check_kernels=check_linear_attention_kernels,
    install=install_gated_deltanet,
    kernel_variants=GATED_DELTANET_VARIANTS,
    choose_kernel=choose_gated_deltanet_kernel,
    document_restarts="the conv and the recurrence restart at every document of `cu_seq_lens_q` (fla's "
                      "`cu_seqlens`; on CPU transformers' torch functions run per document)",
    planned=True,
    planner_terms="planner/linear_layer.py gated_deltanet_saved_per_token, gated_deltanet_backward_extra_per_token, "
                  "exchange_width, linear_forward_per_token; FLOPs: its projections only (the "
                  "recurrence is under 1% of 2·N per token: mixers.layer_windows gives it window 0)",
)
