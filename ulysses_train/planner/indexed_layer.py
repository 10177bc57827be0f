"""What one indexed-attention layer's mixer holds per local token (DeepSeek Sparse Attention on MLA:
model/mixers/indexed_attention.py with the torch reference kernels of indexed_kernels.py), recomputed and run
backward, and in an evaluation forward. The rest of the layer (its two RMSNorms, its MLP or experts) is planned as in
any layer (planner/layer.py).

Widths (Mixer.planner_dims): `QL` the q latent (q_lora_rank), `R` the kv latent (kv_lora_rank), `r` the rotated
key part, `dn` the nope part of a q head, `dv` a value head, `H` query heads (every rank runs all of them for its
queries), `k` the keys each query attends to (index_topk), `D` the indexer's key width, `b` the dtype size. Under
sp each rank gathers the latent and the index keys of the whole sequence: sp x (R + r + D) per local token.

The reference attention gathers each query's k chosen keys ([k, R + r] a query) and keeps them for backward, with
its fp32 probabilities ([H, k]): what a fused sparse-MLA kernel (saving q, the latent, the output and one
log-sum-exp per head) would not hold. Its chunks of queries (INDEX_SCORE_BUDGET, ATTENTION_PICK_BUDGET) are
working sets of a fixed size, spread here over the rank's tokens."""
from __future__ import annotations

from ulysses_train.model.mixers.indexed_kernels import ATTENTION_PICK_BUDGET, INDEX_SCORE_BUDGET
from ulysses_train.planner.layer import hf_norm_saved
from ulysses_train.planner.options import PlanOptions
from ulysses_train.planner.shapes import ModelShape

NAME = "indexed_attention"


def widths(m: ModelShape) -> tuple:
    """(QL, R, r, dn, dv, H, k, D, index heads) of the model's indexed layers."""
    d = m.dims(NAME)
    return (d["q latent"], d["latent"], d["rope"], d["nope"], d["value"], m.heads, d["top k"], d["index width"],
            d["index heads"])


def indexed_saved_per_token(m: ModelShape, o: PlanOptions) -> float:
    """Bytes per local token one recomputed indexed layer saves for backward (its input norm counted with the norms):
    the q and kv latents' norms (Hugging Face's modules), the q latent (q_b_proj's input), q, the kv projection's
    output, the absorbed query [H, R + r], the chosen keys [k, R + r] and the fp32 probabilities [H, k] (and their
    cast) of the reference attention, the chosen indices (int64) and their visibility, the latent output [H, R]
    (the value rows' input) and o_proj's input [H, dv]."""
    b = o.dtype_bytes
    q_latent, latent, rope, nope, value, heads, top, _, _ = widths(m)
    norms = hf_norm_saved(m, o, 0) * (q_latent + latent)
    projections = b * (q_latent + heads * (nope + rope) + latent + rope)
    attention = b * heads * (latent + rope) + b * top * (latent + rope) + (4 + b) * heads * top + 9 * top
    return norms + projections + attention + b * heads * latent + b * heads * value


def indexed_backward_extra_per_token(m: ModelShape, o: PlanOptions) -> float:
    """Extra bytes per local token at the layer's backward peak: the chosen keys' gradient [k, R + r], the fp32
    probabilities' and scores' gradients [H, k] twice, the whole sequence's latent gradient ([T, R + r] from the
    gather's index backward, its sum and the exchange back: three), and one chunk's working set."""
    b = o.dtype_bytes
    _, latent, rope, _, _, heads, top, _, _ = widths(m)
    whole = 3 * o.sp * b * (latent + rope)
    return b * top * (latent + rope) + 2 * 4 * heads * top + whole + ATTENTION_PICK_BUDGET / o.seq_local


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
    stream: the input norm's output, q, the kv latent, the gathered latent and index keys of the whole sequence,
    the chosen indices, the absorbed query and the latent output; then one indexer chunk's fp32 scores and one
    attention chunk's chosen keys (fixed working sets, spread over the rank's tokens)."""
    b = o.dtype_bytes
    q_latent, latent, rope, nope, _, heads, top, width, _ = widths(m)
    held = b * (m.hidden + q_latent + heads * (nope + rope) + latent + rope) + 8 * top
    gathered = o.sp * b * (latent + rope + width)
    attention = 2 * b * heads * (latent + rope)
    return held + gathered + attention + (INDEX_SCORE_BUDGET + ATTENTION_PICK_BUDGET) / o.seq_local
