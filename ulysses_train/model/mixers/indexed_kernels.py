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


def index_keys(indexer, hidden: torch.Tensor, cos, sin, rope) -> torch.Tensor:
    """The indexer's key of each token of `hidden` [B, t, hidden]: `k_norm(wk(x))`, its first qk_rope_head_dim
    channels rotated by `rope` (the family's: interleaved or half-split) -> [B, t, index_head_dim]."""
    k = indexer.k_norm(indexer.wk(hidden)).unsqueeze(2)  # [B, t, 1, D]
    k_rot, k_pass = torch.split(k, [indexer.qk_rope_head_dim, indexer.head_dim - indexer.qk_rope_head_dim], dim=-1)
    return torch.cat([rotate_one(rope, k_rot, cos, sin, 2), k_pass], dim=-1).squeeze(2)


def index_scores(indexer, hidden, q_resid, keys, cos, sin, rope) -> torch.Tensor:
    """The indexer's scores of these queries ([B, c, hidden] and their `q_resid` [B, c, q_lora_rank]) against every
    key [B, T, D] -> [B, c, T] fp32, op for op as transformers' indexer forward computes them."""
    batch, rows, _ = hidden.shape
    q = indexer.wq_b(q_resid).view(batch, rows, indexer.n_heads, indexer.head_dim)  # [B, c, Hi, D]
    q_rot, q_pass = torch.split(q, [indexer.qk_rope_head_dim, indexer.head_dim - indexer.qk_rope_head_dim], dim=-1)
    q = torch.cat([rotate_one(rope, q_rot, cos, sin, 2), q_pass], dim=-1)
    scores = torch.matmul(q.float(), keys.transpose(-1, -2).float().unsqueeze(1)) * indexer.softmax_scale
    scores = torch.nn.functional.relu(scores)  # [B, c, Hi, T]
    weights = indexer.weights_proj(hidden.to(indexer.weights_proj.weight.dtype)).float() * (indexer.n_heads ** -0.5)
    return torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)


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
    only: no [t, T] mask)."""
    visible = chosen <= query_index[None, :, None]
    if documents is not None:
        visible &= documents[chosen] == documents[query_index][None, :, None]
    return visible


@torch.no_grad()
def select_keys(indexer, hidden, q_resid, keys, cos, sin, rope, query_index, documents) -> torch.Tensor:
    """The top `index_topk` keys of each query [B, t] (long [B, t, k]): scored by index_scores in chunks of queries,
    keys the query may not see at -inf (transformers adds its causal mask the same way), ties and all as
    transformers' `topk` over the whole row. Where fewer keys are visible than k, the rest are invisible ones,
    which the attention masks (visible_keys) as transformers' does."""
    total = keys.shape[1]
    top = min(indexer.index_topk, total)
    chosen = []
    for rows in query_chunks(hidden.shape[1], 4 * indexer.n_heads * total, INDEX_SCORE_BUDGET):
        scores = index_scores(indexer, hidden[:, rows], q_resid[:, rows], keys, cos[:, rows], sin[:, rows], rope)
        scores = scores.masked_fill(~visible_keys(query_index[rows], total, documents), float("-inf"))
        chosen.append(scores.topk(top, dim=-1).indices)
    return torch.cat(chosen, dim=1)


def sparse_latent_attention(q_latent, q_rot, latent, k_rot, chosen, visible, scale: float) -> torch.Tensor:
    """Each query head's softmax attention over its query's chosen keys, in MLA's absorbed form (module docstring):
    q_latent [B, t, H, R] and q_rot [B, t, H, r] against the latent [B, T, R] and rotated key part [B, T, r] of the
    keys `chosen` [B, t, k] (of which `visible` [B, t, k] may be seen) -> the latent output [B, t, H, R]."""
    keys = torch.cat([latent, k_rot], dim=-1)  # [B, T, R + r]: one head
    query = torch.cat([q_latent, q_rot], dim=-1)  # [B, t, H, R + r]
    return SparseLatentAttention.apply(query, keys, chosen, visible, scale, latent.shape[-1])


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


def chunk_probabilities(query, picked, visible, scale: float) -> torch.Tensor:
    """fp32 softmax over a chunk's chosen keys [B, c, H, k], unseen keys at probability 0."""
    scores = torch.einsum("bchd,bckd->bchk", wide(query), wide(picked)) * scale
    return torch.softmax(scores.masked_fill(~visible[:, :, None, :], float("-inf")), dim=-1)


class SparseLatentAttention(torch.autograd.Function):
    """The reference sparse attention, chunk by chunk over the queries, scores and softmax in fp32 (as a fused
    kernel keeps them), saving only its inputs: the backward gathers each chunk's keys again and recomputes its
    probabilities, so what a layer holds for backward is the query and the whole sequence's latent keys, not the
    k chosen keys of every query."""

    @staticmethod
    def forward(ctx, query, keys, chosen, visible, scale: float, width: int):
        out = query.new_empty(*query.shape[:3], width)
        for rows in attention_chunks(chosen, keys, query.shape[2]):
            picked = gather_keys(keys, chosen[:, rows])
            probs = chunk_probabilities(query[:, rows], picked, visible[:, rows], scale)
            out[:, rows] = torch.einsum("bchk,bckr->bchr", probs, wide(picked[..., :width])).to(out.dtype)
        ctx.save_for_backward(query, keys, chosen, visible)
        ctx.scale, ctx.width = scale, width
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, keys, chosen, visible = ctx.saved_tensors
        scale, width = ctx.scale, ctx.width
        grad_query = torch.empty_like(query)
        grad_keys = wide(torch.zeros_like(keys))
        batch = torch.arange(keys.shape[0], device=keys.device)[:, None, None]
        for rows in attention_chunks(chosen, keys, query.shape[2]):
            picked = wide(gather_keys(keys, chosen[:, rows]))
            q, d_out = wide(query[:, rows]), wide(grad_out[:, rows])
            probs = chunk_probabilities(q, picked, visible[:, rows], scale)
            d_probs = torch.einsum("bchr,bckr->bchk", d_out, picked[..., :width])
            d_scores = probs * (d_probs - (d_probs * probs).sum(-1, keepdim=True))
            grad_query[:, rows] = (torch.einsum("bchk,bckd->bchd", d_scores, picked) * scale).to(query.dtype)
            d_picked = torch.einsum("bchk,bchd->bckd", d_scores, q) * scale
            d_picked[..., :width] += torch.einsum("bchk,bchr->bckr", probs, d_out)
            grad_keys.index_put_((batch.expand_as(chosen[:, rows]), chosen[:, rows]), d_picked, accumulate=True)
        return grad_query, grad_keys.to(keys.dtype), None, None, None, None
