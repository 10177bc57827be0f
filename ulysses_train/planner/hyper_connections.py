"""Planner terms of hyper-connected residual streams (HY-V4's `hc_mult` streams, transformers' HYV4HyperConnection
and HYV4DecoderLayer, read in transformers 5.25): each token carries `hc_mult` copies of the hidden state between
layers, [B, t, hc, hidden] in the training dtype. Each layer mixes them down to one hidden state before its attention
and its MLP (a hyper-connection: pre weights from an fp32 linear over all streams) and adds the block's output back
into every stream (post weights), in fp32. All of it is token-local, so nothing is exchanged under sp.

What it costs in memory, per local token (b: the training dtype's bytes, h: hidden, n: streams):
- the checkpoint of each layer (its input) and the gradient arriving at its output are n x as wide (estimate.py
  multiplies them by `ModelShape.residual_streams`);
- a recomputed layer saves, for its backward, what each hyper-connection saves beyond its input (own_saved:
  measured on the model's module; HY-V4's fp32 copy of the flattened streams, 4 n h, used by its linear and its
  norm; GLM-5.3-Flash's Sinkhorn form saves about twice that), each block output's fp32 copy the post weights
  multiply (4 h), and the streams between the two blocks (b n h): `saved_per_token`;
- the backward holds the streams' gradient in the training dtype (b n h) beside what is still saved.
The model's final hyper-connection head saves one more fp32 copy of the streams (4 n h) at the loss."""
from __future__ import annotations


def streams_of(m) -> int:
    """Residual streams per token (ModelShape.residual_streams; 1: a plain residual)."""
    return m.residual_streams


def own_saved(m) -> float:
    """What one hyper-connection saves beyond its input streams, per token: measured on the model's module
    (ModelShape.hc_saved: GLM-5.3-Flash's two fp32 copies of the streams and its Sinkhorn iterations), else HY-V4's
    fp32 copy of the flattened streams (4 n h)."""
    return m.hc_saved or 4 * streams_of(m) * m.hidden


def saved_per_token(m, dtype_bytes: int) -> float:
    """What a recomputed layer's hyper-connections save for backward, per local token (module docstring)."""
    n, h = streams_of(m), m.hidden
    return 0 if n == 1 else 2 * own_saved(m) + 2 * 4 * h + dtype_bytes * n * h


def layer_moments(m, dtype_bytes: int) -> dict:
    """Per local token, at each moment of a recomputed layer's backward (estimate.LAYER_MOMENTS): the MLP's (the
    MLP-side update's fp32 output copy freed, the streams' gradient held), the post-attention norm's (the MLP-side
    hyper-connection freed too) and the mixer's (only the attention-side hyper-connection's saves left)."""
    n, h, b = streams_of(m), m.hidden, dtype_bytes
    if n == 1:
        return {"mlp": 0, "norm": 0, "attn": 0}
    return {"mlp": saved_per_token(m, b) - 4 * h + b * n * h, "norm": own_saved(m) + 4 * h + b * n * h,
            "attn": own_saved(m) + b * n * h}


def head_saved_per_token(m) -> int:
    """The final hyper-connection head's fp32 copy of the streams, held at the loss (0 without streams)."""
    n = streams_of(m)
    return 0 if n == 1 else 4 * n * m.hidden
