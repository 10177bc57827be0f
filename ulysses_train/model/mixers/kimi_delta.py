"""Kimi Linear (`kimi_linear`: Kimi Delta Attention layers, MLA full-attention layers, a mixture of experts) under
Ulysses, exactly.

Kimi Delta Attention (KDA) is a Gated DeltaNet whose decay is per channel (one per key dimension of each head)
instead of per head, with as many key heads as value heads. Like the Gated DeltaNet (gated_deltanet.py, whose
conv and document plumbing, recurrent.py, this module shares) it is independent per head: one all-to-all (the layer's
`SequenceParallel`, sequence_parallel.py) trades each rank's slice of the sequence (all heads) for the whole
sequence of `heads / sp` heads, carrying q, k, v, the forget gate's raw projection and beta's logits in one
message; the depthwise conv (the filters of those channels) and the recurrence run over the whole sequence; one
all-to-all brings the output back to the slice, where the sigmoid-gated RMSNorm and `o_proj` run. The decay
`-exp(A_log) * softplus(gate + dt_bias)` is computed after the exchange from the rank's heads' `A_log` and
`dt_bias` (on CUDA inside fla's kernel: `use_gate_in_kernel`). sp must divide the KDA heads
(`kimi_delta_sp_problem`).

The math is transformers' own: on CPU its torch functions (`causal_conv1d_fn`, `chunk_kimi_delta_attention`,
unwrapped from the hub-kernel decorator) per document; on CUDA flash-linear-attention's kernels by name
(`fla.ops.kda.chunk_kda`, `fla.modules.causal_conv1d`) with `cu_seqlens`. Packed documents (`cu_seq_lens_q`)
restart the conv and the recurrence. The conv filter and the forget gate's `A_log` and `dt_bias` are read directly
(their modules' forwards do not run), so they are registered with ZeRO-3 as external parameters of the layer.

MLA layers (Kimi's full attention: DeepSeek-V3's multi-head latent attention without RoPE) are attention's: their
q, k and v of their own widths are exchanged by mixers/attention.py (install_attention). The experts route per token (exact on any slice); Kimi's router has no auxiliary loss (its
`e_score_correction_bias` is a buffer, not trained here, as in transformers)."""
from __future__ import annotations

import importlib.util
from typing import Optional

import torch

import ulysses_train.model.mixers.recurrent as recurrent
from ulysses_train.kernel_pins import INSTALL_LINE
from ulysses_train.families import linear_mixer_types
from ulysses_train.model.mixers.protocol import HeadCounts, Mixer
from ulysses_train.model.swap import stock_class, swap_class
from ulysses_train.sequence_parallel import SequenceParallel

NAME = "kimi_delta"
KIMI_TYPES = linear_mixer_types(NAME)
"""Text-model types whose `linear_attention` layers are Kimi Delta Attention, from the family records
(Family.linear_mixer)."""
KDA_CLASSES = ("KimiLinearDeltaAttention", "Glm5NextTextLinearAttention")
"""Kimi Linear's KDA layer and GLM-5.3-Flash's, the same but for its bounded decay (kda_decay)."""


def kda_head_units(text) -> dict:
    """{"heads": KDA heads} of a Kimi Linear config (as many key as value heads); {} without KDA layers."""
    return {"heads": text.linear_num_heads} if KIMI_DELTA.in_model(text) else {}


def kda_planner_dims(text) -> dict:
    """The head widths the planner's KDA terms read (planner/kda_layer.py: keys and values one width); {}."""
    if not KIMI_DELTA.in_model(text):
        return {}
    return {"key head dim": text.linear_head_dim, "value head dim": text.linear_head_dim}


def kimi_delta_sp_problem(counts: HeadCounts, sp: int, key: str) -> Optional[str]:
    heads = counts.of(KIMI_DELTA.name).get("heads")
    if not heads or heads % sp == 0:
        return None
    return (f"the model's Kimi Delta Attention layers have {heads} heads, not divisible by {key}={sp}: "
            f"each rank runs the whole sequence of heads/sp of them")


