"""RMSNorm implementations one norm at a time: Hugging Face's, rmsnorm.py's low-memory one, torch's own.

    python benchmarks/profile_rmsnorm.py --tokens 131072 --json OUT/rmsnorm_profile.json [--profile OUT/trace.txt]

On the H200 the lever costs ~0.1 s per norm per step at 128K tokens of Qwen3-4B (RESULTS.md), about a
hundred times what its memory traffic needs. This isolates one norm of each shape the model has (the
hidden-size norms, and q_norm / k_norm over head_dim) and times forward and backward of each
implementation separately (median of --repeats, after a warm-up), with the peak memory each adds, the
largest difference of its output and input gradient from Hugging Face's, and the aten ops it ran.
`torch_rms_norm` (torch.nn.functional.rms_norm) is the candidate for the elementwise traffic the norms
cause (benchmarks/elementwise_census.py): on CUDA its `ops` should show `_fused_rms_norm`.
`--profile FILE` also writes torch.profiler's table of the low-memory backward's kernels.
Runs on CPU too (small --tokens), which is how it is tested.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Qwen3-4B: hidden 2560, 32 query heads and 8 KV heads of head_dim 128
SHAPES = {"hidden": (1, 2560), "q_norm": (32, 128), "k_norm": (8, 128)}


def synchronize():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def make_norm(kind: str, width: int, device: str):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from ulysses_train.model.rmsnorm import replace_rmsnorms

    norm = Qwen3RMSNorm(width, eps=1e-6).to(device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.add_(0.1 * torch.randn_like(norm.weight))
    if kind == "low_memory":
        replace_rmsnorms(norm)
    elif kind == "torch_rms_norm":
        # torch's own RMSNorm: on CUDA (torch >= 2.9) one fused kernel each way that saves only the input and
        # one fp32 scale per row. It multiplies the weight before the single cast to bf16, where Qwen3's
        # module casts first: outputs differ by bf16 rounding (reported as max_rel_diff_vs_hf)
        def forward(x, norm=norm):
            return torch.nn.functional.rms_norm(x, (width,), norm.weight, norm.variance_epsilon)
        norm.forward = forward
    return norm


IMPLEMENTATIONS = ("hugging_face", "low_memory", "torch_rms_norm")


class OpNames(TorchDispatchMode):
    """The aten ops one call runs (below autograd): shows whether torch's fused kernel was reached."""

    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func._schema.name.split("::")[-1])
        return func(*args, **(kwargs or {}))


def outputs(norm, x, grad):
    x = x.detach().requires_grad_(True)
    with OpNames() as ops:
        out = norm(x)
        out.backward(grad)
    return out.detach(), x.grad, sorted(ops.names)


def max_rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def time_one(norm, x, grad) -> tuple[float, float, float]:
    """(forward s, backward s, peak bytes above the inputs) for one call."""
    x = x.detach().requires_grad_(True)
    synchronize()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
    t0 = time.perf_counter()
    out = norm(x)
    synchronize()
    t1 = time.perf_counter()
    out.backward(grad)
    synchronize()
    t2 = time.perf_counter()
    peak = (torch.cuda.max_memory_allocated() - base) if torch.cuda.is_available() else 0
    return t1 - t0, t2 - t1, peak


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default="")
    ap.add_argument("--profile", default="", help="write the profiler table of the low-memory backward here")
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    rows = []
    for shape_name, (heads, width) in SHAPES.items():
        x = torch.randn(1, args.tokens, heads, width, device=device, dtype=torch.bfloat16).squeeze(2)
        grad = torch.randn_like(x)
        reference = None
        for kind in IMPLEMENTATIONS:
            torch.manual_seed(1)  # the same weights for every implementation
            norm = make_norm(kind, width, device)
            out, grad_x, ops = outputs(norm, x, grad)
            reference = reference or (out, grad_x)
            time_one(norm, x, grad)  # warm-up
            runs = [time_one(norm, x, grad) for _ in range(args.repeats)]
            row = {"shape": shape_name, "elements": x.numel(), "impl": kind,
                   "forward_ms": 1e3 * statistics.median(r[0] for r in runs),
                   "backward_ms": 1e3 * statistics.median(r[1] for r in runs),
                   "peak_gib": max(r[2] for r in runs) / 2**30,
                   "max_rel_diff_vs_hf": {"output": max_rel_diff(out, reference[0]),
                                          "input_grad": max_rel_diff(grad_x, reference[1])},
                   "ops": ops}
            rows.append(row)
            print(f"{shape_name:8s} {kind:13s} forward {row['forward_ms']:8.2f} ms  backward {row['backward_ms']:8.2f} ms"
                  f"  peak +{row['peak_gib']:.2f} GiB", flush=True)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        heads, width = SHAPES["hidden"]
        x = torch.randn(1, args.tokens, width, device=device, dtype=torch.bfloat16, requires_grad=True)
        norm = make_norm("low_memory", width, device)
        out = norm(x)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        with profile(activities=activities) as prof:
            out.backward(torch.randn_like(out))
            synchronize()
        sort = "cuda_time_total" if device == "cuda" else "cpu_time_total"
        with open(args.profile, "w") as fh:
            fh.write(prof.key_averages().table(sort_by=sort, row_limit=25))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"tokens": args.tokens, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                       "torch": torch.__version__, "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
