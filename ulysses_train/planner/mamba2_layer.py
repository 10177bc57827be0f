"""What one Mamba2 layer's mixer holds per local token, recomputed and run backward, and in an evaluation forward
(Nemotron-H, Granite 4.0-H: model/mixers/mamba2.py with flash-linear-attention's causal conv1d and chunk_simple_gla,
transformers' gated RMSNorm). The rest of the layer (its norm; in Nemotron-H the layer has no MLP) is planned as in
any layer (planner/layer.py).

Widths: `I` = heads x head dim (x's, the gate's and the output's width), `H` heads, `N` the state size, `Gr` the
groups a rank's tokens carry per local token after the exchange (the groups, or sp when each group is repeated to
sp/groups ranks: mixers/mamba2.groups_per_rank_unit), `C = I + 2·Gr·N` the conv's channels, `b` the dtype size.
Under sp every term is the same per local token: after the all-to-all a rank holds the whole sequence of 1/sp of the
heads. Sizes read from fla 0.6.0's `fla/ops/simple_gla/chunk.py` (ChunkSimpleGLAFunction saves q, k, v, g and the
fp32 cumulative decay; its backward recomputes the chunk states h) and `fla/modules/causal_conv1d`."""
from __future__ import annotations

from ulysses_train.planner.linear_layer import FLA_CHUNK
from ulysses_train.planner.options import PlanOptions
from ulysses_train.planner.shapes import ModelShape

NAME = "mamba2"


def mamba2_widths(m: ModelShape, sp: int) -> tuple[int, int, int, int, int]:
    """(C, I, H, N, Gr) of the model's Mamba2 layers (module docstring)."""
    units, dims = m.head_counts.of(NAME), m.dims(NAME)
    heads, groups, state = units["heads"], units["groups"], dims["state"]
    width = heads * dims["head dim"]
    carried = groups if groups % sp == 0 else sp
    return width + 2 * carried * state, width, heads, state, carried


def mamba2_saved_per_token(m: ModelShape, o: PlanOptions) -> float:
    """Bytes per local token one recomputed Mamba2 mixer saves for backward (its input, the norm's output, counted
    with the norms):
    - the in_proj output's gate (the gated norm reads it) and the conv's input (x | B | C after the exchange: fla's
      causal_conv1d saves it; its output is split into views);
    - B and C expanded to heads (q = C, and B kept for k = dt·B's backward), k, v = x, the fp32 decay g and its
      chunk cumsum (chunk_simple_gla), dt's fp32 chain (softplus, clamp: ~4 fp32 per head);
    - the D skip's fp32 x and the fp32 scan output, and transformers' gated RMSNorm (fp32 throughout: its input and
      gate in fp32, the SiLU, the normalised rows, ~5 fp32 I-wide) with the bf16 output out_proj saves."""
    b = o.dtype_bytes
    c, width, heads, state, _ = mamba2_widths(m, o.sp)
    projections = b * width + b * c
    scan = 3 * b * heads * state + b * width + 4 * 2 * heads + 4 * 4 * heads
    output = 4 * width + 4 * width
    norm = 5 * 4 * width + b * width
    return projections + scan + output + norm


def mamba2_backward_extra_per_token(m: ModelShape, o: PlanOptions) -> float:
    """Extra bytes per local token at the Mamba2 mixer's backward peak, over all it saved: the larger of the gated
    norm's fp32 gradient chain (three fp32 I-wide, as the Gated DeltaNet's Hugging Face norm) with the fp32 gradient
    of the scan output, and chunk_simple_gla's backward (recomputed chunk states h and their gradients dh, N x P per
    head every FLA_CHUNK tokens each; dq, dk, dv in the dtype, fp32 dg) with the expanded B's gradient."""
    b = o.dtype_bytes
    c, width, heads, state, _ = mamba2_widths(m, o.sp)
    head_dim = m.dims(NAME)["head dim"]
    norm = 3 * 4 * width + 4 * width
    states = 2 * b * heads * state * head_dim / FLA_CHUNK
    rule = states + 2 * b * heads * state + b * width + 4 * 2 * heads + b * heads * state + 4 * width
    return max(norm, rule)


def mamba2_exchange_width(m: ModelShape, sp: int = 1) -> int:
    """Channels per token the Mamba2 all-to-all carries (x, B and C of the groups per rank, dt), the largest exchange
    (the output's way back carries I fp32 channels, 2·I in the dtype's units: counted in the same buffer size)."""
    c, width, heads, _, _ = mamba2_widths(m, sp)
    return max(c + heads, 2 * width)


def mamba2_forward_per_token(m: ModelShape, o: PlanOptions) -> float:
    """Bytes per local token of a Mamba2 mixer's forward under no_grad (planner/forward_only.py), beyond the residual
    stream: the in_proj output (gate, x | B | C, dt) held to the end, then the larger of the conv (its input and
    output), the scan (B and C expanded to heads, k, the output in the dtype and in fp32 with the D skip) and the
    gated norm (fp32 input, gate and normalised rows)."""
    b = o.dtype_bytes
    c, width, heads, state, _ = mamba2_widths(m, o.sp)
    held = b * (width + c + heads)
    scan = 3 * b * heads * state + b * width + 2 * 4 * width
    return held + max(2 * b * c, scan, 4 * 4 * width)
