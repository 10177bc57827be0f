"""FlashAttention 4's CuTe kernels as the model's attention (`model.attn_implementation: fa4`).

Why: attention is most of a long-sequence step, and on an H200 FlashAttention 4's Hopper kernels (package
`flash-attn-4`, module `flash_attn.cute`) run causal GQA forward+backward faster than SDPA's fastest backend,
cuDNN (benchmarks/RESULTS.md, "FlashAttention 4 as the model's attention").

Why custom ops rather than calling `flash_attn.cute.flash_attn_func`: that function is an
`autograd.Function` whose kernels are not PyTorch ops, so nothing at the dispatcher sees them, and kept
attention (`model.keep_attention_fraction`, recompute.py) finds the attention kernel by its op in a
TorchDispatchMode. Here the forward kernel is one op, `torch.ops.ulysses_train.fa4_forward` (output and
log-sum-exp), and its backward a second, `fa4_backward`; recompute.attention_ops() lists the forward.

Each op has two implementations: on CUDA the FlashAttention 4 kernels, on CPU a plain fp32 reference (causal
softmax attention and its hand-written backward from the log-sum-exp). The CPU one is what lets the tests run
everything around the kernel on CPU (layouts, scaling, GQA, Ulysses sp, kept attention, gradients) against
an independent model; the kernel itself is checked on the GPU (benchmarks/probe_attention.py --fa4 and
benchmarks/gpu_equality.py --set attn_implementation=fa4).

Limits: causal self-attention over the whole sequence, or over the documents of a packed sequence (the
variable-length form: `cu_seqlens`, FlashAttention's cumulative document lengths; data.packing: documents),
optionally within a sliding window (`window_left`: a query sees itself and the `window_left` tokens before it,
FlashAttention's `window_size_left`; transformers' `sliding_window` W is `window_left = W - 1`), which combines
with documents, and optionally with learnable attention sinks (`sinks`, one logit per head that joins every
query's softmax and carries no value: GPT-OSS; FlashAttention 4's `learnable_sink`, forward and backward on
Hopper and Blackwell); no padding mask, no dropout. Anything else is refused with an error that names 'sdpa'.
"""
from __future__ import annotations

import importlib.util
import math
from typing import Optional

import torch

from ulysses_train.config import ConfigError
from ulysses_train.device import cuda_training
from ulysses_train.model.mixers.protocol import module_layer_type

NAME = "fa4"  # the transformers attention-registry key and the config value


def fa4_importable() -> bool:
    """Whether `flash_attn.cute` (package flash-attn-4) can be found (not imported: it is slow to import)."""
    try:
        return importlib.util.find_spec("flash_attn.cute") is not None
    except ModuleNotFoundError:  # flash_attn itself missing
        return False


def fa4_supported_here() -> bool:
    """FlashAttention 4 installed and a GPU it has kernels for (Hopper sm90, Blackwell sm100+), trained on."""
    return cuda_training() and fa4_importable() and torch.cuda.get_device_capability()[0] >= 9


# ------------------------------------------------------------------ the ops


