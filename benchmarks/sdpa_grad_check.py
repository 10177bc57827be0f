"""Are SDPA's GPU backends' gradients right for the layouts the model gives them? (CUDA only)

    python benchmarks/sdpa_grad_check.py --length 16384 --json OUT/sdpa_grad_check.json

For each backend (cuDNN, flash, memory-efficient, PyTorch's default order, and `sdpa_priority()`, what the
trainer uses) one causal attention forward and backward in bf16 runs on Qwen3-0.6B-like heads (16 query
heads, 8 KV heads, head_dim 128), with the gradient of the output given as Hugging Face gives it: the
transpose of a [batch, seq, heads, dim] tensor, i.e. not contiguous in [batch, heads, seq, dim]. Out, dq, dk
and dv are compared with the same computation in fp32 through the math backend; a backend whose relative
error is far above the others' is wrong, not imprecise.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch


def attention(q, k, v, grad_out, backend, gqa):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ulysses_train.model.attention import sdpa_priority

    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    if backend == "priority":
        context = sdpa_priority()
    elif backend == "default":
        context = torch.autograd.graph.saved_tensors_hooks(lambda x: x, lambda x: x)  # no-op context
    else:
        context = sdpa_kernel([getattr(SDPBackend, backend)])
    with context:
        if gqa:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            groups = q.shape[1] // k.shape[1]
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), is_causal=True)
        out.backward(grad_out.to(out.dtype))
    return out.detach().float(), q.grad.float(), k.grad.float(), v.grad.float()


def relative(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    shape = (1, args.length, args.heads, args.head_dim)
    # Hugging Face's layout: projections give [b, s, h, d], attention sees the transpose [b, h, s, d]
    q = torch.randn(shape, device="cuda").transpose(1, 2)
    k = torch.randn(1, args.length, args.kv_heads, args.head_dim, device="cuda").transpose(1, 2)
    v = torch.randn(1, args.length, args.kv_heads, args.head_dim, device="cuda").transpose(1, 2)
    grad_out = torch.randn(shape, device="cuda").transpose(1, 2)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH]):
        exact = attention(q, k, v, grad_out, "MATH", gqa=False)
    low = [t.bfloat16() for t in (q, k, v)]
    rows = []
    for backend in ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "default", "priority"):
        for gqa in (True, False):
            try:
                got = attention(*low, grad_out.bfloat16(), backend, gqa)
                errors = {name: relative(g, e) for name, g, e in zip(("out", "dq", "dk", "dv"), got, exact)}
            except RuntimeError as exc:
                errors = {"error": str(exc).splitlines()[0][:120]}
            rows.append({"backend": backend, "enable_gqa": gqa, **errors})
            print(json.dumps(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"length": args.length, "torch": torch.__version__, "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
