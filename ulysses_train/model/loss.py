"""Cross-entropy over hidden states, chunked so the `seq x vocab` logits never exist at once.

The model's forward stops at the last hidden state; this module owns the `lm_head` product.

`FusedChunkedCrossEntropy` walks the rows in chunks of `chunk_rows`. For each chunk it forms the
logits (one chunk, fp32), adds the chunk's summed negative log-likelihood, and - in the same pass -
turns the logits into their gradient (`softmax - onehot`) and multiplies it out into the gradients of
the hidden states and of the `lm_head` weight. Backward then only scales those saved gradients by the
incoming scalar. Nothing of size `chunk x vocab` outlives its chunk, and the `lm_head` product is never
recomputed (the checkpoint-per-chunk alternative runs it twice).

Models whose head scales or soft-caps the logits (architecture.LogitTransform: `cap * tanh(scale * z / cap)`,
Cohere's `logit_scale`, Granite's `logits_scaling`, Gemma's `final_logit_softcapping`) get the same transform
here, in fp32, and its derivative in the gradient: d/dz = scale * (1 - (capped / cap)^2).

The value returned is a *sum* over valid labels (label != -100) plus the count of those labels; the
caller divides by the token count of the whole step (all sp ranks, micro-steps and dp replicas) so the
loss is an exact token-weighted mean however the tokens are split (ulysses_train/DESIGN.md, 'How the loss
becomes exact').
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ulysses_train.constants import IGNORE_INDEX, LOSS_CHUNK_ROWS

_FUSED_GEMM_PROBED: dict = {}  # (device type, index) -> whether the fused GEMM works there


def fused_fp32_gemm_available(device: torch.device) -> bool:
    """Whether this device has `addmm(..., out_dtype=float32)` for bf16 inputs: one cuBLAS GEMM that
    multiplies in bf16, accumulates in fp32 and adds into an fp32 tensor in place (CUDA only, torch >= 2.8)."""
    if device.type != "cuda":
        return False
    key = (device.type, device.index)
    if key not in _FUSED_GEMM_PROBED:
        a = torch.ones(2, 2, dtype=torch.bfloat16, device=device)
        acc = torch.ones(2, 2, dtype=torch.float32, device=device)
        try:
            torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
            _FUSED_GEMM_PROBED[key] = bool(torch.all(acc == 3.0))
        except (TypeError, RuntimeError, NotImplementedError):
            _FUSED_GEMM_PROBED[key] = False
    return _FUSED_GEMM_PROBED[key]


def accumulate_weight_grad(grad_weight: torch.Tensor, grad_logits: torch.Tensor, h: torch.Tensor) -> None:
    """grad_weight += grad_logits.T @ h, with grad_weight in fp32 and the other two in the model's dtype.

    Why not simply `+=`: the product is then formed in bf16 (each chunk's sum rounded to bf16) and added by a
    separate mixed-dtype kernel that reads and writes the whole vocab x hidden fp32 accumulator once per
    chunk (at 131,072 tokens of Qwen3-4B: 512 chunks of 256 rows over a 151,936 x 2,560 weight), a visible
    share of a step on an H200 (benchmarks/HISTORY.md, "Where a 128K step's time goes, and the model-FLOPs
    ceiling"). Where the fused GEMM exists it does the same sum with fp32 accumulation and no extra pass;
    elsewhere (CPU, fp32/fp64 inputs) the plain form."""
    if grad_logits.dtype != grad_weight.dtype and fused_fp32_gemm_available(grad_weight.device):
        torch.addmm(grad_weight, grad_logits.t(), h, out_dtype=grad_weight.dtype, out=grad_weight)
    else:
        grad_weight += grad_logits.t() @ h


def transform_logits(logits: torch.Tensor, transform=None) -> torch.Tensor:
    """The model head's scale and soft-cap applied to raw logits (None or an identity transform: unchanged)."""
    if transform is None or transform.identity:
        return logits
    if transform.scale != 1.0:
        logits = logits * transform.scale
    if transform.softcap:
        logits = transform.softcap * torch.tanh(logits / transform.softcap)
    return logits


class FusedChunkedCrossEntropy(torch.autograd.Function):
    """sum of -log softmax(T(hidden @ weight.T))[label] over valid rows, T the model's logit transform;
    gradients computed in forward."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_rows: int,
                transform=None):
        need_hidden_grad, need_weight_grad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        rows = hidden.shape[0]
        acc_dtype = torch.promote_types(hidden.dtype, torch.float32)  # fp32, or fp64 when given fp64
        total = torch.zeros((), dtype=acc_dtype, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if need_hidden_grad else None
        # fp32 accumulation over chunks: thousands of bf16 partial sums would lose the small ones
        grad_weight = torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device) if need_weight_grad else None
        for start in range(0, rows, chunk_rows):
            end = min(start + chunk_rows, rows)
            h, y = hidden[start:end], labels[start:end]
            logits = transform_logits((h @ weight.t()).to(acc_dtype), transform)
            valid = y != IGNORE_INDEX
            target = y.clamp(min=0)
            lse = torch.logsumexp(logits, dim=-1)
            target_logit = logits.gather(1, target.unsqueeze(1)).squeeze(1)
            total += ((lse - target_logit) * valid).sum()
            if not (need_hidden_grad or need_weight_grad):
                continue
            chain = _transform_derivative(logits, transform)  # before `logits` is overwritten below
            # d(sum nll)/d(logits) = softmax - onehot on valid rows, 0 on ignored rows; built in place
            grad_logits = logits.sub_(lse.unsqueeze(1)).exp_()
            grad_logits[torch.arange(end - start, device=h.device), target] -= 1.0
            grad_logits.mul_(valid.unsqueeze(1))
            if chain is not None:
                grad_logits.mul_(chain)
            grad_logits = grad_logits.to(hidden.dtype)
            if need_hidden_grad:
                torch.mm(grad_logits, weight, out=grad_hidden[start:end])
            if need_weight_grad:
                accumulate_weight_grad(grad_weight, grad_logits, h)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_hidden, grad_weight = ctx.saved_tensors
        out_hidden = grad_hidden * grad_total.to(grad_hidden.dtype) if grad_hidden is not None else None
        out_weight = (grad_weight * grad_total).to(ctx.weight_dtype) if grad_weight is not None else None
        return out_hidden, out_weight, None, None, None


def _transform_derivative(transformed: torch.Tensor, transform):
    """d transformed / d raw logits, elementwise (a tensor, a number, or None for the identity)."""
    if transform is None or transform.identity:
        return None
    if not transform.softcap:
        return transform.scale
    return (1.0 - (transformed / transform.softcap).square()).mul_(transform.scale)


def chunked_nll_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                    chunk_rows: int = LOSS_CHUNK_ROWS, transform=None) -> torch.Tensor:
    """Summed NLL of `labels` under `T(hidden @ weight.T)` (T: the model's logit transform, or none), never
    holding more than one chunk of logits."""
    hidden = hidden.reshape(-1, hidden.shape[-1])
    return FusedChunkedCrossEntropy.apply(hidden, weight, labels.reshape(-1), chunk_rows, transform)


def full_logits_nll_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The plain path (`loss.type: nll`): cross-entropy over full logits. For comparison and small runs."""
    logits = logits.reshape(-1, logits.shape[-1]).float()
    return F.cross_entropy(logits, labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")