def kda_kernels_available() -> bool:
    return recurrent.fla_available() and importlib.util.find_spec("fla.ops.kda") is not None


def check_kda_kernels(hf_config, seq_length: int, cuda: bool) -> None:
    """Before the model loads: a GPU run past recurrent.TORCH_RULE_LIMIT tokens needs fla's KDA kernels
    (transformers' torch fallback loops over 64-token chunks)."""
    recurrent.check_torch_fallback_length("Kimi Delta Attention", seq_length, cuda, kda_kernels_available(),
                                          "flash-linear-attention's KDA kernels (module fla.ops.kda) are",
                                          f"{INSTALL_LINE} (or pip install 'fla-core>=0.4')")


def kda_decay(raw_gate, a_log, dt_bias, lower_bound=None):
    """transformers' forget gate after its projections, for the heads given, in fp32: Kimi's `-exp(A_log) *
    softplus(gate + dt_bias)` (softplus x = x above 20), or with a `lower_bound` (GLM-5.3-Flash's
    `safe_gate_lower_bound`) `lower_bound * sigmoid(exp(A_log) * (gate + dt_bias))`. raw_gate [B, T, h, dk],
    a_log [h], dt_bias [h, dk]."""
    g = raw_gate.float() + dt_bias.float()
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(a_log.float().exp()[:, None] * g)
    softplus = torch.where(g > 20.0, g, torch.log(1.0 + torch.exp(g)))
    return -a_log.float().exp()[:, None] * softplus


def kimi_delta_rule(module, q, k, v, raw_gate, beta, heads: slice, cu_seq_lens):
    """The chunked KDA rule (q, k L2-normalised in the kernel, scale 1/sqrt(dk)) of the heads given, a fresh state
    at every document. q, k, v, raw_gate [B, T, h, d], beta [B, T, h] (after its sigmoid)."""
    gate = module.forget_gate
    a_log, dt_bias = gate.A_log.reshape(-1)[heads], gate.dt_bias.reshape(-1, module.head_dim)[heads]
    lower_bound = getattr(gate, "safe_gate_lower_bound", None)
    if recurrent.runs_fla(module):
        from fla.ops.kda import chunk_kda

        cu = None if cu_seq_lens is None else cu_seq_lens.to(q.device, torch.long)
        return chunk_kda(q, k, v, raw_gate, beta, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                         A_log=a_log.float(), dt_bias=dt_bias.reshape(-1).float(), cu_seqlens=cu,
                         safe_gate=lower_bound is not None, lower_bound=lower_bound)[0]
    g = kda_decay(raw_gate, a_log, dt_bias, lower_bound)
    rule = recurrent.torch_function(module, "chunk_kimi_delta_attention")
    return recurrent.per_document(lambda *pieces: rule(*pieces[:3], g=pieces[3], beta=pieces[4],
                                                       use_qk_l2norm_in_kernel=True)[0], [q, k, v, g, beta], cu_seq_lens)


