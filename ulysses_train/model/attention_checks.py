"""Which attention kernels a run's sliding windows and packed documents need: checked once the attention
implementation is resolved (training/resolved_run.py), before the model is built. Under Ulysses DeepSpeed drops
transformers' masks (they are built for a rank's slice), so windows and documents must reach the kernel itself."""
from __future__ import annotations

from ulysses_train.errors import ConfigError
from ulysses_train.model.architecture import text_config
from ulysses_train.model.mixers import has_sliding_windows

VARLEN_ATTENTION = ("fa4", "flash_attention_2")  # kernels that take cu_seqlens: documents attend only to themselves


def check_document_attention(packing: str, attn_implementation: str, requested: str) -> None:
    """Document packing needs a variable-length attention kernel. SDPA (and eager) would need a block-diagonal
    seq x seq mask, which does not fit at these lengths, and under Ulysses DeepSpeed drops masks anyway, so
    documents would silently attend to each other. `requested`: the config's value (auto shows how it
    resolved)."""
    if packing != "documents" or attn_implementation in VARLEN_ATTENTION:
        return
    how = f" (auto chose {attn_implementation!r}: no Hopper GPU with flash-attn-4 here)" if requested == "auto" else ""
    raise ConfigError(f"data.packing=documents needs variable-length attention, but model.attn_implementation is "
                      f"{attn_implementation!r}{how}: SDPA and eager cannot hold a block-diagonal mask at these "
                      f"lengths. Fix: model.attn_implementation fa4 (FlashAttention 4; on CPU its reference kernel) "
                      f"or flash_attention_2, or data.packing glue.")


SDPA_WINDOW_MASK_BYTES = 1 << 30
"""The largest seq x seq boolean mask a sliding window may take through SDPA at sp=1 (32,768 tokens): transformers
builds that mask for SDPA, and past this size it alone takes gigabytes the planner does not count."""


def check_window_attention(hf_config, attn_implementation: str, requested: str, *, sp: int, seq_length: int) -> None:
    """Sliding-window layers need a kernel that takes the window: under Ulysses DeepSpeed drops transformers'
    masks (they are built for the local slice), so SDPA would silently attend to the whole past. FlashAttention 4
    takes the window (fa4.py; on CPU its reference kernel). At sp=1 transformers' own window mask is exact, and
    SDPA is allowed while that seq x seq mask stays within SDPA_WINDOW_MASK_BYTES. `requested`: the config's value
    (auto shows how it resolved)."""
    if attn_implementation == "fa4" or not has_sliding_windows(hf_config):
        return
    if sp == 1 and seq_length * seq_length <= SDPA_WINDOW_MASK_BYTES:
        return
    how = f" (auto chose {attn_implementation!r}: no Hopper GPU with flash-attn-4 here)" if requested == "auto" else ""
    window = getattr(text_config(hf_config), "sliding_window", None)
    if sp > 1:
        reason = "under Ulysses its masks are dropped and every layer would attend to the whole past"
    else:
        reason = (f"SDPA takes the window only as transformers' seq x seq mask, {seq_length ** 2 / 2 ** 30:.0f} GiB "
                  f"at {seq_length:,} tokens (allowed up to {int(SDPA_WINDOW_MASK_BYTES ** 0.5):,} tokens)")
    what = (f"sliding-window attention layers (window {window})" if window else
            f"chunked attention layers (chunks of {getattr(text_config(hf_config), 'attention_chunk_size', None)})")
    raise ConfigError(f"the model has {what}, but "
                      f"model.attn_implementation is {attn_implementation!r}{how}: {reason}. Fix: "
                      f"model.attn_implementation fa4 (FlashAttention 4 on a Hopper-or-newer GPU; on CPU its reference "
                      f"kernel).")
