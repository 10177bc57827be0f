"""Ulysses attention over chunks of heads, one chunk at a time (`model.attention_head_chunks`).

Why. At millions of tokens one attention layer's backward is the step's peak: after the all-to-all each rank holds
the whole sequence for its heads/sp heads, so q, k, v, the output and the logsumexp in that layout, their
gradients, the kernel's fp32 accumulators and the exchange's send and receive buffers all scale with the whole
sequence times every head the rank runs. Running the exchange and the kernel for `chunks` groups of those heads in
turn, each group's buffers freed before the next, divides that part by `chunks` (Untied Ulysses' idea).

How (HeadChunkedAttention, an autograd function). Forward: for each chunk, the chunk's heads of this rank's slice
(select_chunk: head group c of every rank's heads, so sp rank r receives the chunk of its own heads) go through
the all-to-all (SequenceParallel.to_head_shards), the kernel and the reverse all-to-all, and land in their place
of one output tensor [B, t, H, dv]; nothing is kept but q, k and v of the slice. Backward: for each chunk the same
exchange and kernel run again under autograd and are differentiated at once (the chunk's recompute, so no chunk's
whole-sequence tensors outlive its turn), the gradients written into the slice's dq, dk and dv. The cost is one
more attention forward per layer (the planner counts it: planner/estimate.py flops) and the recompute's
exchanges; the saving is what the planner's attention backward and exchange terms divide by `chunks`.

Which heads form a chunk. Each rank's heads/sp query heads split into `chunks` runs of equal length; a run reads
whole KV heads of the rank's or a share of one (chunk_problem: chunks divides the rank's query heads, and the
rank's KV heads divide chunks or chunks divides them). Attention sinks (one per query head, `s_aux`) are cut the
same way, so the kernel (fa4.local_sinks) finds each rank's own."""
from __future__ import annotations

from typing import Callable, Optional

import torch


def chunk_problem(heads: int, kv_heads: int, sp: int, chunks: int) -> Optional[str]:
    """Why `chunks` cannot split the heads one rank runs (None when it can). `heads` / `kv_heads` of the model
    (KV heads fewer than sp count as sp: each rank then gets one, repeated)."""
    rank_heads, rank_kv = heads // sp, max(kv_heads, sp) // sp
    if chunks < 1 or rank_heads % chunks:
        return (f"model.attention_head_chunks={chunks} must divide the {rank_heads} query heads each of sp={sp} "
                f"ranks runs ({heads} heads / {sp})")
    if rank_kv % chunks and chunks % rank_kv:
        return (f"model.attention_head_chunks={chunks} and the {rank_kv} KV heads each rank runs: one must divide "
                f"the other, so each chunk reads whole KV heads or a share of one")
    return None


def select_chunk(x: torch.Tensor, sp: int, heads_per_chunk: int, first: int) -> torch.Tensor:
    """[B, t, sp * n, d] -> [B, t, sp * heads_per_chunk, d]: heads first .. first + heads_per_chunk - 1 of each
    rank's n (in rank order, as the all-to-all sends them)."""
    per_rank = x.unflatten(2, (sp, -1))
    return per_rank[:, :, :, first:first + heads_per_chunk].flatten(2, 3)