def ulysses_kimi_delta_forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
    """The KDA layer's forward on this rank's slice of the sequence (module docstring); training only (no cache;
    padding sits after every real token of a causal layer, so no mask)."""
    if cache is not None or kwargs.get("cache_params") is not None:
        raise RuntimeError("the Ulysses Kimi Delta Attention forward is for training: no cache")
    batch, length, _ = hidden_states.shape
    sequence_parallel = recurrent.sequence_parallel_of(self)
    sp, rank = sequence_parallel.size, sequence_parallel.rank
    shape = (batch, length, -1, self.head_dim)
    q, k, v = (proj(hidden_states).view(shape) for proj in (self.q_proj, self.k_proj, self.v_proj))
    raw_gate = self.forget_gate.f_b_proj(self.forget_gate.f_a_proj(hidden_states)).view(shape)
    beta = self.b_proj(hidden_states)
    q, k, v, raw_gate, beta = sequence_parallel.to_head_shards([q, k, v, raw_gate, beta])  # [B, T, H/sp, (d)]
    heads = slice(rank * self.num_heads // sp, (rank + 1) * self.num_heads // sp)
    cu_seq_lens = kwargs.get("cu_seq_lens_q")
    mixed = torch.cat([x.flatten(2) for x in (q, k, v)], dim=-1)  # [B, T, 3*H/sp*d]: q | k | v channels
    channels = recurrent.local_channels((self.qkv_dim,) * 3, rank, sp) if sp > 1 else None
    weight = recurrent.owned_filters(self.conv1d.weight.squeeze(1), channels)
    mixed = recurrent.causal_conv(self, mixed, weight, cu_seq_lens)
    q, k, v = (x.reshape(batch, mixed.shape[1], -1, self.head_dim) for x in mixed.chunk(3, dim=-1))  # [B,T,H/sp,d]
    core = sequence_parallel.to_sequence_shards(kimi_delta_rule(self, q, k, v, raw_gate, beta.sigmoid(), heads,
                                                                cu_seq_lens))
    out_gate = self.g_b_proj(self.g_a_proj(hidden_states)).view(shape)  # [B, t, H, d]
    return self.o_proj(self.o_norm(core, out_gate).reshape(batch, length, -1))  # [B, t, H*d] -> [B, t, hidden]


def kimi_deltas(model) -> list:
    return [m for m in model.modules() if stock_class(m).__name__ in KDA_CLASSES]


KDA_VARIANTS = {recurrent.TORCH: "transformers' torch conv1d, chunked KDA rule and gated RMSNorm",
                "fla": "fla's causal conv1d and chunk_kda, transformers' gated RMSNorm"}
"""Kimi Delta Attention's kernel variants (Mixer.kernel_variants), in words for the `model changes:` line."""


def choose_kda_kernel(dims: dict, cuda: bool) -> str:
    """fla's chunk_kda on a GPU run with fla.ops.kda installed; transformers' torch functions elsewhere."""
    return recurrent.fla_or_torch(cuda, kda_kernels_available(), "fla")


def install_kimi_linear(model, sequence_parallel: SequenceParallel, variant: str) -> Optional[str]:
    """Give every KDA layer the forward above (exchanging through `sequence_parallel`) and its directly read
    weights as ZeRO-3 external parameters; the `model changes:` phrase (None: no KDA layer). Its MLA layers are
    attention's (mixers/attention.py install_attention)."""
    layers = kimi_deltas(model)
    for layer in layers:
        swap_class(layer, "Ulysses", forward=ulysses_kimi_delta_forward)
        layer.kernel_variant = variant
        layer.sequence_parallel = sequence_parallel
        recurrent.register_direct_weights(layer, [layer.conv1d.weight, layer.forget_gate.A_log,
                                                  layer.forget_gate.dt_bias])
    if not layers:
        return None
    return (f"{len(layers)} Kimi Delta Attention layers over the whole sequence of each rank's heads "
            f"({KDA_VARIANTS[variant]})")


KIMI_DELTA = Mixer(
    name=NAME,
    layer_types=("linear_attention",),
    model_types=KIMI_TYPES,
    module_classes=KDA_CLASSES,
    head_units=kda_head_units,
    planner_dims=kda_planner_dims,
    sp_problem=kimi_delta_sp_problem,
    sp_rule="sp divides the KDA heads: each rank runs the whole sequence of heads/sp of them (q, k and v heads "
            "alike); the MLA layers follow attention's rule on the query heads",
    check_kernels=check_kda_kernels,
    install=install_kimi_linear,
    kernel_variants=KDA_VARIANTS,
    choose_kernel=choose_kda_kernel,
    document_restarts="the conv and the recurrence restart at every document of `cu_seq_lens_q` (fla's "
                      "`cu_seqlens`; on CPU transformers' torch functions per document); MLA as attention",
    planned=True,
    planner_terms="planner/kda_layer.py kda_saved_per_token, kda_backward_extra_per_token, kda_exchange_width, "
                  "kda_forward_per_token (fla's chunk_kda: per-channel decay recomputed in its backward); the MLA "
                  "layers as attention with q/k and v head widths apart (ModelShape.value_head_dim); FLOPs: its "
                  "projections only, as the Gated DeltaNet's",
)
