"""RMSNorm whose backward never holds fp32 copies of a whole sequence.

Qwen3's RMSNorm (as Llama's, Qwen2's, Mistral's) computes in fp32: `w * (x.float() * rsqrt(mean(x^2) +
eps)).to(dtype)`. Autograd then saves the fp32 copy of the input and the bf16 normalized tensor, and the
backward creates about four more fp32 tensors of the input's size: ~18 bytes per element at its peak,
against 2 for the bf16 input. A decoder layer has four such norms (before attention, before the MLP, and
per head on q and k); at long lengths the post-attention norm's backward is the largest transient of a
recomputed layer once TiledMLP has shrunk the MLP (the planner's `norm` moment, ulysses_train/planner).

`LowMemoryRMSNormFunction` computes the same function but saves only the input (in its own dtype) and one
fp32 scale per row, and runs its backward over row chunks of about CHUNK_ELEMENTS elements, so the
backward's fp32 temporaries are bounded by the chunk, whatever the length. (Forward temporaries are freed
before forward returns, so forward needs no chunking.) The arithmetic follows the Hugging Face module
step by step (fp32 statistics, cast of the normalized values to the input dtype before the weight), so
outputs are identical and gradients equal up to summation order.

`model.rmsnorm` (default `torch`; `hf` keeps Hugging Face's) replaces every norm of a known equivalent class with
the kernel it names. The default, `torch`, is torch.nn.functional.rms_norm: on CUDA one fused kernel each way
(`_fused_rms_norm` and its backward), which also saves only the input and one fp32 scale per row. On an H200 it runs
several times faster than either the chunked function below or Hugging Face's module (whose chains of elementwise
kernels are most of a step's memory traffic, see `benchmarks/elementwise_census.py` (removed; it ran at commit
2a4a0a9, `git show 2a4a0a9:benchmarks/elementwise_census.py`) and benchmarks/HISTORY.md, "Where a 128K step's time
goes, and the model-FLOPs ceiling") and makes whole steps faster at the same peak memory (benchmarks/RESULTS.md,
"Torch's fused RMSNorm, a 384K full-depth step, sp=2 gradients with every lever"); its outputs differ from Hugging
Face's by bf16 rounding (it applies the weight before the single cast).
`chunked` selects LowMemoryRMSNormFunction below, for outputs bit-equal to Hugging Face's.

Norms that scale by `1 + w` in fp32 and cast once at the end (Qwen3.5's, Qwen3-Next's, Gemma 3's:
architecture.OFFSET_RMSNORMS) are, under `torch` on a GPU with liger-kernel installed, Liger's RMSNorm with offset 1
and its `gemma` casting: the same arithmetic (fp32 throughout, one cast) in one kernel each way, saving the input
and one fp32 scale per row. Transformers' module is a chain of fp32 elementwise kernels, about 2 s of a 128K
Qwen3.5-9B step on an H200 (benchmarks/RESULTS.md, "where the 128K step's time goes"). Without CUDA or Liger,
and under `chunked` (which promises bit-equal outputs), they stay Hugging Face's modules.
"""
from __future__ import annotations

import importlib.util
import logging

import torch

from ulysses_train.model.architecture import LLAMA_STYLE_RMSNORMS, OFFSET_RMSNORMS
from ulysses_train.model.swap import swap_class

logger = logging.getLogger(__name__)

CHUNK_ELEMENTS = 1 << 24  # 64 MiB per fp32 temporary
# classes whose forward is exactly w * (x.float() * rsqrt(mean(x^2) + eps)).to(x.dtype)


