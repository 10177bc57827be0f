"""What one Gated DeltaNet (linear-attention) layer's mixer holds per local token, recomputed and run backward
(Qwen3.5, Qwen3-Next: model/mixers/gated_deltanet.py with flash-linear-attention's kernels). The rest of the layer (its
two RMSNorms, its MLP) is planned as in any layer (planner/layer.py).

Widths: `C = 2·Kd + Vd` the conv's channels (q, k and v, Kd = key heads x key head dim, Vd = value heads x value
head dim), `Hv` value heads, `Hk` key heads, `b` the dtype size. Under sp every term is the same per local token:
after the all-to-all a rank holds the whole sequence of 1/sp of the channels."""
from __future__ import annotations

from ulysses_train.planner.options import PlanOptions
from ulysses_train.planner.shapes import ModelShape

FLA_CHUNK = 64
"""Tokens per chunk of fla's chunked gated delta rule: its WY matrix A holds one row of this many per token and
value head, its chunk states h one (key dim x value dim) matrix per value head every this many tokens."""


DELTA_RULE_MIXERS = ("gated_deltanet", "kimi_delta")
"""The mixers planned with these widths (Kimi Delta Attention's terms, planner/kda_layer.py, share them)."""


def delta_rule_heads(m: ModelShape) -> tuple:
    """(key heads, value heads, key head dim, value head dim) of the model's delta-rule layers, from the mixer's own
    head units and planner dims (Gated DeltaNet's key and value heads; KDA's heads, as many keys as values); ()
    without such layers."""
    for name in DELTA_RULE_MIXERS:
        units, dims = m.head_counts.of(name), m.dims(name)
        if units:
            key_heads = units.get("key heads", units.get("heads"))
            return key_heads, units.get("value heads", key_heads), dims["key head dim"], dims["value head dim"]
    return ()


def linear_widths(m: ModelShape) -> tuple[int, int, int, int, int]:
    """(C, Kd, Vd, Hk, Hv) of the model's Gated DeltaNet (or KDA) layers (module docstring)."""
    key_heads, value_heads, key_dim, value_dim = delta_rule_heads(m)
    kd, vd = key_heads * key_dim, value_heads * value_dim
    return 2 * kd + vd, kd, vd, key_heads, value_heads


def gated_deltanet_saved_per_token(m: ModelShape, o: PlanOptions) -> float:
    """Bytes per local token one recomputed Gated DeltaNet mixer saves for backward (its input, the norm's
    output, counted with the norms):
    - the conv's input (q, k, v mixed: fla's causal_conv1d saves it; its output is not kept);
    - fla's gated delta rule (inputs made contiguous): L2-normalized q and k and their fp32 norms, v, the WY
      matrix A (FLA_CHUNK per value head, bf16), the fp32 cumulative decay g, beta;
    - the decay's own small fp32 chain (softplus(a + dt_bias), exp(A_log) product): ~4 fp32 per value head;
    - the gated RMSNorm and the bf16 output out_proj saves (gated_norm_saved_per_token)."""
    b = o.dtype_bytes
    c, kd, vd, hk, hv = linear_widths(m)
    conv = b * c
    rule = b * 2 * kd + 4 * 2 * hk + b * vd + b * FLA_CHUNK * hv + 4 * hv + b * hv
    decay = 4 * 4 * hv
    return conv + rule + decay + gated_norm_saved_per_token(m, o)


def gated_norm_saved_per_token(m: ModelShape, o: PlanOptions) -> float:
    """The gated RMSNorm of the mixer's output and the bf16 output out_proj saves; freed before the rule's
    backward. fla's fused kernel (`o.fused_gated_norm`, model/mixers/gated_deltanet_kernels.py) saves its bf16 input and gate and
    one fp32 scale per row and value head; Hugging Face's module (fp32 throughout) the fp32 input, its bf16 cast,
    the weighted product, the fp32 gate and its SiLU."""
    _, _, vd, _, hv = linear_widths(m)
    b = o.dtype_bytes
    if o.fused_gated_norm:
        return 3 * b * vd + 4 * hv
    return 12 * vd + 3 * b * vd


def gated_norm_backward_per_token(m: ModelShape, o: PlanOptions) -> float:
    """The gated RMSNorm's backward above what it saved: fla's fused kernel the bf16 gradients of its input and
    gate; Hugging Face's module three fp32 Vd-wide gradients (measured on an H200 at Qwen3.5-9B's widths,
    fla_check.py --memory-lengths: 49,408 bytes per token against 12·Vd = 49,152)."""
    vd = linear_widths(m)[2]
    return 2 * o.dtype_bytes * vd if o.fused_gated_norm else 12 * vd


