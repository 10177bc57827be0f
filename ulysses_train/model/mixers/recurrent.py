"""What every recurrent token mixer (Gated DeltaNet, Kimi Delta Attention, Mamba2) does the same way under Ulysses,
in one place: which kernels run, where packed documents restart, the causal conv over the channels a rank owns, and
the weights read outside their modules' forwards.

The shared shape of such a layer. Its projections run on this rank's slice of the sequence; one all-to-all
(SequenceParallel.to_head_shards) trades the slice of all heads for the whole sequence of `units / sp` heads (or
groups); a depthwise causal conv1d (one filter per channel) and a chunked recurrence run over that whole sequence,
restarting at every packed document; one all-to-all brings the output back to the slice. Because the conv is
depthwise, a rank only needs the filters of the channels it holds after the exchange (`local_channels`).

Kernels: on CUDA with flash-linear-attention (`fla`) installed, fla's kernels by name with `cu_seqlens` for the
documents (one launch for the whole sequence); elsewhere transformers' own torch functions from the layer's modeling
file (`torch_function`, unwrapped from the hub-kernel decorator so nothing else is picked), run once per document
(`per_document`). Dimension names used by the mixers: B batch (1 in training), t a rank's slice length, T = sp*t the
whole sequence, C conv channels, H heads, d a head's width, sp the sequence-parallel size."""
from __future__ import annotations

import importlib.util
import inspect
import sys
from typing import Callable, Optional

import torch

from ulysses_train.config import ConfigError
from ulysses_train.kernel_pins import INSTALL_LINE
from ulysses_train.model.swap import stock_class
from ulysses_train.sequence_parallel import SequenceParallel

TORCH_RULE_LIMIT = 32_768
"""Tokens beyond which a GPU run refuses transformers' torch recurrences (Python loops over 64- or 256-token chunks
per layer: hours per step at 1M tokens) and asks for fla's kernels instead."""


def fla_available() -> bool:
    return importlib.util.find_spec("fla") is not None


TORCH = "torch"
"""The kernel variant of every recurrent mixer off CUDA or without fla: transformers' torch functions (the
reference: slow, fine at test lengths)."""


def fla_or_torch(cuda: bool, kernels_installed: bool, fla_variant: str) -> str:
    """A recurrent mixer's kernel variant (Mixer.choose_kernel): `fla_variant` on a GPU run with its fla kernels
    installed, TORCH elsewhere."""
    return fla_variant if cuda and kernels_installed else TORCH


def runs_fla(layer) -> bool:
    """Whether an installed layer computes with fla's kernels: the variant its install was given (Mixer.install)."""
    return layer.kernel_variant != TORCH


def check_torch_fallback_length(layers: str, seq_length: int, cuda: bool, kernels_installed: bool,
                                kernels: str, install: str) -> None:
    """Before the model loads: a GPU run past TORCH_RULE_LIMIT tokens needs fla's kernels for these layers; say so
    and how to install them (ConfigError). `layers` names the layers, `kernels` the missing module."""
    if not cuda or kernels_installed or seq_length <= TORCH_RULE_LIMIT:
        return
    raise ConfigError(f"the model has {layers} layers and data.seq_length={seq_length:,}, but {kernels} not "
                      f"installed: transformers' torch fallback loops over short chunks and would take hours per "
                      f"step. Fix: {install}, or a seq_length up to {TORCH_RULE_LIMIT:,}.")


def fla_backward_problem(capability: tuple, triton_version: str, tilelang_installed: bool) -> Optional[str]:
    """Why fla cannot run the gated delta rule's backward here, or None. fla 0.6 refuses it (the gated delta rule's, and chunk_simple_gla's chunk_bwd_dqkwg, which Mamba2 runs) on Hopper with Triton
    3.4 to 3.7.0 (Triton compiles it to wrong results there, fla issue 640) unless its tilelang backend is
    installed, which it then takes. Found on the H200 image's Triton 3.6.0 (benchmarks/RESULTS.md)."""
    from packaging.version import Version

    triton = Version(triton_version.split("+")[0])
    if capability[0] != 9 or not Version("3.4.0") <= triton < Version("3.7.1") or tilelang_installed:
        return None
    return (f"fla's Gated DeltaNet backward refuses Triton {triton_version} on Hopper GPUs (it computes wrong "
            f"gradients there: fla issue 640). Fix: pip install 'triton>=3.7.1' (if your torch allows it) or "
            f"pip install tilelang (fla then runs that backward with tilelang; {INSTALL_LINE} brings it)")


def check_fla_backward() -> None:
    """On a CUDA run with fla: refuse a Triton that fla's backward refuses, before the model loads."""
    import triton

    problem = fla_backward_problem(torch.cuda.get_device_capability(), triton.__version__,
                                   importlib.util.find_spec("tilelang") is not None)
    if problem:
        raise ConfigError(problem + ".")