def _row_chunks(rows: int, width: int):
    step = max(1, CHUNK_ELEMENTS // max(1, width))
    return [(start, min(rows, start + step)) for start in range(0, rows, step)]


class LowMemoryRMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # whole-tensor, as Hugging Face's module: its fp32 temporaries are freed at once (forward keeps only
        # what is saved below), and few large ops matter under checkpointing's dispatch modes, which see
        # every op of a kept-attention layer's forward in Python (chunking here made a whole step slower on an
        # H200: benchmarks/HISTORY.md, "Low-memory RMSNorm")
        width = x.shape[-1]
        flat = x.reshape(-1, width)
        xf = flat.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        out = weight * (xf * rstd).to(x.dtype)
        ctx.save_for_backward(flat, weight, rstd)
        ctx.input_shape = x.shape
        return out.view(*x.shape[:-1], width)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        flat, weight, rstd = ctx.saved_tensors
        width = flat.shape[-1]
        grad_flat = grad_out.reshape(-1, width)
        grad_x = torch.empty_like(flat) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(width, dtype=torch.float32, device=flat.device) if ctx.needs_input_grad[1] else None
        for start, end in _row_chunks(flat.shape[0], width):
            rstd_c, dy = rstd[start:end], grad_flat[start:end]
            xhat = flat[start:end].float() * rstd_c  # not in place: for fp32 input .float() is the input itself
            if grad_w is not None:
                # as autograd differentiates `weight * xhat.to(dtype)`: the product in the input dtype, summed
                # over rows with fp32 accumulation
                grad_w += (dy * xhat.to(flat.dtype)).sum(0, dtype=torch.float32)
            if grad_x is not None:
                # then through xhat = x * rstd(x): dx = rstd * (dxhat - xhat * mean(dxhat * xhat)), in place on
                # dxhat (a fresh tensor), cast to the input dtype by the copy into grad_x
                dxhat = (dy * weight).float()
                mean = (dxhat * xhat).mean(-1, keepdim=True)
                grad_x[start:end].copy_(dxhat.addcmul_(xhat, mean, value=-1).mul_(rstd_c))
        return (grad_x.view(ctx.input_shape) if grad_x is not None else None,
                grad_w.to(weight.dtype) if grad_w is not None else None, None)


def low_memory_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return LowMemoryRMSNormFunction.apply(x, weight, eps)


def _forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return low_memory_rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _torch_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """torch's RMSNorm: on CUDA a fused kernel each way (saving the input and one fp32 scale per row, as
    ours); elsewhere its composite form. It multiplies the weight in fp32 before the one cast to the input
    dtype, where Hugging Face's module casts first: outputs agree up to that rounding."""
    return torch.nn.functional.rms_norm(hidden_states, (hidden_states.shape[-1],), self.weight,
                                        self.variance_epsilon)


def liger_rms_norm_function():
    """Liger's RMSNorm autograd function (a Triton kernel each way; imported on use: it needs a GPU)."""
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    return LigerRMSNormFunction


def liger_offset_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """`(x.float() * rsqrt(mean(x^2) + eps) * (1 + w.float())).to(dtype)` as Liger computes it (offset 1, `gemma`
    casting: fp32 throughout), not in place (the residual stream still needs the output gradient)."""
    return liger_rms_norm_function().apply(hidden_states, self.weight, self.eps, 1.0, "gemma", False)


def offset_norm_kernel_runs() -> bool:
    """Whether the (1 + w) norms run as Liger's kernel here (the planner's `offset_norm_kernel`): CUDA and
    liger-kernel installed."""
    return torch.cuda.is_available() and importlib.util.find_spec("liger_kernel") is not None


FORWARDS = {"chunked": _forward, "torch": _torch_forward}
KERNEL_CLASS_PREFIX = {"chunked": "Chunked", "torch": "Fused"}  # ChunkedQwen3RMSNorm, FusedQwen3RMSNorm


def replace_rmsnorms(model: torch.nn.Module, kernel: str = "chunked") -> int:
    """Swap every RMSNorm of a Llama-style class for one computing with `kernel`; returns how many changed.

    `kernel`: `chunked` (LowMemoryRMSNormFunction, class `Chunked<Norm>`) or `torch` (torch.nn.functional.rms_norm,
    class `Fused<Norm>`; and where offset_norm_kernel_runs, the (1 + w) norms as Liger's, class `Liger<Norm>`). The module, its parameter and its hooks stay as they are (ZeRO-3 keeps gathering the
    weight around the call), only the computation changes (`swap.swap_class`). Norms of other classes (e.g. Gemma's, which scales by 1 + w) are left alone, with a
    warning naming them."""
    replaced, unknown = 0, set()
    offset_kernel = kernel == "torch" and offset_norm_kernel_runs()
    for module in model.modules():
        name = type(module).__name__
        if name in LLAMA_STYLE_RMSNORMS:
            swap_class(module, KERNEL_CLASS_PREFIX[kernel], forward=FORWARDS[kernel])
            replaced += 1
        elif offset_kernel and name in OFFSET_RMSNORMS:
            swap_class(module, "Liger", forward=liger_offset_forward)
            replaced += 1
        elif name.endswith("RMSNorm"):
            unknown.add(name)
    if unknown:
        logger.warning("model.rmsnorm: left %s as they are (not known to compute Llama-style RMSNorm).",
                       ", ".join(sorted(unknown)))
    return replaced