def gated_deltanet_backward_extra_per_token(m: ModelShape, o: PlanOptions) -> float:
    """Extra bytes per local token at the mixer's backward peak, over all it saved, whichever is larger of:
    - the gated RMSNorm's backward, everything still saved (gated_norm_backward_per_token);
    - fla's gated delta rule backward, once the gated norm's tensors are freed: it recomputes w and u
      (b·Hv·(dk + dv)) and the chunk states h (Hv·dk·dv·b per FLA_CHUNK tokens), then allocates the states'
      gradients dh (the same size), v_new, dv and its second copy, and dq, dk, dw, dk2; the output's gradient
      and the gate's (z) wait beside it; or FlashQLA's fused backward (variant flash_qla), which holds far less."""
    rule = (flash_qla_backward_per_token(m, o) if o.kernel("gated_deltanet") == "flash_qla"
            else fla_backward_per_token(m, o) - gated_norm_saved_per_token(m, o))
    return max(gated_norm_backward_per_token(m, o), rule)


def fla_backward_per_token(m: ModelShape, o: PlanOptions) -> float:
    """fla's Triton backward of the rule (gated_deltanet_backward_extra_per_token), the gate's gradient beside it,
    once the gated norm's saved tensors are freed (the caller subtracts them)."""
    b = o.dtype_bytes
    _, kd, vd, _, hv = linear_widths(m)
    key_dim, value_dim = delta_rule_heads(m)[2:]
    states = chunk_states_per_token(m, o)
    recomputed = b * hv * (key_dim + value_dim) + states + b * vd  # w, u, h, v_new
    gradients = states + 3 * b * vd + 2 * b * 2 * kd + b * hv * key_dim  # dh; dv, dv2, do; dq, dk (x2); dw
    return recomputed + gradients + b * vd


def flash_qla_backward_per_token(m: ModelShape, o: PlanOptions) -> float:
    """FlashQLA's fused backward of the rule: no chunk states or w, u held at once, so the gradients of q, k and
    v, the output's and the gate's, and one WY-matrix row per value head (b·(2·Kd + 3·Vd) + b·Hv·FLA_CHUNK);
    measured on an H200 at Qwen3.5-9B's widths with the fused gated norm (fla_check.py --memory-lengths,
    benchmarks/results/hybrid/fla_kernels_flashqla.json): 37,264 bytes per token above what it saved, against
    36,864 here."""
    b = o.dtype_bytes
    _, kd, vd, _, hv = linear_widths(m)
    return b * (2 * kd + 3 * vd) + b * hv * FLA_CHUNK


def exchange_width(m: ModelShape) -> int:
    """Channels per token the Gated DeltaNet all-to-all carries (q, k, v, a, b), the largest exchange."""
    c, _, _, _, hv = linear_widths(m)
    return c + 2 * hv


def linear_forward_per_token(m: ModelShape, o: PlanOptions) -> float:
    """Bytes per local token of a Gated DeltaNet mixer's forward (planner/forward_only.py; model/mixers/gated_deltanet.py,
    fla's kernels), beyond the residual stream. Held from the projections to the end: the input norm's output, z, a
    and b, and the conv's output (q, k and v stay views of it until the layer returns). Then the largest of three
    moments:
    - the conv: its input (q, k, v concatenated) beside the projections' (or the exchange's) q, k, v;
    - fla's gated delta rule: contiguous copies of q, k, v, L2-normalized q and k with their fp32 norms, the fp32
      decay, the WY matrix A, w and u, the chunk states h (FLA_CHUNK), v_new and the output;
    - the gated RMSNorm: the rule's output and the norm's fp32 tensors (gated_norm_saved_per_token).
    Per local token the same under any sp (a rank then holds the whole sequence of 1/sp of the channels)."""
    b = o.dtype_bytes
    c, kd, vd, hk, hv = linear_widths(m)
    key_dim, value_dim = delta_rule_heads(m)[2:]
    held = b * m.hidden + b * (vd + 2 * hv) + b * c
    rule = (b * c + b * 2 * kd + 4 * 2 * hk + 4 * hv + b * FLA_CHUNK * hv + b * hv * (key_dim + value_dim)
            + chunk_states_per_token(m, o) + 2 * b * vd)
    return held + max(2 * b * c, rule, b * vd + gated_norm_saved_per_token(m, o))


def chunk_states_per_token(m: ModelShape, o: PlanOptions) -> float:
    """fla's chunk states h per local token: one (key dim x value dim) matrix per value head every FLA_CHUNK tokens,
    in the dtype (its recurrence's saved and recomputed states, and their gradients dh: the same size)."""
    key_dim, value_dim = delta_rule_heads(m)[2:]
    return o.dtype_bytes * linear_widths(m)[4] * key_dim * value_dim / FLA_CHUNK
