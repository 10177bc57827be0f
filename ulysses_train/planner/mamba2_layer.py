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
    with the norms; the in_proj output is not kept: its parts are cast, concatenated or exchanged):
    - fla's causal conv1d: its input (x | B | C after the exchange) and its output (x, B and C are views of it);
    - the scan's inputs (decay_scan_saved_per_token);
    - the D skip's fp32 x, and transformers' gated RMSNorm, fp32 throughout: its input (the fp32 scan output), the
      fp32 gate and its SiLU, their product, the normalised rows; and the bf16 output out_proj saves.
    Measured with chunk_gla on an H200 (benchmarks/RESULTS.md, "Mamba2"): 226,208 bytes per token at Nemotron 3
    Nano's widths."""
    b = o.dtype_bytes
    c, width, heads, _, _ = mamba2_widths(m, o.sp)
    conv = 2 * b * c
    norm = 5 * 4 * width + b * width
    return conv + decay_scan_saved_per_token(m, o) + 4 * width + norm


def decay_scan_saved_per_token(m: ModelShape, o: PlanOptions) -> float:
    """What the SSD as fla's kernel saves per local token: B and C expanded to heads (q = C, and B for k = dt·B's
    backward) and k; dt's small fp32 chain (softplus, clamp, the decay: ~6 fp32 per head); with chunk_gla
    (variant chunk_gla) the per-channel fp32 decay (one such tensor found at run time, where fla's code
    keeps the decay and its chunk cumsum) and its fp32 intra-chunk scores (FLA_CHUNK per head); with
    chunk_simple_gla the per-head decay and its cumsum (not yet measured: Triton 3.7.1 or newer)."""
    b = o.dtype_bytes
    _, _, heads, state, _ = mamba2_widths(m, o.sp)
    expanded = 3 * b * heads * state + 4 * 6 * heads
    if o.kernel("mamba2") == "chunk_gla":
        return expanded + 4 * heads * state + 4 * FLA_CHUNK * heads
    return expanded + 2 * 4 * heads


def mamba2_backward_extra_per_token(m: ModelShape, o: PlanOptions) -> float:
    """Extra bytes per local token at the Mamba2 mixer's backward peak, over all it saved, the larger of:
    - the gated norm's fp32 gradient chain (three fp32 I-wide, as the Gated DeltaNet's Hugging Face norm) with the
      fp32 gradient of the scan output;
    - fla's scan backward: the recomputed chunk states h and their gradients dh (fp32, N x P per head every
      FLA_CHUNK tokens each), the fp32 gradients of q and k (N per head each), dv and the incoming do (I each, in
      the dtype), with chunk_gla its fp32 gradient of the intra-chunk scores (FLA_CHUNK per head).
    Measured with chunk_gla on an H200: 170,308-171,154 bytes per token at Nemotron 3 Nano's widths."""
    b = o.dtype_bytes
    _, width, heads, state, _ = mamba2_widths(m, o.sp)
    head_dim = m.dims(NAME)["head dim"]
    norm = 3 * 4 * width + 4 * width
    states = 2 * 4 * heads * state * head_dim / FLA_CHUNK
    scores = 4 * FLA_CHUNK * heads if o.kernel("mamba2") == "chunk_gla" else 0
    rule = states + 2 * 4 * heads * state + 2 * b * width + scores
    return max(norm, rule)


def mamba2_exchange_width(m: ModelShape, sp: int = 1) -> int:
    """Channels per token the Mamba2 all-to-all carries (x, B and C of the groups per rank, dt), the largest exchange
    (the output's way back carries I fp32 channels, 2·I in the dtype's units: counted in the same buffer size)."""
    c, width, heads, _, _ = mamba2_widths(m, sp)
    return max(c + heads, 2 * width)


def mamba2_exchange_traffic(m: ModelShape, o: PlanOptions) -> tuple[int, int]:
    """(channels per local token to the head layout, channels back) in one pass of the Mamba2 all-to-alls
    (planner/exchange_time.py): x, B, C and dt, then the output (I fp32 channels, 2·I in the dtype's units)."""
    c, width, heads, _, _ = mamba2_widths(m, o.sp)
    return c + heads, 2 * width


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
