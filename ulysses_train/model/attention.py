"""Make the model's attention call reach the fastest SDPA kernel on the card.

PyTorch's default SDPA dispatch prefers the flash kernel over cuDNN's, although on an H200 causal attention
forward+backward runs much faster through cuDNN (benchmarks/results/attention_sdpa_h200.jsonl; benchmarks/
RESULTS.md, "Attention kernels on the H200"), and attention dominates a long-sequence step. Inside
`sdpa_priority()` SDPA tries cuDNN first and falls back, per call, to flash, memory-efficient and math
when cuDNN refuses the inputs, so nothing can get slower than a kernel that refuses.

FlashAttention 4 (`model.attn_implementation: fa4`, fa4.py) is faster still on Hopper (RESULTS.md,
"FlashAttention 4 as the model's attention"); this module is for the SDPA path.

The priority must cover backward too: with gradient checkpointing the attention forward is recomputed
inside backward, and that recompute dispatches again.
"""
from __future__ import annotations

import contextlib

import torch

PRIORITY = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")


def sdpa_priority(enabled: bool = True):
    """A context in which SDPA tries the backends in PRIORITY order (CUDA only; a no-op elsewhere)."""
    if not (enabled and torch.cuda.is_available()):
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, name) for name in PRIORITY], set_priority=True)