@torch.library.custom_op("ulysses_train::fa4_forward", mutates_args=())
def fa4_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, causal: bool,
                cu_seqlens: Optional[torch.Tensor], max_seqlen: int, window_left: int = -1,
                sinks: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q (batch, tokens, heads, dim) over k, v (batch, tokens, kv_heads, dim): returns the output
    (batch, tokens, heads, dim) and the fp32 log-sum-exp of each query's scores (batch, heads, tokens).

    `cu_seqlens` (int32, documents + 1; batch 1): the sequence is documents [cu[i], cu[i+1]) that attend only
    within themselves (FlashAttention's variable-length form), `max_seqlen` the longest; None: one sequence.
    `window_left` >= 0: each query also sees only the `window_left` keys before it (-1: no window). `sinks`
    (heads,): a logit per head added to every query's softmax denominator (the log-sum-exp includes it)."""
    from flash_attn.cute.interface import _flash_attn_fwd

    window, sink = _window_size_left(window_left), _fp32(sinks)
    if cu_seqlens is None:
        out, lse, *_ = _flash_attn_fwd(q, k, v, softmax_scale=softmax_scale, causal=causal, return_lse=True,
                                       window_size_left=window, learnable_sink=sink)
        return out, lse
    out, lse, *_ = _flash_attn_fwd(q[0], k[0], v[0], cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
                                   max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen, softmax_scale=softmax_scale,
                                   causal=causal, return_lse=True, window_size_left=window, learnable_sink=sink)
    return out.unsqueeze(0), lse.unsqueeze(0)


@torch.library.custom_op("ulysses_train::fa4_backward", mutates_args=())
def fa4_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, softmax_scale: float, causal: bool, cu_seqlens: Optional[torch.Tensor],
                 max_seqlen: int, window_left: int = -1, sinks: Optional[torch.Tensor] = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of fa4_forward's output with respect to q, k, v and the sinks (an empty tensor without sinks)."""
    from flash_attn.cute.interface import _flash_attn_bwd

    window, sink = _window_size_left(window_left), _fp32(sinks)
    if cu_seqlens is None:
        grads = _flash_attn_bwd(q, k, v, out, grad_out, lse, softmax_scale, causal, window_size_left=window,
                                learnable_sink=sink)
    else:
        grads = _flash_attn_bwd(q[0], k[0], v[0], out[0], grad_out[0], lse[0], softmax_scale, causal,
                                cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen,
                                max_seqlen_k=max_seqlen, window_size_left=window, learnable_sink=sink)
        grads = tuple(g.unsqueeze(0) for g in grads[:3]) + tuple(grads[3:])
    dq, dk, dv = grads[:3]
    return dq, dk, dv, _sink_grad(grads[3] if sinks is not None else None, sinks, q)


def _fp32(sinks: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The sinks as the kernels take them: fp32, contiguous."""
    return None if sinks is None else sinks.float().contiguous()


def _sink_grad(dsinks: Optional[torch.Tensor], sinks: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """The sinks' gradient in their dtype, or an empty tensor when there are none (an op cannot return None)."""
    if sinks is None:
        return like.new_empty(0)
    return dsinks.to(sinks.dtype)


def _window_size_left(window_left: int) -> Optional[int]:
    """FlashAttention 4's window_size_left: None for no window."""
    return window_left if window_left >= 0 else None


def _scores(q, k, softmax_scale, causal, cu_seqlens=None, window_left=-1):
    """fp32 scores (batch, heads, tokens_q, tokens_k), KV heads repeated for GQA, future masked for causal,
    with `cu_seqlens` every pair of tokens from different documents masked, and with `window_left` >= 0 every
    key more than `window_left` tokens before its query."""
    groups = q.shape[2] // k.shape[2]
    qf = q.float().transpose(1, 2)
    kf = k.float().repeat_interleave(groups, dim=2).transpose(1, 2)
    scores = qf @ kf.transpose(-1, -2) * softmax_scale
    if causal:
        future = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    if cu_seqlens is not None:
        document = document_index(cu_seqlens, q.shape[1])
        scores = scores.masked_fill(document[:, None] != document[None, :], float("-inf"))
    if window_left >= 0:
        position = torch.arange(q.shape[1], device=q.device)
        scores = scores.masked_fill(position[:, None] - position[None, :] > window_left, float("-inf"))
    return scores


def document_index(cu_seqlens: torch.Tensor, tokens: int) -> torch.Tensor:
    """The document each token belongs to: cu_seqlens [0, 4, 9] -> [0, 0, 0, 0, 1, 1, 1, 1, 1]."""
    positions = torch.arange(tokens, device=cu_seqlens.device)
    return torch.bucketize(positions, cu_seqlens[1:].long(), right=True)


def _with_sinks(scores: torch.Tensor, sinks: Optional[torch.Tensor]) -> torch.Tensor:
    """Each query's log-sum-exp over its scores and, with sinks, its head's sink logit."""
    if sinks is None:
        return torch.logsumexp(scores, dim=-1)
    sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    return torch.logsumexp(torch.cat([scores, sink], dim=-1), dim=-1)


@fa4_forward.register_kernel("cpu")
def _fa4_forward_cpu(q, k, v, softmax_scale, causal, cu_seqlens, max_seqlen, window_left=-1, sinks=None):
    groups = q.shape[2] // k.shape[2]
    scores = _scores(q, k, softmax_scale, causal, cu_seqlens, window_left)
    lse = _with_sinks(scores, sinks)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    vf = v.float().repeat_interleave(groups, dim=2).transpose(1, 2)
    out = (probs @ vf).transpose(1, 2).to(q.dtype).contiguous()
    return out, lse


@fa4_backward.register_kernel("cpu")
def _fa4_backward_cpu(grad_out, q, k, v, out, lse, softmax_scale, causal, cu_seqlens, max_seqlen, window_left=-1,
                      sinks=None):
    """The standard attention backward from the saved log-sum-exp (what flash kernels compute, in fp32). A sink
    s joins the softmax with probability p_s = exp(s - lse) and no value, so dL/ds = -sum over queries of
    p_s * (dO . O)."""
    groups = q.shape[2] // k.shape[2]
    probs = torch.exp(_scores(q, k, softmax_scale, causal, cu_seqlens, window_left) - lse.unsqueeze(-1))
    do = grad_out.float().transpose(1, 2)
    vf = v.float().repeat_interleave(groups, dim=2).transpose(1, 2)
    qf = q.float().transpose(1, 2)
    kf = k.float().repeat_interleave(groups, dim=2).transpose(1, 2)
    dv = probs.transpose(-1, -2) @ do
    dp = do @ vf.transpose(-1, -2)
    delta = (do * out.float().transpose(1, 2)).sum(-1, keepdim=True)
    ds = probs * (dp - delta) * softmax_scale
    dq = ds @ kf
    dk = ds.transpose(-1, -2) @ qf
    dsinks = None
    if sinks is not None:
        sink_probs = torch.exp(sinks.float().view(1, -1, 1) - lse)  # (batch, heads, tokens)
        dsinks = -(sink_probs * delta.squeeze(-1)).sum(dim=(0, 2))

    def to_kv_heads(grad):  # (batch, heads, tokens, dim) -> (batch, tokens, kv_heads, dim), groups summed
        b, h, t, d = grad.shape
        return grad.view(b, h // groups, groups, t, d).sum(2).transpose(1, 2).to(k.dtype).contiguous()
    return (dq.transpose(1, 2).to(q.dtype).contiguous(), to_kv_heads(dk), to_kv_heads(dv),
            _sink_grad(dsinks, sinks, q))


@fa4_forward.register_fake
def _fa4_forward_fake(q, k, v, softmax_scale, causal, cu_seqlens, max_seqlen, window_left=-1, sinks=None):
    batch, tokens, heads, _ = q.shape
    return q.new_empty(batch, tokens, heads, v.shape[-1]), q.new_empty(batch, heads, tokens, dtype=torch.float32)


@fa4_backward.register_fake
def _fa4_backward_fake(grad_out, q, k, v, out, lse, softmax_scale, causal, cu_seqlens, max_seqlen, window_left=-1,
                       sinks=None):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            q.new_empty(0) if sinks is None else torch.empty_like(sinks))


def _setup_context(ctx, inputs, output):
    q, k, v, softmax_scale, causal, cu_seqlens, max_seqlen, window_left, sinks = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, sinks)
    # an attribute, not a saved tensor: a few bytes that activation offload need not move
    ctx.softmax_scale, ctx.causal, ctx.cu_seqlens, ctx.max_seqlen = softmax_scale, causal, cu_seqlens, max_seqlen
    ctx.window_left = window_left


def _backward(ctx, grad_out, grad_lse):
    # grad_lse is unused: callers never differentiate the log-sum-exp (fa4_attention returns the output only).
    q, k, v, out, lse, sinks = ctx.saved_tensors
    dq, dk, dv, dsinks = fa4_backward(grad_out.contiguous(), q, k, v, out, lse, ctx.softmax_scale, ctx.causal,
                                      ctx.cu_seqlens, ctx.max_seqlen, ctx.window_left, sinks)
    return dq, dk, dv, None, None, None, None, None, dsinks if sinks is not None else None


fa4_forward.register_autograd(_backward, setup_context=_setup_context)


# ------------------------------------------------------------------ transformers' attention interface


def fa4_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """An entry of transformers' attention registry: query (batch, heads, tokens, dim), key/value (batch,
    kv_heads, tokens, dim) in; (output (batch, tokens, heads, dim), None) out. Always causal; with
    transformers' variable-length keywords (`cu_seq_lens_q`, `max_length_q`: document packing, batch 1) each
    document attends only to itself; a layer's `sliding_window` W (transformers: a query sees keys with
    q - kv < W) becomes the kernel's window of W - 1 keys before the query. Under Ulysses this runs after the
    all-to-all, over the whole sequence, so a window that crosses slice boundaries sees every key it needs."""
    if attention_mask is not None:
        raise ConfigError("model.attn_implementation='fa4' runs causal attention over the whole sequence and "
                          "cannot take an attention mask (padding); use 'sdpa' for masked batches.")
    if dropout:
        raise ConfigError("model.attn_implementation='fa4' has no attention dropout; set the model's "
                          "attention_dropout to 0 or use 'sdpa'.")
    if kwargs.get("softcap"):
        raise ConfigError("model.attn_implementation='fa4' does not soft-cap attention scores here "
                          "(attn_logit_softcapping); it is not supported yet.")
    window_left = int(kwargs["sliding_window"]) - 1 if kwargs.get("sliding_window") else -1
    sinks = local_sinks(kwargs.get("s_aux"), query.shape[1])
    scale = float(scaling) if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    cu_seqlens, max_seqlen = _documents(kwargs, query)
    if module_layer_type(module) == "chunked_attention":  # Llama 4: each chunk (of each document) on its own
        cu_seqlens, max_seqlen = chunk_bounds(cu_seqlens, query.shape[2], module.config.attention_chunk_size,
                                              query.device)
    if query.is_cuda and not fa4_takes(query.shape[-1], value.shape[-1], torch.cuda.get_device_capability()):
        return wide_head_attention(query, key, value, scale, cu_seqlens, window_left, sinks), None
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # views, last dimension still contiguous
    out, _ = torch.ops.ulysses_train.fa4_forward(q, k, v, scale, True, cu_seqlens, max_seqlen, window_left, sinks)
    return out, None


FA4_HOPPER_WIDEST = 256
"""The widest q/k or v head FlashAttention 4 takes on Hopper (its interface's `_validate_head_dims`: 8 to 256 on
SM90; DeepSeek's 192/128 among them). Gemma 4's global layers are 512 wide."""


def fa4_takes(width: int, value_width: int, capability: tuple) -> bool:
    """Whether FlashAttention 4 runs heads of these widths on a GPU of this compute capability."""
    return capability[0] != 9 or max(width, value_width) <= FA4_HOPPER_WIDEST


def wide_head_attention(query, key, value, scale: float, cu_seqlens, window_left: int, sinks) -> torch.Tensor:
    """Causal attention of heads FlashAttention 4 does not take here, through SDPA's memory-efficient kernel: on an
    H100 the only exact kernel found to take 512-wide heads (cuDNN, SDPA's flash and FlexAttention refuse them:
    benchmarks/RESULTS.md, "Head widths of the 2026 families"), each packed document on its own (the kernel takes
    no document lengths). query (batch, heads, tokens, dim), key/value (batch, kv_heads, tokens, dim) in; (batch,
    tokens, heads, dim) out. Windows and sinks are not built on this path (Gemma 4's wide layers have neither)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if window_left >= 0 or sinks is not None:
        raise ConfigError(f"attention heads {query.shape[-1]} wide with a sliding window or sinks: FlashAttention 4 "
                          f"takes heads up to {FA4_HOPPER_WIDEST} wide on this GPU and the wide-head path has "
                          f"neither; not supported.")
    groups = query.shape[1] // key.shape[1]
    key, value = (t.repeat_interleave(groups, dim=1) if groups > 1 else t for t in (key, value))
    bounds = [0, query.shape[2]] if cu_seqlens is None else [int(b) for b in cu_seqlens.tolist()]
    backends = [SDPBackend.EFFICIENT_ATTENTION] if query.is_cuda else [SDPBackend.MATH]
    with sdpa_kernel(backends):
        pieces = [torch.nn.functional.scaled_dot_product_attention(
            query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], is_causal=True, scale=scale)
            for s, e in zip(bounds[:-1], bounds[1:])]
    return torch.cat(pieces, dim=2).transpose(1, 2)


def local_sinks(sinks: Optional[torch.Tensor], heads: int) -> Optional[torch.Tensor]:
    """A layer's attention sinks (`s_aux`, one per query head of the model) for the heads this call holds. Under
    Ulysses the attention runs after the all-to-all on heads/sp heads: DeepSpeed sends head group w of every
    slice to rank w, so sp rank r holds query heads [r * heads, (r + 1) * heads). The slice keeps autograd: each
    rank's gradient lands in its own heads' entries and ZeRO-3's reduction sums them."""
    if sinks is None or sinks.shape[0] == heads:
        return sinks
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    rank = parallel_state_sp.get_sequence_parallel_rank()
    if sinks.shape[0] != heads * parallel_state_sp.get_sequence_parallel_world_size():
        raise ValueError(f"{sinks.shape[0]} attention sinks for {heads} heads per rank: they do not split over sp.")
    return sinks[rank * heads:(rank + 1) * heads]


def _documents(kwargs: dict, query: torch.Tensor) -> tuple[Optional[torch.Tensor], int]:
    """The variable-length keywords (cu_seqlens as int32 on the query's device, max length), or (None, 0)."""
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    if cu_seqlens is None:
        return None, 0
    if query.shape[0] != 1:  # the lengths themselves were checked by slice_sequence (no device sync here)
        raise ValueError(f"document packing takes one sequence per batch; attention got a batch of {query.shape[0]}.")
    return cu_seqlens.to(device=query.device, dtype=torch.int32), int(kwargs.get("max_length_q") or query.shape[2])


def chunk_bounds(cu_seqlens: Optional[torch.Tensor], tokens: int, chunk: int, device) -> tuple[torch.Tensor, int]:
    """Variable-length bounds that cut each document (the whole sequence where `cu_seqlens` is None) into runs of
    `chunk` tokens from its own start, and the longest run: Llama 4's chunked attention layers, in which a query
    sees only the earlier keys of its chunk (transformers' chunked causal mask), as documents for the kernel. Read
    to the host once per layer call (the bounds' count depends on them)."""
    starts = [0, tokens] if cu_seqlens is None else [int(b) for b in cu_seqlens.tolist()]
    bounds = sorted({b for start, end in zip(starts[:-1], starts[1:]) for b in range(start, end, chunk)} | {tokens})
    lengths = [end - start for start, end in zip(bounds[:-1], bounds[1:])]
    return torch.tensor(bounds, dtype=torch.int32, device=device), max(lengths)


def register_fa4_attention() -> None:
    """Make 'fa4' a transformers attention implementation (and its mask function: none is built when
    there is no padding). Idempotent; must run before the model is built and before Ulysses wraps it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

    AttentionInterface.register(NAME, fa4_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, flash_attention_mask)
