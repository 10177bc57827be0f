"""What one step spends beyond the steady state, by cause: kernels compiled on first use, host buffers made.

A run's first step is slower than its second (at 262,144 tokens on an H200 the first Qwen3.5-9B step once took
126.3 s and the second 66.3 s, benchmarks/RESULTS.md). Compiling is one cause, and it leaves traces: files appear
in the kernel caches (first_use_kernels.cache_folders), and compiler subprocesses (nvcc for TileLang, ptxas for
Triton) burn CPU seconds, counted here as the children's CPU time. FlashAttention 4's CuTe DSL compiles inside
the process (its own CPU time) and exports each kernel to its disk cache. The activation offload is another
cause: its pinned host buffers are allocated and page-locked in the first step and reused after. scripts/bench.py
records these for each step it runs, so a first step's extra seconds have their causes beside them.
"""
from __future__ import annotations

import contextlib
import resource
import time
from dataclasses import asdict, dataclass, field


@dataclass
class StepCosts:
    seconds: float = 0.0
    cache_files_added: dict = field(default_factory=dict)  # compiler -> files its kernel cache gained
    compiler_cpu_s: float = 0.0  # CPU seconds of finished child processes (the compilers nvcc, ptxas)
    process_cpu_s: float = 0.0   # CPU seconds of this process (Python, in-process compiles, kernel launches)
    pinned_alloc_s: float = 0.0  # seconds allocating and page-locking the activation offload's host buffers

    def to_dict(self) -> dict:
        row = asdict(self)
        return {key: round(value, 3) if isinstance(value, float) else value for key, value in row.items()}


def _cpu_seconds(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def _pinned_alloc_seconds(model) -> float:
    from ulysses_train.model.recompute import activation_offloader_of

    offloader = activation_offloader_of(model) if model is not None else None
    return offloader.allocation_seconds() if offloader is not None else 0.0


@contextlib.contextmanager
def measured_step(model=None, synchronize=None):
    """Measure the block (one training step of `model`); yields a StepCosts filled in when the block ends.
    `synchronize`: called before each clock read (torch.cuda.synchronize on GPUs) so the seconds are the device's."""
    from ulysses_train.training.first_use_kernels import cache_file_counts, cache_folders

    folders = cache_folders()
    files = cache_file_counts(folders)
    children, own = _cpu_seconds(resource.RUSAGE_CHILDREN), _cpu_seconds(resource.RUSAGE_SELF)
    pinned = _pinned_alloc_seconds(model)
    costs = StepCosts()
    if synchronize:
        synchronize()
    started = time.perf_counter()
    yield costs
    if synchronize:
        synchronize()
    costs.seconds = time.perf_counter() - started
    costs.cache_files_added = {c: n - files[c] for c, n in cache_file_counts(folders).items()}
    costs.compiler_cpu_s = _cpu_seconds(resource.RUSAGE_CHILDREN) - children
    costs.process_cpu_s = _cpu_seconds(resource.RUSAGE_SELF) - own
    costs.pinned_alloc_s = _pinned_alloc_seconds(model) - pinned


COMPILE_CPU_NOTICED_S = 1.0
"""Compiler-process CPU seconds below this, with no file added to a kernel cache, read as "nothing compiled"."""


def first_step_line(costs: StepCosts) -> str:
    """What the trainer prints after its first step: its seconds and the first-use causes found in them, so a
    slow first step reads as compiling (and how to avoid it) rather than as the run's speed."""
    added = {compiler: n for compiler, n in costs.cache_files_added.items() if n > 0}
    parts = []
    if added or costs.compiler_cpu_s >= COMPILE_CPU_NOTICED_S:
        files = ", ".join(f"{compiler} +{n} files" for compiler, n in added.items()) or "no cache file"
        parts.append(f"kernels compiled on first use ({files}; compiler processes {costs.compiler_cpu_s:.0f} CPU s; "
                     f"scripts/warm_kernels.py compiles them before a run)")
    else:
        parts.append("no kernel compiled (the caches were warm)")
    if costs.pinned_alloc_s > 0:
        parts.append(f"the activation offload's host buffers made and page-locked in {costs.pinned_alloc_s:.1f} s")
    return f"first step: {costs.seconds:.1f} s; {'; '.join(parts)}. Later steps reuse them."
