"""FlashAttention 4's variable-length form (document packing) on the GPU: correct in bf16, and how much faster.

    python benchmarks/varlen_check.py --json out.json

Accuracy: random q, k, v (bf16, GQA) over documents of uneven lengths, through the op the model calls
(`torch.ops.ulysses_train.fa4_forward` with cu_seqlens, autograd for the backward). Two references: the op's
CPU fp32 reference kernel on the same inputs (masks the other documents: independent of FA4's kernels), and
FA4's dense causal kernel run on each document alone (what document packing must equal). Each row gives the
relative error of the output and of dq, dk, dv; the bf16 dense kernel against the fp32 reference is printed as
the yardstick of bf16 rounding.

Speed: forward + backward of one 131,072-token sequence at Qwen3-4B's attention shapes (32 query heads, 8 KV
heads, head dim 128), dense causal against 16 documents of 8,192 tokens (variable-length form).
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from ulysses_train.model import fa4


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def inputs(tokens, heads, kv_heads, dim, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(1, tokens, n, dim, generator=gen, device="cuda", dtype=torch.bfloat16).requires_grad_()
            for n in (heads, kv_heads, kv_heads)]


def forward_backward(q, k, v, grad, cu, longest):
    out, _ = torch.ops.ulysses_train.fa4_forward(q, k, v, q.shape[-1] ** -0.5, True, cu, longest)
    return (out, *torch.autograd.grad(out, (q, k, v), grad))


def accuracy(lengths, heads=8, kv_heads=2, dim=128) -> dict:
    tokens = sum(lengths)
    q, k, v = inputs(tokens, heads, kv_heads, dim)
    grad = torch.randn_like(q)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    got = forward_backward(q, k, v, grad, cu, max(lengths))
    cpu = [t.detach().float().cpu().requires_grad_() for t in (q, k, v)]
    reference = forward_backward(*cpu, grad.float().cpu(), cu.cpu(), max(lengths))
    per_document = [torch.cat(parts, dim=1) for parts in zip(*[
        forward_backward(*(t[:, a:b].detach().requires_grad_() for t in (q, k, v)), grad[:, a:b], None, 0)
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())])]
    dense = forward_backward(*cpu, grad.float().cpu(), None, 0)  # no documents: must differ
    names = ("out", "dq", "dk", "dv")
    row = {"lengths": lengths, "heads": heads, "kv_heads": kv_heads}
    row.update({f"{n}_vs_fp32_reference": relative(a.cpu(), b) for n, a, b in zip(names, got, reference)})
    row.update({f"{n}_vs_dense_per_document": relative(a, b) for n, a, b in zip(names, got, per_document)})
    row.update({f"{n}_dense_per_document_vs_fp32": relative(a.cpu(), b) for n, a, b in zip(names, per_document,
                                                                                          reference)})
    row["out_without_documents_vs_reference"] = relative(dense[0], reference[0])  # negative control
    return row


def timed(fn, repeat=3) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


def speed(tokens=131072, documents=16, heads=32, kv_heads=8, dim=128) -> dict:
    q, k, v = inputs(tokens, heads, kv_heads, dim)
    grad = torch.randn_like(q)
    cu = torch.arange(0, tokens + 1, tokens // documents, dtype=torch.int32, device="cuda")
    dense = timed(lambda: forward_backward(q, k, v, grad, None, 0))
    packed = timed(lambda: forward_backward(q, k, v, grad, cu, tokens // documents))
    flops = 4 * heads * dim * 3 * tokens ** 2 / 2  # causal forward (2 matmuls, half the scores) x3 for fwd+bwd
    return {"tokens": tokens, "documents": documents, "dense_s": round(dense, 4), "packed_s": round(packed, 4),
            "ratio": round(packed / dense, 4), "dense_tflops": round(flops / dense / 1e12, 1),
            "packed_tflops": round(flops / documents / packed / 1e12, 1)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    fa4.register_fa4_attention()
    rows = [accuracy([1000, 17, 2047, 1, 1031]), accuracy([512, 3584])]
    for row in rows:
        print(json.dumps({k: (round(v, 6) if isinstance(v, float) else v) for k, v in row.items()}))
    rows.append(speed())
    print(json.dumps(rows[-1]))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
