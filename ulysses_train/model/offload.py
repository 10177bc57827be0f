"""Offload of checkpointed activations to host memory, overlapped with compute.

With gradient checkpointing every decoder layer keeps one tensor from forward to backward: its input
`hidden_states` (seq x hidden), plus the attention output in layers that keep it (recompute.py).
`ActivationOffloader` moves those tensors to host buffers and brings them back just before backward needs
them:

- forward: the device-to-host copy is queued on a side CUDA stream as soon as the tensor is saved (the
  layer input when the layer starts, the attention output when the kernel ends), so it runs while the
  layer computes. `record_stream` tells the caching allocator the source is still being read, so its
  memory is not handed out again before the copy finishes, even though Python drops it;
- backward: when a layer's first tensor is needed, that layer's tensors (if not already on their way) and
  the *previous* layer's (next in backward order) are copied back on the side stream; the compute stream
  waits on an event of the copy only when it actually reads the tensor. One layer of lookahead hides the
  copy behind a whole layer of recompute and backward;
- host buffers come from `PinnedBufferPool`, allocated in the first step and reused afterwards. They are
  plain allocations page-locked with `cudaHostRegister` rather than `pin_memory=True`: PyTorch's pinned
  allocator rounds every block up to a power of two, up to 2x the host memory;
- one copy stream serves both directions, so a buffer's next device-to-host copy is ordered after its last
  host-to-device copy without further synchronisation.

The last decoder layer's input is not offloaded: backward needs it first, so a round trip would only stall.

Why `torch.autograd.graph.saved_tensors_hooks` (rather than a custom autograd Function): non-reentrant
`torch.utils.checkpoint` stores its inputs as saved tensors, so hooks around the checkpoint call receive
exactly the layer input and nothing saved inside the layer (the checkpoint's own, innermost hooks take those).
The checkpoint stays PyTorch's own, with ZeRO-3, sp and transformers' layer wrapper unchanged; transformers'
`save_on_cpu` offload relies on the same mechanism.

Without CUDA the same path runs with ordinary host buffers and synchronous copies: nothing is saved, but
pool, ordering and prefetch logic are exercised (and tested).
"""
from __future__ import annotations

import contextlib
import logging
import time
import weakref
from typing import Optional

import torch

logger = logging.getLogger(__name__)


def cpu_checkpointing_requested(ds_config: Optional[dict]) -> bool:
    """The DeepSpeed JSON switch `activation_checkpointing.cpu_checkpointing`."""
    section = (ds_config or {}).get("activation_checkpointing") or {}
    return bool(section.get("cpu_checkpointing", False))


class PinnedBufferPool:
    """Flat host byte buffers, reused across steps; each request takes the smallest free buffer that fits.

    Keyed by size rather than exact shape, so a step with a different sequence length reuses what fits
    instead of allocating a new set. Buffers are only ever freed by `close()` (or with the pool).
    """

    def __init__(self, pin: bool):
        self.pin = pin
        self._free: list[torch.Tensor] = []
        self._all: list[torch.Tensor] = []
        self.allocation_seconds = 0.0  # spent making new buffers (and page-locking them): the first step's share

    def take(self, nbytes: int) -> torch.Tensor:
        fitting = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
        if fitting:
            return self._free.pop(min(fitting, key=lambda i: self._free[i].numel()))
        started = time.perf_counter()
        buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8)
        if self.pin:
            torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0))
        self._all.append(buffer)
        self.allocation_seconds += time.perf_counter() - started
        return buffer

    def give_back(self, buffer: torch.Tensor) -> None:
        self._free.append(buffer)

    @property
    def total_bytes(self) -> int:
        return sum(b.numel() for b in self._all)

    @property
    def count(self) -> int:
        return len(self._all)

    def close(self) -> None:
        if self.pin:
            for buffer in self._all:
                torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())
        self._free, self._all = [], []

    def __del__(self):
        with contextlib.suppress(Exception):
            self.close()


def _typed_view(buffer: torch.Tensor, shape, stride, dtype) -> torch.Tensor:
    nbytes = _storage_bytes(shape, stride, dtype)
    return buffer[:nbytes].view(dtype).as_strided(shape, stride)


def _storage_bytes(shape, stride, dtype) -> int:
    if any(size == 0 for size in shape):
        return 0
    span = 1 + sum((size - 1) * step for size, step in zip(shape, stride))
    return span * dtype.itemsize


class SavedActivation:
    """One saved tensor: kept as is, or in a host buffer until it is fetched back to `device`."""

    def __init__(self, offloader: "ActivationOffloader", tensor: torch.Tensor, group: Optional[list]):
        self.offloader = offloader
        self.group = group
        self.tensor: Optional[torch.Tensor] = tensor  # on the device: kept, or fetched back
        self.host: Optional[torch.Tensor] = None  # pool buffer while offloaded
        self.shape, self.stride, self.dtype, self.device = tensor.shape, tensor.stride(), tensor.dtype, tensor.device
        self.event = None  # copy back finished (CUDA)
        self.consumed = False

    def __del__(self):  # a graph freed without backward returns its buffer to the pool
        if self.host is not None:
            self.offloader.pool.give_back(self.host)
            self.host = None