def torch_function(module, name: str):
    """transformers' torch implementation `name` from the module's own modeling file, without the hub-kernel or fla
    dispatch around it (so the CPU reference is always transformers' own math)."""
    return inspect.unwrap(getattr(sys.modules[stock_class(module).__module__], name))


def documents(cu_seq_lens: Optional[torch.Tensor], total: int) -> list[tuple[int, int]]:
    """(start, end) of every document of the whole sequence; one when nothing is packed."""
    if cu_seq_lens is None:
        return [(0, total)]
    bounds = [int(x) for x in cu_seq_lens.tolist()]
    return list(zip(bounds[:-1], bounds[1:]))


def per_document(function: Callable, sequences: list, cu_seq_lens: Optional[torch.Tensor], **kwargs):
    """`function(*pieces, **kwargs)` on each document's piece of every [B, T, ...] tensor in `sequences` (None
    entries passed as they are), the outputs joined along T: a fresh state at every document for a torch function
    that knows no documents."""
    total = next(x for x in sequences if x is not None).shape[1]
    pieces = [function(*(None if x is None else x[:, s:e] for x in sequences), **kwargs)
              for s, e in documents(cu_seq_lens, total)]
    return torch.cat(pieces, dim=1) if len(pieces) > 1 else pieces[0]


def causal_conv(module, x, weight, cu_seq_lens, bias=None):
    """Depthwise causal conv1d + the layer's activation (`module.activation`) over x [B, T, C] with filters weight
    [C, W] (and bias [C]), restarting at every document (zeros before each document's first token)."""
    if runs_fla(module):
        from fla.modules.causal_conv1d import causal_conv1d

        return causal_conv1d(x, weight=weight, bias=bias, activation=module.activation,
                             cu_seqlens=None if cu_seq_lens is None else cu_seq_lens.to(x.device, torch.long))[0]
    conv = torch_function(module, "causal_conv1d_fn")
    return per_document(lambda piece: conv(piece.transpose(1, 2), weight, bias, activation=module.activation)
                        .transpose(1, 2), [x], cu_seq_lens)


def local_channels(widths, rank: int, sp: int) -> torch.Tensor:
    """Indices of rank `rank`'s conv channels when the conv's channels are parts of these widths side by side (the
    Gated DeltaNet's [q | k | v], Mamba2's [x | B | C]), heads in order within each part: the rank's 1/sp of every
    part."""
    starts = [sum(widths[:i]) for i in range(len(widths))]
    return torch.cat([start + torch.arange(rank * width // sp, (rank + 1) * width // sp)
                      for start, width in zip(starts, widths)])


def owned_filters(weight: torch.Tensor, channels: Optional[torch.Tensor]) -> torch.Tensor:
    """The rows of a conv's filters (or bias) for the channels this rank holds (None: every channel, sp=1)."""
    return weight if channels is None else weight[channels.to(weight.device)]


def side_by_side(*parts: torch.Tensor) -> torch.Tensor:
    """The parts' channels side by side ([B, T, C1 + C2 + ...]), as the conv reads them. Parts that are still the
    consecutive channel blocks of one tensor (at sp=1, Qwen3.5's q, k, v are its `in_proj_qkv` output, split) give
    that tensor back, not a copy: the concatenation would write it again (2 GiB per layer at 131,072 tokens, in the
    forward and the recompute) and its backward would concatenate the gradients once more."""
    flat = [x.flatten(2) for x in parts]
    batch, length, width = *flat[0].shape[:2], sum(x.shape[-1] for x in flat)
    base = parts[0]._base
    if (base is not None and base.is_contiguous() and base.numel() == batch * length * width
            and all(x._base is base for x in parts)):
        offsets = [sum(x.shape[-1] for x in flat[:i]) for i in range(len(flat))]
        if all(x.stride() == (length * width, width, 1) and x.data_ptr() == base.data_ptr() + o * x.element_size()
               for x, o in zip(flat, offsets)):
            return base.view(batch, length, width)
    return torch.cat(flat, dim=-1)


def sequence_parallel_of(module) -> SequenceParallel:
    """What the layer exchanges over (size 1: no exchange, the layer sees the whole sequence); one function, so a
    negative control (tests/dist_worker.py) can take the exchange away from every recurrent mixer at once."""
    return module.sequence_parallel


def register_direct_weights(layer, weights) -> None:
    """Weights the Ulysses forward reads directly instead of through their module's forward (conv filters, decay
    parameters) are registered with ZeRO-3 as external parameters of the layer, so they are gathered whenever the
    layer runs (forward, recompute, backward)."""
    from deepspeed.runtime.zero.partition_parameters import register_external_parameter

    for weight in weights:
        if weight is not None and hasattr(weight, "ds_id"):  # built under ZeRO-3
            register_external_parameter(layer, weight)
