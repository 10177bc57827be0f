"""What one indexed-attention layer's mixer holds per local token (DeepSeek Sparse Attention on MLA:
model/mixers/indexed_attention.py with the torch reference kernels of indexed_kernels.py), recomputed and run
backward, and in an evaluation forward. The rest of the layer (its two RMSNorms, its MLP or experts) is planned as in
any layer (planner/layer.py).

Widths (Mixer.planner_dims): `QL` the q latent (q_lora_rank), `R` the kv latent (kv_lora_rank), `r` the rotated
key part, `dn` the nope part of a q head, `dv` a value head, `H` query heads (every rank runs all of them for its
queries), `k` the keys each query attends to (index_topk), `D` the indexer's key width, `b` the dtype size. Under
sp each rank gathers the latent and the index keys of the whole sequence: sp x (R + r + D) per local token.

The reference attention (indexed_kernels.SparseLatentAttention) saves only its inputs, as a fused sparse-MLA kernel
does: the absorbed query and the gathered latent keys; each chunk of queries gathers its k chosen keys again in
backward. Its chunks (INDEX_SCORE_BUDGET for the indexer's scores, ATTENTION_PICK_BUDGET for a chunk's keys, fp32
probabilities and gradients) are working sets of a fixed size, spread here over the rank's tokens."""
from __future__ import annotations

from ulysses_train.model.mixers.indexed_kernels import ATTENTION_PICK_BUDGET, INDEX_SCORE_BUDGET
from ulysses_train.planner.layer import hf_norm_saved
from ulysses_train.planner.options import PlanOptions
from ulysses_train.planner.shapes import ModelShape

NAME = "indexed_attention"


def widths(m: ModelShape) -> tuple:
    """(QL, R, r, dn, dv, H, k, D, index heads) of the model's indexed layers."""
    d = m.dims(NAME)
    return (d["q latent"], d["latent"], d["rope"], d["nope"], d["value"], d["heads"], d["top k"], d["index width"],
            d["index heads"])


def indexed_saved_per_token(m: ModelShape, o: PlanOptions) -> float:
    """Bytes per local token one recomputed indexed layer saves for backward (its input norm counted with the norms):
    the q and kv latents' norms (Hugging Face's modules), the q latent (q_b_proj's input), q, the kv projection's
    output, the chosen indices (int64) and their visibility, the reference attention's inputs (the absorbed query
    [H, R + r] and the whole sequence's latent keys, sp x [R + r] a local token: indexed_kernels
    .SparseLatentAttention recomputes the rest), the latent output [H, R] (the value rows' input) and o_proj's input
    [H, dv]; and once per layer kv_b_proj's weight as the absorbed products read it (indexed_attention
    .latent_weights), spread over the rank's tokens."""
    b = o.dtype_bytes
    q_latent, latent, rope, nope, value, heads, top, _, _ = widths(m)
    norms = hf_norm_saved(m, o, 0) * (q_latent + latent)
    projections = b * (q_latent + heads * (nope + rope) + latent + rope)
    attention = b * heads * (latent + rope) + o.sp * b * (latent + rope) + 9 * top
    absorbed = b * latent * heads * (nope + value) / o.seq_local  # kv_b_proj's weight as the absorbed products take it
    return norms + projections + attention + b * heads * latent + b * heads * value + absorbed


def indexed_backward_extra_per_token(m: ModelShape, o: PlanOptions) -> float:
    """Extra bytes per local token at the layer's backward peak: the whole sequence's latent-key gradient (fp32,
    its cast, and the gather's exchange back: send and receive), the absorbed query's gradient, and one chunk's
    working set (its keys again, their fp32 copy and gradient, the fp32 probabilities and their gradients)."""
    b = o.dtype_bytes
    _, latent, rope, _, _, heads, _, _, _ = widths(m)
    whole = o.sp * (4 + 3 * b) * (latent + rope)
    return whole + b * heads * (latent + rope) + ATTENTION_PICK_BUDGET / o.seq_local


def indexed_exchange_width(m: ModelShape, o: PlanOptions) -> float:
    """Channels per local token of the layer's largest exchange: the gather of the latent and rotated key part
    (sp copies of the slice sent, the whole sequence received)."""
    _, latent, rope, _, _, _, _, _, _ = widths(m)
    return o.sp * (latent + rope)


def indexed_exchange_traffic(m: ModelShape, o: PlanOptions) -> tuple[float, float]:
    """(channels per local token sent, channels back) in one pass: the latent, the rotated key part and the index
    keys, sp copies of the slice each (SequenceParallel.gather_sequence); nothing comes back by heads."""
    _, latent, rope, _, _, _, _, width, _ = widths(m)
    return o.sp * (latent + rope + width), 0.0


def indexed_forward_per_token(m: ModelShape, o: PlanOptions) -> float:
    """Bytes per local token of an indexed layer's evaluation forward (planner/forward_only.py) beyond the residual
    stream: the input norm's output, q, the kv latent, the gathered latent and index keys of the whole sequence
    (and the latent keys joined), the chosen indices, the absorbed query and the latent output; then one indexer
    chunk's fp32 scores and one attention chunk's working set (fixed sizes, spread over the rank's tokens)."""
    b = o.dtype_bytes
    q_latent, latent, rope, nope, _, heads, top, width, _ = widths(m)
    held = b * (m.hidden + q_latent + heads * (nope + rope) + latent + rope) + 8 * top
    gathered = o.sp * b * (latent + rope + width)
    attention = 2 * b * heads * (latent + rope) + o.sp * b * (latent + rope)  # the query, its output, the keys
    return held + gathered + attention + (INDEX_SCORE_BUDGET + ATTENTION_PICK_BUDGET) / o.seq_local
