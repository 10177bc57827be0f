"""GLM-5.3-Flash's KPool indexer (transformers' `Glm5NextTextIndexer`, read in 5.25) on one rank's queries against
the whole sequence: which keys each query attends to when the indexer scores pools of keys, not single keys.

A pool is `index_kpool` (P) consecutive tokens, counted from its document's first token (transformers counts from
the first real token; the reference of packed documents is each document alone). Its key is a per-channel average of
its tokens' index keys, weighted by a softmax over the pool of `gate[token] + ape[place]` (the gate scores
`x @ index_kpool_compress_gate.T` travel beside each index key: indexed_kernels.index_keys). Only complete pools are
candidates, and a query may take a pool whose last token is at or before it. Each query scores the pools as the
token indexer scores keys (indexed_kernels.scores_of) and attends to every token of its top `index_topk // P`
visible pools and, with `index_kpool_always_select_tail` (a config without it is refused: a query before its
document's first complete pool would see no key), to the tokens of its own incomplete pool (the tail), itself
included. Empty places hold -1 (indexed_kernels.chosen_visible: no key).

transformers masks the pools a query may not see with the dtype's lowest value and takes the top
`min(index_topk // P, complete pools)`: the picks that land on such pools are dropped. Here they are -inf and
dropped the same way, so each query gets the top `min(index_topk // P, pools it sees)` of the pools it sees, as there;
two pools of one query's scores that tie at the cut could be taken in another order (the test compares choices).

Under sp the whole sequence's index keys and gate scores are gathered (indexed_attention.gathered_index_keys), so a
pool cut by a slice edge is pooled from all its tokens, on every rank alike."""
from __future__ import annotations

import torch

from ulysses_train.model.mixers.indexed_kernels import (INDEX_SCORE_BUDGET, IndexerForm, head_weights,
                                                         index_queries, query_chunks, scores_of)


def document_starts(total: int, documents, device) -> torch.Tensor:
    """Each token's document's first index [T] (documents: each token's document number, or None for one)."""
    index = torch.arange(total, device=device)
    if documents is None:
        return torch.zeros_like(index)
    first = torch.full((int(documents.max()) + 1,), total, dtype=torch.long, device=device)
    return first.scatter_reduce(0, documents, index, reduce="amin")[documents]


def complete_pools(total: int, pool: int, documents, device) -> torch.Tensor:
    """[n, P] token indices of every complete pool of the sequence, in order: P consecutive tokens from a document's
    start + a multiple of P, all in the document (documents as document_starts)."""
    index = torch.arange(total, device=device)
    starts = document_starts(total, documents, device)
    first = index[(index - starts) % pool == 0]  # each pool's first token
    tokens = first[:, None] + torch.arange(pool, device=device)
    inside = (tokens < total).all(-1)
    tokens = tokens[inside]
    if documents is not None:
        tokens = tokens[(documents[tokens] == documents[tokens[:, :1]]).all(-1)]
    return tokens


def pool_keys(indexer, keys_and_gates: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Each pool's key [B, n, D]: its tokens' index keys averaged per channel with softmax(gate + ape) weights over
    the pool, in transformers' dtypes (fp32 logits, the weights back in the keys' dtype, summed there)."""
    width = indexer.head_dim
    grouped = keys_and_gates[:, tokens]  # [B, n, P, 2D]
    keys, gates = grouped[..., :width], grouped[..., width:]
    logits = gates.float() + indexer.index_kpool_compress_ape.float()[None, None]
    return (logits.softmax(dim=2).to(keys.dtype) * keys).sum(dim=2)


def tail_tokens(query_index: torch.Tensor, starts: torch.Tensor, pool: int) -> torch.Tensor:
    """[t, P - 1] each query's incomplete pool (its tokens from its pool's first to itself; -1 beyond): transformers'
    append_visible_tail."""
    seen = query_index - starts[query_index] + 1  # tokens of its document it sees
    count = seen % pool
    offsets = torch.arange(pool - 1, device=query_index.device)
    tail = (query_index + 1 - count)[:, None] + offsets
    return tail.masked_fill(offsets[None, :] >= count[:, None], -1)


@torch.no_grad()
def select_pooled_keys(indexer, form: IndexerForm, hidden, q_resid, keys_and_gates, query_index,
                       documents) -> torch.Tensor:
    """The keys each query of the slice attends to (module docstring) -> long [B, t, k * P + P - 1], -1 where
    empty. keys_and_gates [B, T, 2D] of the whole sequence; query_index [t] the queries' places in it."""
    batch, total = keys_and_gates.shape[:2]
    pool, device = indexer.index_kpool, keys_and_gates.device
    tokens = complete_pools(total, pool, documents, device)  # [n, P]
    top = min(indexer.index_topk // pool, tokens.shape[0])
    tail = tail_tokens(query_index, document_starts(total, documents, device), pool)[None].expand(batch, -1, -1)
    if top == 0:
        return tail
    keys = pool_keys(indexer, keys_and_gates, tokens)
    ends, pool_documents = tokens[:, -1], None if documents is None else documents[tokens[:, 0]]
    queries, weights = index_queries(indexer, form, q_resid, None, None), head_weights(indexer, form, hidden)
    chosen = []
    for rows in query_chunks(hidden.shape[1], 4 * indexer.n_heads * tokens.shape[0], INDEX_SCORE_BUDGET):
        visible = ends[None, :] <= query_index[rows, None]  # [c, n]
        if documents is not None:
            visible &= pool_documents[None, :] == documents[query_index[rows]][:, None]
        scores = scores_of(form, indexer.softmax_scale, queries[:, rows], weights[:, rows], keys)
        best = scores.masked_fill(~visible, float("-inf")).topk(top, dim=-1)
        picked = tokens[best.indices].masked_fill(best.values[..., None] == float("-inf"), -1)  # [B, c, k, P]
        chosen.append(picked.flatten(-2))
    return torch.cat([torch.cat(chosen, dim=1), tail], dim=-1)