class ChunkLayout:
    """Where chunk c's query and KV heads sit among each rank's heads."""

    def __init__(self, heads: int, kv_heads: int, sp: int, chunks: int):
        self.sp, self.chunks = sp, chunks
        self.query = heads // sp // chunks
        rank_kv = kv_heads // sp
        self.group = heads // kv_heads  # query heads per KV head
        self.kv = max(1, rank_kv // chunks)

    def kv_first(self, c: int) -> int:
        return c * self.query // self.group

    def inputs(self, c: int, q, k, v) -> list:
        """Chunk c's q, k and v of the slice: copies where the chunk's heads are not contiguous (planned: the slice
        copies in planner/layer.py chunk_backward_per_token), held only during the chunk's turn."""
        return [select_chunk(q, self.sp, self.query, c * self.query),
                *(select_chunk(x, self.sp, self.kv, self.kv_first(c)) for x in (k, v))]

    def sinks(self, c: int, sinks: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Chunk c's attention sinks, rank by rank ([sp * query])."""
        if sinks is None:
            return None
        return sinks.unflatten(0, (self.sp, -1))[:, c * self.query:(c + 1) * self.query].flatten()


class HeadChunkedAttention(torch.autograd.Function):
    """Module docstring. `attend(q, k, v, sinks)`: the kernel over the whole sequence of a chunk's heads ([B, T,
    heads/sp, d] in, [B, T, heads/sp, dv] out); `sequence_parallel`: the exchanges; `layout`: a ChunkLayout.

    Backward runs each chunk's exchange and kernel again under autograd, from the slice's q, k and v, and sends the
    chunk's output gradient through the same exchange as its inputs (the reverse exchange of the output is not run
    again: its backward is that exchange). dq is written over q's own memory, chunk by chunk: chunk c reads only
    its heads of q, before its gradient lands there, and nothing else keeps q (torch's version counter would refuse
    a backward that read it after this one)."""

    @staticmethod
    def forward(ctx, attend: Callable, sequence_parallel, layout: ChunkLayout, q, k, v, sinks):
        ctx.attend, ctx.sequence_parallel, ctx.layout = attend, sequence_parallel, layout
        ctx.save_for_backward(q, k, v, sinks)
        out = None
        for c in range(layout.chunks):
            heads = sequence_parallel.to_head_shards(layout.inputs(c, q, k, v))
            piece = sequence_parallel.to_sequence_shards(attend(*heads, layout.sinks(c, sinks)))
            if out is None:
                out = piece.new_empty(*q.shape[:3], piece.shape[-1])
            select_view(out, layout, c).copy_(piece.unflatten(2, (layout.sp, -1)))
            del heads, piece
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, sinks = ctx.saved_tensors
        layout, exchange = ctx.layout, ctx.sequence_parallel
        grad_k, grad_v = torch.zeros_like(k), torch.zeros_like(v)
        grad_sinks = torch.zeros_like(sinks) if sinks is not None else None
        for c in range(layout.chunks):
            chunk_grads = chunk_backward(ctx.attend, exchange, layout, c, (q, k, v), sinks, grad_out)
            select_view(q, layout, c).copy_(chunk_grads[0].unflatten(2, (layout.sp, -1)))  # dq over q (docstring)
            for grad, chunk_grad in zip((grad_k, grad_v), chunk_grads[1:3]):
                kv_view(grad, layout, c).add_(chunk_grad.unflatten(2, (layout.sp, -1)))
            if grad_sinks is not None and chunk_grads[3] is not None:
                grad_sinks += chunk_grads[3]
        return None, None, None, q, grad_k, grad_v, grad_sinks


def chunk_backward(attend: Callable, exchange, layout: ChunkLayout, c: int, qkv: tuple, sinks, grad_out) -> tuple:
    """Chunk c's gradients of its q, k and v of the slice (and of every sink; None without sinks): its exchange
    and kernel run again under autograd, differentiated against its output gradient brought to the heads' layout."""
    with torch.enable_grad():
        leaves = [x.detach().requires_grad_() for x in layout.inputs(c, *qkv)]
        sink_leaf = sinks.detach().requires_grad_() if sinks is not None else None
        out = attend(*exchange.to_head_shards(leaves), layout.sinks(c, sink_leaf))
        with torch.no_grad():
            grad_heads = exchange.to_head_shards([select_view(grad_out, layout, c).flatten(2, 3)])[0]
        wanted = leaves + ([sink_leaf] if sink_leaf is not None else [])
        grads = torch.autograd.grad(out, wanted, grad_heads, allow_unused=True)
    return (*grads[:3], grads[3] if sinks is not None else None)


def select_view(x: torch.Tensor, layout: ChunkLayout, c: int) -> torch.Tensor:
    """A view of chunk c's query heads of a [B, t, H, d] tensor: [B, t, sp, heads per chunk, d]."""
    return x.unflatten(2, (layout.sp, -1))[:, :, :, c * layout.query:(c + 1) * layout.query]


def kv_view(x: torch.Tensor, layout: ChunkLayout, c: int) -> torch.Tensor:
    """A view of the KV heads chunk c reads of a [B, t, KV, d] tensor: [B, t, sp, its KV heads, d]."""
    first = layout.kv_first(c)
    return x.unflatten(2, (layout.sp, -1))[:, :, :, first:first + layout.kv]