class ActivationOffloader:
    """pack/unpack for saved tensors, grouped by checkpointed layer so backward can fetch one layer ahead."""

    def __init__(self):
        self.pool: Optional[PinnedBufferPool] = None  # made at the first offload: pinned for CUDA tensors
        self._groups: list[list] = []  # one per layer, in forward order: weak references to its tensors
        self._group: Optional[list] = None  # the layer now running forward
        self._keep_on_device = False
        self._copy_stream = None
        self.prefetched = 0  # tensors whose copy back was issued one layer ahead
        self.fetched_on_demand = 0  # tensors whose copy back was issued when backward already needed them
        self._logged_cpu = False

    def pinned_bytes(self) -> int:
        """Host memory held by the offload buffers (page-locked on CUDA machines)."""
        return self.pool.total_bytes if self.pool is not None else 0

    def allocation_seconds(self) -> float:
        """Seconds spent allocating and page-locking those buffers (in the first step; later steps reuse them)."""
        return self.pool.allocation_seconds if self.pool is not None else 0.0

    @contextlib.contextmanager
    def layer(self, keep_on_device: bool = False):
        """Everything packed inside belongs to one layer; `keep_on_device` registers the layer for prefetch
        ordering but leaves its tensors where they are."""
        self._groups = [g for g in self._groups if any(_pending(ref) for ref in g)]
        group: list = []
        self._groups.append(group)
        self._group, self._keep_on_device = group, keep_on_device
        try:
            yield
        finally:
            self._group, self._keep_on_device = None, False

    def hooks(self):
        """Saved-tensor hooks that offload what is saved inside them (the checkpoint's inputs)."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    # ------------------------------------------------------------ forward

    @torch.no_grad()
    def pack(self, tensor: torch.Tensor) -> SavedActivation:
        saved = SavedActivation(self, tensor, self._group)
        if self._group is not None:
            self._group.append(weakref.ref(saved))
        if self._keep_on_device or tensor.numel() == 0 or tensor.device.type not in ("cuda", "cpu"):
            return saved
        stride = torch.empty_like(tensor, device="meta").stride()  # dense layout kept (e.g. transposed outputs)
        if self.pool is None:  # page-locking needs CUDA initialised, which a CPU model must not trigger
            self.pool = PinnedBufferPool(pin=tensor.is_cuda)
        buffer = self.pool.take(_storage_bytes(tensor.shape, stride, tensor.dtype))
        host = _typed_view(buffer, tensor.shape, stride, tensor.dtype)
        if tensor.is_cuda:
            stream = self._stream(tensor.device)
            stream.wait_stream(torch.cuda.current_stream(tensor.device))  # the tensor is fully written
            with torch.cuda.stream(stream):
                host.copy_(tensor, non_blocking=True)
            tensor.record_stream(stream)  # its memory is not reused before the copy has read it
        else:
            self._log_cpu_once()
            host.copy_(tensor)
        saved.host, saved.tensor, saved.stride = buffer, None, stride
        return saved

    # ------------------------------------------------------------ backward

    def unpack(self, saved: SavedActivation) -> torch.Tensor:
        if saved.consumed:
            raise RuntimeError("an offloaded activation was unpacked twice: backward through the same graph "
                               "twice (retain_graph) is not supported with activation offload.")
        group = saved.group if saved.group is not None else [weakref.ref(saved)]
        self.fetched_on_demand += self._fetch(group)
        index = next((i for i, g in enumerate(self._groups) if g is saved.group), 0)
        if index > 0:
            self.prefetched += self._fetch(self._groups[index - 1])
        tensor = saved.tensor
        if saved.event is not None:
            torch.cuda.current_stream(tensor.device).wait_event(saved.event)
        saved.tensor, saved.event, saved.consumed = None, None, True
        return tensor

    @torch.no_grad()
    def _fetch(self, group: list) -> int:
        """Issue the copy back to the device for every tensor of `group` still on the host; how many."""
        issued = 0
        for ref in group:
            saved = ref()
            if saved is None or saved.host is None:
                continue
            host = _typed_view(saved.host, saved.shape, saved.stride, saved.dtype)
            # allocated on the compute stream, which will use it; the copy stream first waits for the kernels
            # already queued there, since they may still read memory freed to this allocation
            device_tensor = torch.empty_strided(saved.shape, saved.stride, dtype=saved.dtype, device=saved.device)
            if saved.device.type == "cuda":
                stream = self._stream(saved.device)
                stream.wait_stream(torch.cuda.current_stream(saved.device))
                with torch.cuda.stream(stream):
                    device_tensor.copy_(host, non_blocking=True)
                    saved.event = torch.cuda.Event()
                    saved.event.record(stream)
                device_tensor.record_stream(stream)  # safe to free even if never consumed
            else:
                device_tensor.copy_(host)
            self.pool.give_back(saved.host)  # its next copy in is queued behind this one on the same stream
            saved.host, saved.tensor = None, device_tensor
            issued += 1
        return issued

    def _stream(self, device: torch.device):
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device)
        return self._copy_stream

    def _log_cpu_once(self) -> None:
        if not self._logged_cpu and not torch.cuda.is_available():
            logger.info("activation offload without CUDA: activations are copied into host buffers synchronously "
                        "(the same code path; no memory is saved on a CPU-only machine).")
            self._logged_cpu = True


def _pending(ref) -> bool:
    saved = ref()
    return saved is not None and not saved.consumed
