"""What one Kimi Delta Attention (KDA) layer's mixer holds per local token, recomputed and run backward, and in an
evaluation forward (Kimi Linear: model/mixers/kimi_delta.py with flash-linear-attention's `chunk_kda` and causal
conv1d, transformers' gated RMSNorm). The rest of the layer (its two RMSNorms, its experts) is planned as in any
layer (planner/layer.py).

KDA is a Gated DeltaNet (linear_layer.py, whose widths and chunk-state size this module reuses) whose decay is per
channel: one gate value per key channel per token (`-exp(A_log) * softplus(g + dt_bias)`, computed inside fla's
kernel from the raw gate: `use_gate_in_kernel`) instead of one per head, with as many key heads as value heads.
Sizes are read from fla 0.6.0's `fla/ops/kda` (chunk.py ChunkKDAFunction, chunk_fwd.py, chunk_bwd.py chunk_kda_bwd,
chunk_intra.py, wy_fast.py recompute_w_u_fwd, gate.py) and transformers' `modeling_kimi_linear.py`.

Widths (linear_layer.linear_widths): `C = 2·Kd + Vd` the conv's channels (q, k and v), `Kd` = heads x key head dim
(also the raw gate's width), `Vd` = heads x value head dim, `H` heads, `dk` the key head dim (the low-rank gate
projections' rank), `b` the dtype size. Under sp every term is the same per local token: after the all-to-all a rank
holds the whole sequence of 1/sp of the channels."""
from __future__ import annotations

from ulysses_train.planner.linear_layer import FLA_CHUNK, chunk_states_per_token, delta_rule_heads, linear_widths
from ulysses_train.planner.options import PlanOptions
from ulysses_train.planner.shapes import ModelShape

TRITON_KEY_BLOCK = 32
"""fla's chunk_kda_bwd_intra splits the key dim into blocks of (at most) this many channels and writes one fp32 beta
gradient per block, summed after."""


def kda_saved_per_token(m: ModelShape, o: PlanOptions) -> float:
    """Bytes per local token one recomputed KDA mixer saves for backward (its input, the norm's output, counted with
    the norms):
    - the conv's input (q, k, v concatenated: fla's CausalConv1dFunction saves x; its output is not kept);
    - the low-rank gate projections' inner activations (f_b_proj's and g_b_proj's inputs, dk wide each) and beta
      (its sigmoid's output, which the rule saves too);
    - fla's ChunkKDAFunction (use_gate_in_kernel, use_qk_l2norm_in_kernel): L2-normalized q and k and their fp32
      rstd (one per head), v, the raw gate (Kd wide, bf16: the decay and its chunk cumsum are recomputed in
      backward), and the intra-chunk matrices Aqk and Akk (FLA_CHUNK per token and head each, in the dtype);
    - the gated RMSNorm (kda_norm_saved_per_token)."""
    b = o.dtype_bytes
    c, kd, vd, _, heads = linear_widths(m)
    key_dim = delta_rule_heads(m)[2]
    conv = b * c
    gate_inputs = b * 2 * key_dim + b * heads
    rule = b * 2 * kd + 4 * 2 * heads + b * vd + b * kd + 2 * b * FLA_CHUNK * heads
    return conv + gate_inputs + rule + kda_norm_saved_per_token(m, o)


def kda_norm_saved_per_token(m: ModelShape, o: PlanOptions) -> float:
    """transformers' KimiLinearRMSNormGated (fp32 throughout, sigmoid gate) over the rule's output: the fp32 upcast
    (pow's input), the normalized and the weighted rows (the multiplications' inputs), the gate's fp32 sigmoid, and
    the bf16 output o_proj saves. Freed (its backward done) before the rule's backward."""
    vd = linear_widths(m)[2]
    return 4 * 4 * vd + o.dtype_bytes * vd


def kda_backward_extra_per_token(m: ModelShape, o: PlanOptions) -> float:
    """Extra bytes per local token at the KDA mixer's backward peak, over all it saved, the larger of:
    - the gated RMSNorm's backward, everything still saved: its fp32 gradient chain, three Vd-wide fp32 tensors
      (as the Gated DeltaNet's Hugging Face norm: linear_layer.gated_norm_backward_per_token);
    - fla's chunk_kda_bwd, once the norm's tensors are freed (kda_rule_backward_per_token)."""
    vd = linear_widths(m)[2]
    return max(12 * vd, kda_rule_backward_per_token(m, o) - kda_norm_saved_per_token(m, o))


def kda_rule_backward_per_token(m: ModelShape, o: PlanOptions) -> float:
    """chunk_kda_bwd at its peak, chunk_kda_bwd_intra, where everything it allocated before is still referenced by
    its locals:
    - recomputed: the decay's chunk cumsum g (fp32, Kd), w, qg, kg (Kd each) and u (Vd) (recompute_w_u_fwd), the
      chunk states h and v_new (chunk_gated_delta_rule_fwd_h);
    - gradients: dAqk and dAkk (fp32, FLA_CHUNK per head), the states' gradient dh, dv (one alive: each stage's
      replaces the previous one's), the fp32 dq, dk, dg (wy_dqkg_fused) and their second fp32 copies dq2, dk2, dg2
      (intra), the fp32 beta gradients (one per key block, and the sum);
    - beside it the output's gradient (do). The output gate's gradient is gone by then: the gate is computed after
      the rule in the forward (kimi_delta.ulysses_kimi_delta_forward), so autograd runs its backward first."""
    b = o.dtype_bytes
    _, kd, vd, _, heads = linear_widths(m)
    key_blocks = -(-delta_rule_heads(m)[2] // TRITON_KEY_BLOCK)
    recomputed = 4 * kd + 3 * b * kd + b * vd + chunk_states_per_token(m, o) + b * vd
    gradients = (2 * 4 * FLA_CHUNK * heads + chunk_states_per_token(m, o) + b * vd + 6 * 4 * kd
                 + 4 * heads * (key_blocks + 1))
    return recomputed + gradients + b * vd


def kda_exchange_width(m: ModelShape) -> int:
    """Channels per token the KDA all-to-all carries (q, k, v, the raw gate, beta's logits), its largest exchange."""
    c, kd, _, _, heads = linear_widths(m)
    return c + kd + heads


def kda_forward_per_token(m: ModelShape, o: PlanOptions) -> float:
    """Bytes per local token of a KDA mixer's forward (planner/forward_only.py), beyond the residual stream. Held
    from the projections to the end: the input norm's output, the raw gate, beta, and the conv's output (q, k and v
    stay views of it). Then the larger of three moments:
    - the conv: its input beside the projections' (or the exchange's) q, k, v;
    - fla's chunk_kda forward: contiguous copies of q, k, v, L2-normalized q and k with their fp32 rstd, the fp32
      decay cumsum, Aqk and Akk, w, u, kg, the chunk states h, v_new and the output;
    - the gated RMSNorm: the rule's output, the output gate and three fp32 Vd-wide temporaries."""
    b = o.dtype_bytes
    c, kd, vd, _, heads = linear_widths(m)
    held = b * m.hidden + b * (kd + heads) + b * c
    rule = (b * c + b * 2 * kd + 4 * 2 * heads + 4 * kd + 2 * b * FLA_CHUNK * heads + b * (2 * kd + vd)
            + chunk_states_per_token(m, o) + 2 * b * vd)
    return held + max(2 * b * c, rule, 2 * b * vd + 12 * vd)
