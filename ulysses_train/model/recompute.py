"""Per-layer checkpoint functions: PyTorch's non-reentrant checkpoint plus two levers.

- Activation offload (`activation_checkpointing.cpu_checkpointing: true` in the DeepSpeed JSON): each layer's
  input, and any attention output kept below, waits in host memory between forward and backward
  (offload.py).
- Attention that is never recomputed (`model.keep_attention_fraction`): plain checkpointing runs every
  layer's forward twice, attention included, and attention is the O(T^2) part. In the chosen layers the
  outputs of the attention kernel (output and log-sum-exp) are saved in forward and handed back to the
  recompute instead of running the kernel again. The cost is memory: about T x heads x head_dim values
  per kept layer, on the host when offload is on.

What the recompute of a kept layer still runs: norms, q/k/v projections, RoPE and, under Ulysses sp, the
three all-to-alls before attention (the kernel's backward needs q, k and v in the gathered layout; they are
rebuilt, not saved) and the one after it (o_proj saves its input, the all-to-all's output), then o_proj and
the MLP. Saving the all-to-all outputs as well would drop those four collectives from the recompute but
cost q + k + v memory per layer (about 1.5x the attention output for Qwen3's GQA); they are recomputed
bit-for-bit, so correctness does not need them. The tests count kernel runs and all-to-alls to pin this.

Why our own pair of dispatch modes rather than `torch.utils.checkpoint.create_selective_checkpoint_contexts`
with a MUST_SAVE policy: that is the same mechanism (a TorchDispatchMode in forward caches the op's
outputs, one in the recompute returns them), but its cache holds plain device tensors with no hook to move
them, so kept attention outputs could not be offloaded with the rest; its storage layout also differs
between torch 2.11 and 2.13. Ours keeps only the attention ops and routes their outputs through the
offloader when it is on.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import math
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ulysses_train.config import ConfigError
from ulysses_train.model import fa4  # noqa: F401  (registers torch.ops.ulysses_train.fa4_forward)
from ulysses_train.model.mixers import attention_layer_indices
from ulysses_train.model.offload import ActivationOffloader, SavedActivation
from ulysses_train.model.swap import swap_class

logger = logging.getLogger(__name__)

SDPA_KERNELS = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
                "_scaled_dot_product_fused_attention_overrideable")
FLASH_ATTN_KERNELS = ("_flash_attn_forward", "_flash_attn_varlen_forward")  # flash_attn >= 2.7 custom ops


def attention_ops() -> frozenset:
    """The attention kernels whose outputs a kept layer saves: SDPA's backends (what `F.scaled_dot_product_
    attention` dispatches to), FlashAttention 4's forward op (fa4.py) and, when flash_attn is loaded, its
    custom ops."""
    ops = {getattr(torch.ops.aten, name).default for name in SDPA_KERNELS if hasattr(torch.ops.aten, name)}
    ops.add(torch.ops.ulysses_train.fa4_forward.default)
    for name in FLASH_ATTN_KERNELS:
        with contextlib.suppress(AttributeError, RuntimeError):
            ops.add(getattr(torch.ops.flash_attn, name).default)
    return frozenset(ops)


def _map(fn, out, kinds):
    """`fn` applied to the items of an op's output (a tensor or a tuple of tensors and ints) of `kinds`."""
    if isinstance(out, (tuple, list)):
        return type(out)(_map(fn, item, kinds) for item in out)
    return fn(out) if isinstance(out, kinds) else out


class _Kept:
    """An attention output kept on the device (no offload)."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class _SaveAttention(TorchDispatchMode):
    """Forward of a kept layer: run everything, and store the attention kernels' outputs in `store`."""

    def __init__(self, ops: frozenset, store: list, offloader: Optional[ActivationOffloader]):
        super().__init__()
        self.ops, self.store, self.offloader = ops, store, offloader

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.ops:
            self.store.append(_map(self._keep, out, torch.Tensor))
        return out

    def _keep(self, tensor: torch.Tensor):
        tensor = tensor.detach()  # a new tensor sharing memory: autograd's history stays on the original
        return self.offloader.pack(tensor) if self.offloader is not None else _Kept(tensor)


class _ReuseAttention(TorchDispatchMode):
    """Recompute of a kept layer: hand back the stored outputs instead of running the attention kernel."""

    def __init__(self, ops: frozenset, store: list, offloader: Optional[ActivationOffloader]):
        super().__init__()
        self.ops, self.store, self.offloader = ops, store, offloader

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func not in self.ops:
            return func(*args, **(kwargs or {}))
        if not self.store:
            raise RuntimeError(f"kept attention: the recompute ran {func} more often than the forward did.")
        return _map(self._restore, self.store.pop(0), (_Kept, SavedActivation))

    def _restore(self, kept):
        return kept.tensor if isinstance(kept, _Kept) else self.offloader.unpack(kept)


_warned_no_attention = False
NO_KERNEL_WARNING = ("model.keep_attention_fraction > 0 but no fused attention kernel ran in a kept layer, so its "
                     "attention is recomputed as usual: SDPA took its unfused math path, as it does for value heads of "
                     "another width than the query/key heads (MLA: Kimi Linear) on CPU and for fp32 with GQA, or the "
                     "attention calls no kernel (attn_implementation eager).")
"""Said once. sdpa may well be set: which inputs SDPA sends to its math path (where no kernel op runs to keep) is the
usual reason, not the setting."""


def checkpoint_layer(function, *args, keep_attention: bool = False, offloader: Optional[ActivationOffloader] = None,
                     keep_on_device: bool = False, ops: Optional[frozenset] = None, use_reentrant: bool = False,
                     **kwargs):
    """Drop-in for `torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)` on one layer.

    `keep_attention`: save the attention kernel's outputs instead of recomputing them. `offloader`: offload
    the layer's input (and kept outputs) unless `keep_on_device` (the last layer: backward needs it first).
    """
    global _warned_no_attention
    if use_reentrant:
        raise ValueError("checkpoint_layer is non-reentrant only (use_reentrant=False).")
    store: list = []
    context_fn = torch.utils.checkpoint.noop_context_fn
    if keep_attention:
        ops = attention_ops() if ops is None else ops

        def context_fn():
            return _SaveAttention(ops, store, offloader), _ReuseAttention(ops, store, offloader)
    with contextlib.ExitStack() as stack:
        if offloader is not None:
            stack.enter_context(offloader.layer(keep_on_device))
            stack.enter_context(offloader.hooks())
        out = torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, context_fn=context_fn, **kwargs)
    if keep_attention and not store and torch.is_grad_enabled() and not _warned_no_attention:
        logger.warning(NO_KERNEL_WARNING)
        _warned_no_attention = True
    return out


def decoder_layers(model) -> list:
    """The model's repeated blocks that transformers checkpoints, in execution order."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def layer_share(num_layers: int, fraction: float) -> int:
    """fraction x layers as a whole number of layers, halves rounded up: floor(x + 0.5).

    Not Python's round(), which rounds halves to even: 0.125 of 36 layers is 4.5, which is 5 layers here and
    would be 4 there. Halves up is what the trainer has always run, so it is what every measured run with
    these levers (benchmarks/) had; the planner, which used round(), now counts with the trainer's
    functions below, so both agree at every depth and fraction (tests/test_planner.py)."""
    return math.floor(fraction * num_layers + 0.5)


def kept_attention_layers(num_layers: int, fraction: float, attention_layers: Optional[list] = None) -> list[int]:
    """layer_share(attention layers, fraction) layer indices, spread evenly over the layers that run an attention
    kernel (`attention_layers`; default all: a hybrid's linear-attention layers have none to keep). The planner
    counts with it."""
    candidates = list(range(num_layers)) if attention_layers is None else list(attention_layers)
    count = min(len(candidates), layer_share(len(candidates), fraction))
    return sorted({candidates[int((i + 0.5) * len(candidates) / count)] for i in range(count)}) if count else []


def offloaded_layer_count(num_layers: int, offload_fraction: float) -> int:
    """How many layers, the first ones, offload: layer_share(layers, fraction), never the last layer (backward
    needs it first, so a round trip would only stall). The layers that stay are the last ones: backward
    reaches them first, so they need no prefetch, and the GPU holds the same amount whichever stay. The
    planner counts with it (host memory: at most layers - 1 checkpoints)."""
    return min(num_layers - 1, layer_share(num_layers, offload_fraction)) if num_layers else 0


def apply_checkpoint_levers(model, keep_attention_fraction: float = 0.0, offload: bool = False,
                            offload_fraction: float = 1.0) -> Optional[ActivationOffloader]:
    """Give every decoder layer its checkpoint function; returns the offloader (None without offload).

    Call after gradient checkpointing is enabled. With both levers off the layers keep plain checkpointing.
    `offload_fraction`: the share of layers that offload (offloaded_layer_count). The offloader is also stored
    as `model.activation_offloader` (see `offload_pinned_bytes`).
    """
    model.activation_offloader = None
    if not offload and keep_attention_fraction <= 0:
        return None
    layers = decoder_layers(model)
    if not layers or not all(layer.gradient_checkpointing for layer in layers):
        lever = "activation_checkpointing.cpu_checkpointing (DeepSpeed JSON)" if offload else \
            "model.keep_attention_fraction"
        raise ConfigError(f"{lever} acts on checkpointed layers, but gradient checkpointing is off; set "
                          f"model.gradient_checkpointing: true (or switch the lever off).")
    offloader = ActivationOffloader() if offload else None
    attention = attention_layer_indices(getattr(model, "config", None))  # None: every layer attends
    kept = set(kept_attention_layers(len(layers), keep_attention_fraction, attention))
    offloaded = offloaded_layer_count(len(layers), offload_fraction)
    ops = attention_ops()
    for index, layer in enumerate(layers):
        layer._gradient_checkpointing_func = functools.partial(
            checkpoint_layer, keep_attention=index in kept, offloader=offloader,
            keep_on_device=index >= offloaded, ops=ops)
        layer.checkpoint_levers = ", ".join(
            (["attention output kept"] if index in kept else [])
            + (["offloaded to host"] if offload and index < offloaded else []))
        swap_class(layer, "Levered", extra_repr=_levers_repr)
    model.activation_offloader = offloader
    model.checkpoint_levers_summary = (f"attention kept in {len(kept)} of {len(layers)} layers, activation offload "
                                       + (f"in {offloaded} of {len(layers)}" if offload else "off"))
    return offloader


def _levers_repr(self) -> str:
    """What `print(model)` shows of a `Levered<DecoderLayer>`: its checkpoint levers."""
    return f"checkpoint: {self.checkpoint_levers or 'plain recompute'}"


def activation_offloader_of(model) -> Optional[ActivationOffloader]:
    """The activation offloader install_checkpoint_levers put on `model` (or a module inside it); None when off."""
    for module in model.modules():
        offloader = getattr(module, "activation_offloader", None)
        if offloader is not None:
            return offloader
    return None


def offload_pinned_bytes(model) -> int:
    """Host memory the activation offload holds now (0 when off). Grows in the first step, then stays."""
    offloader = activation_offloader_of(model)
    return offloader.pinned_bytes() if offloader is not None else 0
