"""Where a training step's device time goes: one step under torch.profiler, its kernels' time summed by kind of
work (attention, matmul, the gated delta rule, copies, ...), the costliest kernels by name, and on request the
aten ops (and the Python lines) that launched them.

    from ulysses_train.diagnostics.step_time import profile_device_time
    row = profile_device_time(lambda: train_step(run, [sample]), cuda=True)

scripts/bench.py (`--time-breakdown`, `--time-breakdown-ops`) and benchmarks/peer_trl.py profile both sides of a
comparison with these same kinds. The profiled step runs slower than an unprofiled one: compare shares, not
seconds, across steps.
"""
from __future__ import annotations

import time

# first match wins; names are CUDA kernel names on a GPU, aten op names on CPU
KERNEL_KINDS = (
    ("communication", ("nccl", "all_to_all", "allgather", "all_gather", "reduce_scatter", "gloo")),
    ("attention", ("fmha", "flash", "sdpa", "attention", "scaled_dot_product")),
    # fla's Triton kernels of the gated delta rule (and its L2 norm, decay cumsum, WY solve), FlashQLA's TileLang
    # ones (TileLang names a kernel after its function: `main_kernel`, or FlashQLA's fused_gdr_*)
    ("gated delta rule", ("delta_rule", "chunk_fwd_kernel", "chunk_bwd_kernel", "wy_repr", "recompute_w_u", "kkt",
                          "inverse_kernel", "solve_tril", "l2norm", "cumsum", "_dhu", "gdr", "main_kernel",
                          "prepare_h", "dqkwg", "dv_local")),
    ("causal conv1d", ("conv1d", "causal_conv")),
    ("norms", ("rms_norm", "rmsnorm", "layer_norm", "norm_gate", "layernorm")),
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "aten::mm", "aten::addmm", "aten::bmm", "aten::matmul")),
    ("host copies (offload)", ("memcpy htod", "memcpy dtoh")),
    ("copy", ("memcpy", "memset", "aten::copy_", "aten::_to_copy", "copy_kernel", "cat_")),
)

TOP_KERNELS = 40
"""Kernels listed by name in a profile row, costliest first."""

TOP_OPS = 25
"""aten ops (and op-and-stack groups) listed in a profile row with ops, costliest first."""

STACK_FRAMES = 8
"""Python frames kept per op-and-stack group: enough to reach the model code from torch's own frames."""


def kernel_kind(name: str) -> str:
    """Which kind of work a kernel (or, on CPU, an aten op) is: KERNEL_KINDS, else 'elementwise and other'."""
    lowered = name.lower()
    for kind, needles in KERNEL_KINDS:
        if any(needle in lowered for needle in needles):
            return kind
    return "elementwise and other"


def profile_device_time(step, cuda: bool, ops: bool = False) -> dict:
    """Run `step()` once under torch.profiler. On a GPU: each kernel's own device time, by kind and by name; on
    CPU each aten op's self time. `ops` (GPU): CPU events too, with Python stacks, so each aten op's kernels are
    charged to it and to the lines that called it (`device_time_by_op`, `device_time_by_stack`). That records
    every op the checkpointing's dispatch modes route through Python, which made a full-depth 128K step too slow
    to finish in 290 s: use it at reduced depth."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    if cuda and ops:
        activities.append(ProfilerActivity.CPU)
    started = time.perf_counter()
    with profile(activities=activities, with_stack=cuda and ops) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    row = {"profiled_step_s": round(time.perf_counter() - started, 3), **time_by_kind(prof.key_averages(), cuda)}
    if cuda and ops:
        row["device_time_by_op"] = ops_by_device_time(prof.key_averages())
        row["device_time_by_stack"] = ops_by_device_time(prof.key_averages(group_by_stack_n=STACK_FRAMES),
                                                         with_stack=True)
    return row


def time_by_kind(events, cuda: bool) -> dict:
    """The kernels' (GPU) or aten ops' (CPU) own time summed by kernel_kind, and the TOP_KERNELS costliest."""
    by_kind, kernels = {}, []
    for event in events:
        if cuda:
            if "cuda" not in str(getattr(event, "device_type", "")).lower():
                continue
            us = getattr(event, "self_device_time_total", 0) or getattr(event, "self_cuda_time_total", 0)
        else:
            if not event.key.startswith("aten::"):
                continue
            us = event.self_cpu_time_total
        if us <= 0:
            continue
        kind = kernel_kind(event.key)
        by_kind[kind] = by_kind.get(kind, 0.0) + us / 1e6
        kernels.append((us / 1e6, event.key[:120], kind))
    kernels.sort(reverse=True)
    return {"time_by_kind_s": {k: round(v, 3) for k, v in sorted(by_kind.items())},
            "top_kernels": [{"s": round(s, 4), "name": n, "kind": k} for s, n, k in kernels[:TOP_KERNELS]]}


def ops_by_device_time(events, with_stack: bool = False) -> list[dict]:
    """The aten ops whose directly launched kernels took the most device time (a CPU event's self device time),
    with their calls and, grouped by stack, the Python lines that called them (torch's own frames left out)."""
    rows = []
    for event in events:
        us = getattr(event, "self_device_time_total", 0) or 0
        if us <= 0 or not event.key.startswith("aten::"):
            continue
        row = {"s": round(us / 1e6, 4), "op": event.key, "calls": event.count}
        if with_stack:
            row["stack"] = [frame for frame in (getattr(event, "stack", None) or [])
                            if "torch/" not in frame and "<built-in" not in frame]
        rows.append(row)
    rows.sort(key=lambda r: -r["s"])
    return rows[:TOP_OPS]
