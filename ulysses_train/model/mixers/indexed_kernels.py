"""The two computations of indexed (DeepSeek Sparse) attention, on one rank's queries against the whole sequence's
keys: the indexer's choice of keys and the sparse attention over them. Reference forms in torch, for CPU and for
checking the GPU kernels against; nothing here exchanges anything (indexed_attention.py gathers the keys).

The indexer (transformers' `DeepseekV32Indexer` / `GlmMoeDsaIndexer`, read in transformers 5.25) scores query s
against key j as `sum_h w[s, h] * relu(scale * q[s, h] . k[j])` (its heads h, one key head), masks keys the query
may not see, and keeps the top `index_topk`. transformers runs it under `no_grad` on the whole sequence at once
([S, heads, S] fp32 scores); `index_scores` computes the same ops in the same order for a chunk of queries against
every key, so the same keys are chosen (tests/test_indexed_attention.py compares the choices index for index).

The attention of multi-head latent attention (MLA) over the chosen keys (SparseLatentAttention: in chunks of queries,
fp32 scores and softmax, its backward recomputing each chunk from the saved query and keys) is computed in the
absorbed form that the
sparse MLA kernels take: keys and values are the latent `c` (kv_lora_rank wide) and the rotated key part, one head
shared by all query heads; each query head's nope part is carried into the latent by kv_b_proj's key rows
(`q_latent = q_nope @ W_uk`), and the latent output back out by its value rows (`o = o_latent @ W_uv`). The same
function as transformers' expanded form (keys `W_uk c`, values `W_uv c` per head), summed in another order."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

INDEX_SCORE_BUDGET = 1 << 28
"""Bytes of fp32 indexer scores ([queries, index heads, keys]) one chunk of queries may hold (256 MiB)."""
ATTENTION_PICK_BUDGET = 1 << 30
"""Bytes one chunk of the reference attention holds: its queries' chosen keys ([queries, top-k, latent + rope]),
their fp32 copy and gradient, the fp32 probabilities and their gradients (attention_chunks), 1 GiB."""


def query_chunks(queries: int, bytes_per_query: int, budget: int) -> list[slice]:
    """Runs of queries whose working set fits `budget` bytes (at least one query a chunk)."""
    step = max(1, budget // max(1, bytes_per_query))
    return [slice(start, min(start + step, queries)) for start in range(0, queries, step)]


def rotate_one(rope, x: torch.Tensor, cos, sin, unsqueeze_dim: int) -> torch.Tensor:
    """transformers' rotary function `rope(q, k, cos, sin, unsqueeze_dim)` applied to one tensor: it rotates q and k
    element by element alike, so passing x as both and keeping one is the same arithmetic."""
    return rope(x, x, cos, sin, unsqueeze_dim=unsqueeze_dim)[1]


@dataclass(frozen=True)
class IndexerForm:
    """How an indexer class computes, read from its transformers forward (indexed_attention.INDEXER_FORMS)."""
    rope: Optional[Callable]
    """Its modeling file's rotary function `rope(q, k, cos, sin, unsqueeze_dim)` (interleaved or half-split); None:
    nothing is rotated (GLM-5.3-Flash's layers take no positions)."""
    rope_last: bool = False
    """The rotated channels are the last qk_rope_head_dim of each index head (HY-V4's); else the first."""
    scale_weights: bool = False
    """softmax_scale multiplies the per-head weights (HY-V4's); else the scores, before the ReLU."""
    pooled: bool = False
    """The queries score pools of keys (GLM-5.3-Flash's KPool, pooled_index.py); each token's gate scores travel
    beside its index key (index_keys)."""


def rotate_part(form: IndexerForm, x: torch.Tensor, rope_width: int, cos, sin) -> torch.Tensor:
    """x [B, t, heads, D] with its `rope_width` rotated channels (form.rope_last: the last, else the first) rotated,
    the rest as they are (all of them where the form rotates nothing)."""
    if form.rope is None:
        return x
    widths = [x.shape[-1] - rope_width, rope_width] if form.rope_last else [rope_width, x.shape[-1] - rope_width]
    first, second = torch.split(x, widths, dim=-1)
    if form.rope_last:
        return torch.cat([first, rotate_one(form.rope, second, cos, sin, 2)], dim=-1)
    return torch.cat([rotate_one(form.rope, first, cos, sin, 2), second], dim=-1)


def index_keys(indexer, form: IndexerForm, hidden: torch.Tensor, cos, sin) -> torch.Tensor:
    """The indexer's key of each token of `hidden` [B, t, hidden]: `k_norm(wk(x))` (in the norm's dtype, back in
    the hidden states': a no-op where they agree, HY-V4's fp32 LayerNorm where not), rotated as `form` says
    -> [B, t, index_head_dim]; a pooled form's with each token's pool gate scores after it (`x @ gate.T`,
    [B, t, 2 * index_head_dim]), as transformers packs them."""
    k = indexer.k_norm(indexer.wk(hidden).to(indexer.k_norm.weight.dtype)).to(hidden.dtype).unsqueeze(2)
    k = rotate_part(form, k, indexer.qk_rope_head_dim, cos, sin).squeeze(2)
    if form.pooled:
        return torch.cat([k, torch.nn.functional.linear(hidden, indexer.index_kpool_compress_gate)], dim=-1)
    return k


def index_queries(indexer, form: IndexerForm, q_resid, cos, sin) -> torch.Tensor:
    """The indexer's query heads of these tokens (`q_resid` [B, c, q_lora_rank]), rotated -> [B, c, Hi, D]."""
    batch, rows, _ = q_resid.shape
    q = indexer.wq_b(q_resid).view(batch, rows, indexer.n_heads, indexer.head_dim)
    return rotate_part(form, q, indexer.qk_rope_head_dim, cos, sin)


def head_weights(indexer, form: IndexerForm, hidden) -> torch.Tensor:
    """Each token's weight of each index head [B, c, Hi] fp32 (HY-V4's with the softmax scale in it)."""
    weights = indexer.weights_proj(hidden.to(indexer.weights_proj.weight.dtype)).float() * (indexer.n_heads ** -0.5)
    return weights * indexer.softmax_scale if form.scale_weights else weights


def weigh_heads(form: IndexerForm, scale: float, weights, products) -> torch.Tensor:
    """Each query's score of each key from its heads' fp32 products with the keys [B, c, Hi, n] and its head
    `weights` [B, c, Hi]: `sum_h w[h] * relu(scale * product[h])` (HY-V4: the scale in the weights) -> [B, c, n]."""
    products = torch.nn.functional.relu(products if form.scale_weights else products * scale)
    return torch.matmul(weights.unsqueeze(-2), products).squeeze(-2)


def scores_of(form: IndexerForm, scale: float, queries, weights, keys) -> torch.Tensor:
    """Scores of queries [B, c, Hi, D] with their head weights [B, c, Hi] against every key [B, T, D] -> [B, c, T]."""
    return weigh_heads(form, scale, weights, torch.matmul(queries.float(), keys.transpose(-1, -2).float().unsqueeze(1)))


def index_scores(indexer, form: IndexerForm, hidden, q_resid, keys, cos, sin) -> torch.Tensor:
    """The indexer's scores of these queries ([B, c, hidden] and their `q_resid` [B, c, q_lora_rank]) against every
    key [B, T, D] -> [B, c, T] fp32, op for op as transformers' indexer forward computes them."""
    return scores_of(form, indexer.softmax_scale, index_queries(indexer, form, q_resid, cos, sin),
                     head_weights(indexer, form, hidden), keys)


def chosen_scores_of(form: IndexerForm, scale: float, queries, weights, picked) -> torch.Tensor:
    """Scores of queries [B, c, Hi, D] against each one's own chosen keys `picked` [B, c, k, D] -> [B, c, k] fp32
    (index_scores' arithmetic, for the indexer loss: indexer_loss.py)."""
    return weigh_heads(form, scale, weights, torch.einsum("bchd,bckd->bchk", queries.float(), picked.float()))


def visible_keys(query_index: torch.Tensor, keys: int, documents) -> torch.Tensor:
    """[c, T] bool: which keys each query (its index in the whole sequence) may see: itself and earlier tokens of its
    own document (`documents`: each token's document number over the whole sequence, or None for one document)."""
    key_index = torch.arange(keys, device=query_index.device)
    visible = key_index[None, :] <= query_index[:, None]
    if documents is not None:
        visible &= documents[None, :] == documents[query_index][:, None]
    return visible


def chosen_visible(chosen: torch.Tensor, query_index: torch.Tensor, documents) -> torch.Tensor:
    """[B, t, k] bool: which of each query's chosen keys [B, t, k] it may see (visible_keys, for the chosen ones
    only: no [t, T] mask); -1 (a pooled choice's empty place) is no key."""
    visible = (chosen >= 0) & (chosen <= query_index[None, :, None])
    if documents is not None:
        visible &= documents[chosen.clamp(min=0)] == documents[query_index][None, :, None]
    return visible


@torch.no_grad()
def select_keys(indexer, form: IndexerForm, hidden, q_resid, keys, cos, sin, query_index, documents) -> torch.Tensor:
    """The top `index_topk` keys of each query [B, t] (long [B, t, k]): scored in chunks of queries (scores_of),
    keys the query may not see at -inf (transformers adds its causal mask the same way), ties and all as
    transformers' `topk` over the whole row. Where fewer keys are visible than k, the rest are invisible ones,
    which the attention masks (visible_keys) as transformers' does. The indexer's projections run once for the
    slice, not per chunk: each module call is an entry in ZeRO-3's trace, which a step scans."""
    total = keys.shape[1]
    top = min(indexer.index_topk, total)
    queries, weights = index_queries(indexer, form, q_resid, cos, sin), head_weights(indexer, form, hidden)
    chosen = []
    for rows in query_chunks(hidden.shape[1], 4 * indexer.n_heads * total, INDEX_SCORE_BUDGET):
        scores = scores_of(form, indexer.softmax_scale, queries[:, rows], weights[:, rows], keys)
        scores = scores.masked_fill(~visible_keys(query_index[rows], total, documents), float("-inf"))
        chosen.append(scores.topk(top, dim=-1).indices)
    return torch.cat(chosen, dim=1)


def sparse_latent_attention(q_latent, q_rot, latent, k_rot, chosen, visible, scale: float,
                            sinks=None) -> torch.Tensor:
    """Each query head's softmax attention over its query's chosen keys, in MLA's absorbed form (module docstring):
    q_latent [B, t, H, R] and q_rot [B, t, H, r] against the latent [B, T, R] and rotated key part [B, T, r] of the
    keys `chosen` [B, t, k] (of which `visible` [B, t, k] may be seen) -> the latent output [B, t, H, R].
    `sinks` [H] (HY-V4): a learned logit per head in each softmax's denominator, with no value (chunk_probabilities)."""
    keys = torch.cat([latent, k_rot], dim=-1)  # [B, T, R + r]: one head
    query = torch.cat([q_latent, q_rot], dim=-1)  # [B, t, H, R + r]
    picked = chosen.clamp(min=0)  # a place holding no key (-1) is gathered from key 0, unseen (`visible`)
    return SparseLatentAttention.apply(query, keys, picked, visible, scale, latent.shape[-1], sinks)


def attention_chunks(chosen: torch.Tensor, keys: torch.Tensor, heads: int) -> list[slice]:
    """Runs of queries whose gathered keys and fp32 scores, probabilities and gradients fit ATTENTION_PICK_BUDGET."""
    top, width = chosen.shape[-1], keys.shape[-1]
    return query_chunks(chosen.shape[1], top * (width * (keys.element_size() + 8) + 16 * heads),
                        ATTENTION_PICK_BUDGET)


def gather_keys(keys: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """keys [B, T, D] at the indices `chosen` [B, c, k] -> [B, c, k, D]."""
    return keys[torch.arange(keys.shape[0], device=keys.device)[:, None, None], chosen]


def wide(x: torch.Tensor) -> torch.Tensor:
    """x in fp32, or as it is when wider (fp64 checks)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def chunk_probabilities(query, picked, visible, scale: float, sinks=None) -> torch.Tensor:
    """fp32 softmax over a chunk's chosen keys [B, c, H, k], unseen keys at probability 0; with `sinks` [H], each
    head's sink logit joins the softmax and is dropped after it, as transformers' eager attention does (the
    probabilities then sum to 1 - the sink's)."""
    scores = torch.einsum("bchd,bckd->bchk", wide(query), wide(picked)) * scale
    scores = scores.masked_fill(~visible[:, :, None, :], float("-inf"))
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    sink = wide(sinks).to(scores.dtype)[None, None, :, None].expand(*scores.shape[:3], 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]


class SparseLatentAttention(torch.autograd.Function):
    """The reference sparse attention, chunk by chunk over the queries, scores and softmax in fp32 (as a fused
    kernel keeps them), saving only its inputs: the backward gathers each chunk's keys again and recomputes its
    probabilities, so what a layer holds for backward is the query and the whole sequence's latent keys, not the
    k chosen keys of every query."""

    @staticmethod
    def forward(ctx, query, keys, chosen, visible, scale: float, width: int, sinks=None):
        out = query.new_empty(*query.shape[:3], width)
        for rows in attention_chunks(chosen, keys, query.shape[2]):
            picked = gather_keys(keys, chosen[:, rows])
            probs = chunk_probabilities(query[:, rows], picked, visible[:, rows], scale, sinks)
            out[:, rows] = torch.einsum("bchk,bckr->bchr", probs, wide(picked[..., :width])).to(out.dtype)
        ctx.save_for_backward(query, keys, chosen, visible, sinks)
        ctx.scale, ctx.width = scale, width
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, keys, chosen, visible, sinks = ctx.saved_tensors
        scale, width = ctx.scale, ctx.width
        grad_query = torch.empty_like(query)
        grad_keys = wide(torch.zeros_like(keys))
        grad_sinks = None if sinks is None else wide(torch.zeros_like(sinks))
        batch = torch.arange(keys.shape[0], device=keys.device)[:, None, None]
        for rows in attention_chunks(chosen, keys, query.shape[2]):
            picked = wide(gather_keys(keys, chosen[:, rows]))
            q, d_out = wide(query[:, rows]), wide(grad_out[:, rows])
            probs = chunk_probabilities(q, picked, visible[:, rows], scale, sinks)
            d_probs = torch.einsum("bchr,bckr->bchk", d_out, picked[..., :width])
            expected = (d_probs * probs).sum(-1, keepdim=True)  # the sink's own d_prob is 0: it has no value
            d_scores = probs * (d_probs - expected)
            if sinks is not None:  # d sink = -p_sink * sum_j p_j dP_j, p_sink = 1 - sum_j p_j
                grad_sinks -= ((1 - probs.sum(-1)) * expected.squeeze(-1)).sum(dim=(0, 1))
            grad_query[:, rows] = (torch.einsum("bchk,bckd->bchd", d_scores, picked) * scale).to(query.dtype)
            d_picked = torch.einsum("bchk,bchd->bckd", d_scores, q) * scale
            d_picked[..., :width] += torch.einsum("bchk,bchr->bckr", probs, d_out)
            grad_keys.index_put_((batch.expand_as(chosen[:, rows]), chosen[:, rows]), d_picked, accumulate=True)
        grad_sinks = None if sinks is None else grad_sinks.to(sinks.dtype)
        return grad_query, grad_keys.to(keys.dtype), None, None, None, None, grad_sinks
