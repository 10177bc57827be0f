"""Record GPU memory through one training step: a snapshot for PyTorch's viewer and a PNG.

    with MemoryProfile("outputs/run/memory", tag="step_00000002", module=run.module,
                       optimizer=run.deepspeed.optimizer, rank=rank):
        train_step(run, samples)

writes (rank 0 by default) `<tag>_rank0.pickle` (open it at https://pytorch.org/memory_viz),
`<tag>_rank0_markers.json`, `<tag>_rank0.png`: allocated and reserved memory over time with the
forward, loss, backward and optimizer phases shaded, and `<tag>_rank0_peak.json`: the blocks alive at the peak and
the lines that made them (diagnostics/memory_peak.py).

Phases are found from hooks: the decoder's forward starts "forward", the lm_head's forward (the chunked
loss) starts "loss" and its return starts "backward" (the trainer calls backward right after); the
optimizer's step starts "optimizer". Each marker allocates a tiny CUDA tensor that stays alive until
the step ends, so its own `alloc` event pins the marker to an exact place in the allocator's trace,
whatever the clocks. Recording costs time (the profiled step is slower), so record one step only.

On a machine without CUDA this is a no-op that says so.
"""
from __future__ import annotations

import json
import os
import pickle
import sys
import time
from typing import Optional

import torch

CPU_MESSAGE = "memory profile: CUDA is not available, so nothing is recorded (--profile-memory needs a GPU)."


def _in_backward() -> bool:
    try:
        return torch._C._current_graph_task_id() != -1
    except AttributeError:  # pragma: no cover - older torch
        return False


def _torch_optimizer(optimizer):
    """The torch.optim.Optimizer inside DeepSpeed's wrappers (ZeRO-3 keeps it as `.optimizer`)."""
    for _ in range(4):
        if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None)
    return None


class MemoryProfile:
    """Context manager: record the CUDA allocator's history for the block, write snapshot + PNG on exit."""

    def __init__(self, out_dir: str, tag: str = "step", module=None, optimizer=None, rank: int = 0,
                 all_ranks: bool = False, max_entries: int = 2_000_000, verbose: bool = True):
        self.out_dir, self.tag, self.module, self.optimizer = out_dir, tag, module, optimizer
        self.rank, self.max_entries, self.verbose = rank, max_entries, verbose
        self.writes = all_ranks or rank == 0
        self.enabled = torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.enabled else torch.device("cpu")
        self.markers: list[dict] = []
        self.paths: dict = {}
        self.summary: Optional[dict] = None
        self.peak: Optional[dict] = None
        self._keep: list = []
        self._hooks: list = []

    # ------------------------------------------------------------ markers

    def mark(self, name: str) -> None:
        """Record that phase `name` starts now (ignored inside autograd's backward, e.g. recompute)."""
        if not self.enabled or (name in ("forward", "loss", "backward") and _in_backward()):
            return
        if self.markers and self.markers[-1]["name"] == name:
            return
        sentinel = torch.empty(1, device=self.device)
        self._keep.append(sentinel)
        self.markers.append({"name": name, "addr": sentinel.untyped_storage().data_ptr(), "time_s": time.time()})

    def _install_hooks(self) -> None:
        causal_lm = getattr(self.module, "causal_lm", self.module)
        if causal_lm is not None and hasattr(causal_lm, "get_decoder"):
            from ulysses_train.model.architecture import decoder_of

            decoder, lm_head = decoder_of(causal_lm), causal_lm.get_output_embeddings()
            self._hooks.append(decoder.register_forward_pre_hook(lambda *_: self.mark("forward")))
            if lm_head is not None:
                self._hooks.append(lm_head.register_forward_pre_hook(lambda *_: self.mark("loss")))
                self._hooks.append(lm_head.register_forward_hook(lambda *_: self.mark("backward")))
        inner = _torch_optimizer(self.optimizer)
        if inner is not None and hasattr(inner, "register_step_pre_hook"):
            self._hooks.append(inner.register_step_pre_hook(lambda *_: self.mark("optimizer")))

    # ------------------------------------------------------------ context

    def __enter__(self) -> "MemoryProfile":
        if not self.enabled:
            if self.verbose and self.rank == 0:
                print(CPU_MESSAGE, flush=True)
            return self
        torch.cuda.synchronize()
        torch.cuda.memory._record_memory_history("all", context="alloc", stacks="python",
                                                 max_entries=self.max_entries)
        self._install_hooks()
        self.mark("start")
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if not self.enabled:
            return False
        try:
            self.mark("end")
            torch.cuda.synchronize()
            snapshot = torch.cuda.memory._snapshot()
        finally:
            torch.cuda.memory._record_memory_history(None)
            for hook in self._hooks:
                hook.remove()
            self._hooks, self._keep = [], []
        if self.writes:
            self._write(snapshot)
        return False

    def write_peak(self, snapshot: dict, path: str) -> None:
        """What is alive at the peak (diagnostics/memory_peak.py), as JSON beside the snapshot: the composition a
        planner gap is read from."""
        from ulysses_train.diagnostics.memory_peak import allocations_at_peak

        self.peak = allocations_at_peak(snapshot, self.device.index, markers=self.markers)
        with open(path, "w") as fh:
            json.dump(self.peak, fh, indent=1)
        self.paths["peak"] = path

    def _write(self, snapshot: dict) -> None:
        os.makedirs(self.out_dir, exist_ok=True)
        stem = os.path.join(self.out_dir, f"{self.tag}_rank{self.rank}")
        self.paths = {"snapshot": f"{stem}.pickle", "markers": f"{stem}_markers.json"}
        with open(self.paths["snapshot"], "wb") as fh:
            pickle.dump(snapshot, fh)
        with open(self.paths["markers"], "w") as fh:
            json.dump(self.markers, fh, indent=1)
        self.write_peak(snapshot, f"{stem}_peak.json")
        try:
            from ulysses_train.diagnostics.plots import GIB, plot_memory_timeline

            line = plot_memory_timeline(snapshot, f"{stem}.png", self.markers,
                                        title=f"GPU memory, {self.tag}, rank {self.rank}",
                                        device=self.device.index)
            self.paths["png"] = f"{stem}.png"
            self.summary = {"peak_allocated_gib": line["peak_allocated"] / GIB,
                            "phases": [(n, round(a, 3), round(b, 3)) for n, a, b in line["phases"]]}
        except ImportError:
            print(f"memory profile: matplotlib is not installed, no PNG; draw it later with `python -m "
                  f"ulysses_train.diagnostics.plots memory {self.paths['snapshot']} {stem}.png --markers "
                  f"{self.paths['markers']}`.", file=sys.stderr, flush=True)
        if self.verbose:
            peak = f", peak allocated {self.summary['peak_allocated_gib']:.2f} GiB" if self.summary else ""
            print(f"memory profile of {self.tag} written: {', '.join(self.paths.values())}{peak}", flush=True)
